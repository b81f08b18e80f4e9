//! Drafter worker 0, the coordinator: per step it trains on its own share, gathers the
//! replicas' gradients, averages and clips them, runs AdamW on the fp32 master weights, hands
//! the new weights back, and records the step. Evaluation, validation and checkpoints at step
//! boundaries are in [`super::periodic`].

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::pipeline::distributed::step::Decision;
use crossbeam_channel::{Receiver, Sender};
use tch::{Device, Tensor};

use super::drafter_stage::{accumulate, warm_up_attention, GradMsg, MicroResult};
use super::shared::{sync_device, Shared, HISTORY};
use crate::aten_ext::fused::FusedKernels;
use crate::config::TrainConfig;
use crate::data::packer::PackerState;
use crate::device_event::{DeviceEvent, DeviceEvents};
use crate::eval::cancel::is_cancelled;
use crate::model::{Drafter, FrozenHead};
use crate::pipeline::collective::{CoordinatorSync, ParamsMsg};
use crate::pipeline::distributed::step::sum_step;
use crate::pipeline::held_out::HeldOut;
use crate::telemetry::profile::ProfileEvent;
use crate::telemetry::records::{EventKind, MetricsRecord, Phase, StepRecord};
use crate::train::loss::{LossSums, LossTensors};
use crate::train::optim::{lr_at, AdamW};

/// An optimizer step whose work is queued on the device and whose numbers (loss sums, gradient
/// norm) were not read yet: they are read once the next step's work is queued behind them.
pub(super) struct QueuedStep {
    /// The step number after the update.
    step: u64,
    epoch: u64,
    tokens_seen: u64,
    samples_seen: u64,
    /// On the device, or host copies queued behind the step's work (see `ready`).
    sums: LossTensors,
    grad_norm: Tensor,
    ready: Readiness,
    lr: f64,
    tokens: u64,
    samples: u64,
    started: Instant,
}

/// When the numbers of a [`QueuedStep`] can be read.
pub(super) enum Readiness {
    /// They are on the device: reading them waits for it.
    OnDevice,
    /// Host copies, there once this event (recorded after them) has passed.
    AfterEvent(DeviceEvent),
    /// Host copies, but the runtime gave no event: there once the device has finished.
    AfterDevice,
}

/// A step's contributions from every drafter worker.
struct Gathered {
    sums: LossTensors,
    tokens: u64,
    samples: u64,
    /// (seq, resume, epoch) of the newest batch consumed
    newest: Option<(u64, PackerState, u64)>,
    /// The replicas' flat gradients, in replica (rank) order.
    grads: Vec<Tensor>,
    /// Their NCCL weight buffers (none without NCCL), in the same order.
    buffers: Vec<Tensor>,
}

/// How long the coordinator waits for features before it looks at pauses and requests again.
const FEATURE_POLL: std::time::Duration = std::time::Duration::from_millis(50);

pub(super) struct Coordinator {
    pub(super) shared: Arc<Shared>,
    pub(super) config: Arc<TrainConfig>,
    pub(super) drafter: Drafter,
    pub(super) head: FrozenHead,
    pub(super) optimizer: AdamW,
    pub(super) grad_rx: Receiver<GradMsg>,
    pub(super) param_txs: Vec<Sender<ParamsMsg>>,
    pub(super) sync: CoordinatorSync,
    pub(super) step: u64,
    pub(super) total_steps: u64,
    /// (seq, resume, epoch) of the newest batch consumed
    pub(super) last_seen: Option<(u64, PackerState, u64)>,
    pub(super) tokens_seen: u64,
    pub(super) samples_seen: u64,
    pub(super) last_save: Instant,
    /// The step this process last saved (the same step is not written twice).
    pub(super) saved_step: Option<u64>,
    /// After a failed checkpoint: the step at which to try again, and the gap to the next try.
    pub(super) retry: Option<(u64, u64)>,
    /// Checkpoint failures injected so far (`[debug]`).
    pub(super) injected_checkpoint_failures: u64,
    pub(super) held_out: Option<HeldOut>,
    pub(super) queued: Option<QueuedStep>,
    /// CUDA events (see [`QueuedStep`]); `None` on the CPU or without the CUDA runtime.
    pub(super) events: Option<DeviceEvents>,
    pub(super) last_step_end: Instant,
}

impl Coordinator {
    /// Trains to the last step or until the run stops. A pass cancelled because the run stops
    /// at once (see [`crate::eval::cancel`]) ends it as stopped, not failed (or as the failure
    /// of another stage that stopped it).
    pub(super) fn run(&mut self) -> Result<()> {
        let trained = if self.shared.is_leader() {
            let trained = self.train();
            self.release_followers(&trained);
            trained
        } else {
            self.follow()
        };
        match trained {
            Err(e) if is_cancelled(&e) => {
                let mut st = self.shared.status();
                if st.error.is_some() {
                    return Ok(());
                }
                st.stop_reason = Some("at once, no checkpoint".into());
                drop(st);
                self.shared.event(
                    EventKind::Stopped,
                    format!("stopped at once at step {}: {e:#}", self.step),
                );
                Ok(())
            }
            other => other,
        }
    }

    fn train(&mut self) -> Result<()> {
        if self.step >= self.total_steps {
            // Resumed after its last step: measuring and saving the same weights again would
            // only rewrite what the run left.
            self.shared.set_phase(Phase::Finished);
            self.shared.event(
                EventKind::Finished,
                format!(
                    "already finished at step {} of {}; nothing to do",
                    self.step, self.total_steps
                ),
            );
            return Ok(());
        }
        let cfg = self.config.clone();
        warm_up_attention(&self.shared, &self.drafter, &self.head, &cfg, 0);
        let warmup = (cfg.train.warmup_ratio * self.total_steps as f64).round() as u64;
        // time spent below waiting for features: the next step's first wait for its batch
        let mut feature_wait = std::time::Duration::ZERO;
        while self.step < self.total_steps {
            if self.handle_requests()? {
                return Ok(());
            }
            // About to wait (paused, or no features yet): the queued step's numbers first, so
            // that what the operator sees is not a step behind while nothing moves.
            let paused = self.shared.paused.load(Ordering::Relaxed);
            if paused || self.shared.feature_q.is_empty() {
                self.finish_queued()?;
            }
            // A pause takes hold here, between steps (the step in flight when it came has
            // finished): every finished step is on record, and the count holds until the run
            // resumes. The event says when, for the operator and for tests that wait on it.
            if paused {
                // The rates and the ETA leave the pause out (from before its event: what is
                // read after it holds still), and so does the next step's time.
                let paused_at = Instant::now();
                self.shared.status().rates.pause(paused_at);
                self.shared.event(
                    EventKind::Paused,
                    format!("paused at step {}: the next step waits", self.step),
                );
                let going_on = self.wait_paused()?;
                let resumed_at = Instant::now();
                self.shared.status().rates.resume(resumed_at);
                self.last_step_end += resumed_at.duration_since(paused_at);
                if !going_on {
                    return Ok(());
                }
                continue;
            }
            // Features are waited for here, between steps, not inside the step: a pause or a
            // request that comes meanwhile is seen at once. (A step needing more batches than
            // are queued still waits for them inside; a pause then holds it there unannounced.)
            let t = Instant::now();
            let ready = self.shared.feature_q.wait_for_item(FEATURE_POLL);
            feature_wait += t.elapsed();
            if !ready {
                continue;
            }
            self.tell_followers(Decision::Train)?;
            if !self.train_step(&cfg, warmup, std::mem::take(&mut feature_wait))? {
                // stopping: the last step's record still goes out
                return self.finish_queued();
            }
            if self.at_step_boundary(&cfg)? {
                return Ok(());
            }
        }
        self.finish_queued()?;
        self.final_measurements()?;
        self.final_checkpoint("final")?;
        self.shared.set_phase(Phase::Finished);
        self.shared.event(
            EventKind::Finished,
            format!("finished after {} steps", self.step),
        );
        Ok(())
    }

    /// One optimizer step: this worker's share and the replicas' gradients averaged, clipped,
    /// AdamW, the new weights handed back; its numbers are queued (see [`QueuedStep`]). False
    /// when the run stops (or a stage fails) while the step waits.
    /// `feature_wait`: how long the loop already waited for this step's first batch.
    pub(super) fn train_step(
        &mut self,
        cfg: &TrainConfig,
        warmup: u64,
        feature_wait: std::time::Duration,
    ) -> Result<bool> {
        let step_started = Instant::now();
        let Some(res) = accumulate(
            &self.shared,
            cfg,
            &self.drafter,
            &self.head,
            0,
            self.step,
            feature_wait,
        )?
        else {
            return Ok(false);
        };
        let params = self.drafter.named_parameters();
        let t = Instant::now();
        // one replica with the fused kernels: the optimizer reads the gradients where they
        // are; else they go into one flat buffer, for the replicas' sum and the update
        let fused = self.fused_optimizer();
        let mut grad = match fused {
            Some(_) => Tensor::new(),
            None => AdamW::flatten_grads(&params),
        };
        let Some(Gathered {
            sums,
            tokens,
            samples,
            newest,
            grads: others,
            buffers,
        }) = self.gather_replicas(res)?
        else {
            // a stage failed (or the run was aborted) while this step waited
            return Ok(false);
        };
        // (each replica's gradient is already scaled to its share of the step's mean)
        self.sync.reduce(&mut grad, &others)?;
        drop(others);
        // then over the processes: one bucket, the same sum on every rank
        let (sums, tokens, samples) = match &self.shared.dist {
            Some(d) => {
                let (sums, tokens, samples) =
                    sum_step(&d.group, &mut grad, sums.tensor(), tokens, samples)
                        .map_err(|e| super::failure::lost_rank(&self.shared, d, self.step, e))?;
                (LossTensors::from_tensor(sums), tokens, samples)
            }
            None => (sums, tokens, samples),
        };
        self.shared
            .profile
            .record(ProfileEvent::GradSync, t.elapsed());
        let lr = lr_at(
            self.step,
            self.total_steps,
            warmup,
            cfg.train.lr,
            cfg.train.min_lr_ratio,
        );
        let grad_norm = self
            .shared
            .profile
            .time(ProfileEvent::OptimStep, || match &fused {
                Some(kernels) => {
                    self.optimizer
                        .fused_step(&params, kernels, lr, cfg.train.clip_grad_norm)
                }
                None => apply_update(
                    &mut self.optimizer,
                    &params,
                    &mut grad,
                    cfg.train.clip_grad_norm,
                    lr,
                ),
            })?;
        self.sync.hand_back(&params, &buffers, &self.param_txs)?;
        self.step += 1;
        if newest.is_some() {
            self.last_seen = newest;
        }
        self.tokens_seen += tokens;
        self.samples_seen += samples;
        self.queue_step(sums, grad_norm, lr, tokens, samples, step_started)?;
        Ok(true)
    }

    /// The fused kernels the optimizer step runs on, where it can: one replica (no other
    /// drafter device, no other process), the kernels loaded for the drafter's device
    /// (`train.fused_loss`), the optimizer's state there too.
    fn fused_optimizer(&self) -> Option<FusedKernels> {
        let single = self.param_txs.is_empty() && self.shared.dist.is_none();
        self.head.loss_kernels.filter(|k| {
            single && k.device() == self.drafter.device && k.device() == self.optimizer.device
        })
    }

    /// The replicas' contributions to this step, added to this worker's `own`; `None` once the
    /// run stops.
    fn gather_replicas(&self, own: MicroResult) -> Result<Option<Gathered>> {
        let mut sums = own.sums;
        let (mut tokens, mut samples) = (own.tokens, own.samples);
        let mut newest = own.last;
        let mut outgoing = Vec::with_capacity(self.param_txs.len());
        for _ in 0..self.param_txs.len() {
            let Some(msg) = self.receive_replica()? else {
                return Ok(None);
            };
            outgoing.push((msg.replica, msg.out));
            sums.add(&msg.sums);
            tokens += msg.tokens;
            samples += msg.samples;
            if msg
                .last
                .is_some_and(|(s, _, _)| newest.is_none_or(|(n, _, _)| s > n))
            {
                newest = msg.last;
            }
        }
        // the replicas' gradients and NCCL weight buffers in replica (rank) order
        outgoing.sort_by_key(|(replica, _)| *replica);
        let (grads, buffers): (Vec<Tensor>, Vec<Option<Tensor>>) = outgoing
            .into_iter()
            .map(|(_, o)| (o.grad, o.weights))
            .unzip();
        let buffers: Vec<Tensor> = buffers.into_iter().flatten().collect();
        Ok(Some(Gathered {
            sums,
            tokens,
            samples,
            newest,
            grads,
            buffers,
        }))
    }

    /// Queues the numbers of the step just taken and records the step queued before it.
    fn queue_step(
        &mut self,
        sums: LossTensors,
        grad_norm: Tensor,
        lr: f64,
        tokens: u64,
        samples: u64,
        started: Instant,
    ) -> Result<()> {
        // This step's numbers go to the host behind its work, and an event marks their
        // arrival; they are read once the next step is queued, and waiting for the event
        // waits for this step only (a blocking read would wait for everything queued by
        // then, the next step included, and leave the device idle between steps).
        let dev = self.drafter.device;
        let (sums, grad_norm, ready) = match self.events.filter(|_| dev.is_cuda()) {
            Some(events) => {
                let sums = sums.to_host_async();
                let norm = grad_norm.to_device_(Device::Cpu, grad_norm.kind(), true, false);
                let ready = match events.record(dev) {
                    Some(event) => Readiness::AfterEvent(event),
                    None => Readiness::AfterDevice,
                };
                (sums, norm, ready)
            }
            None => (sums, grad_norm, Readiness::OnDevice),
        };
        let queued = QueuedStep {
            step: self.step,
            epoch: self.last_seen.map_or(0, |(_, _, e)| e),
            tokens_seen: self.tokens_seen,
            samples_seen: self.samples_seen,
            sums,
            grad_norm,
            ready,
            lr,
            tokens,
            samples,
            started,
        };
        if let Some(previous) = self.queued.replace(queued) {
            self.finish_step(previous)?;
        }
        Ok(())
    }

    /// The next replica's gradient message; `None` once the run stops (a failed stage must not
    /// leave this thread waiting for a replica that is gone).
    fn receive_replica(&self) -> Result<Option<GradMsg>> {
        loop {
            match self.grad_rx.recv_timeout(Duration::from_millis(100)) {
                Ok(msg) => return Ok(Some(msg)),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    if self.shared.stopping() {
                        return Ok(None);
                    }
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                    bail!("a drafter replica stopped")
                }
            }
        }
    }

    /// Reads the numbers of the step still queued on the device, if any (see [`QueuedStep`]).
    pub(super) fn finish_queued(&mut self) -> Result<()> {
        match self.queued.take() {
            Some(q) => self.finish_step(q),
            None => Ok(()),
        }
    }

    /// The step's record: its numbers read from the device (the step's one wait for it),
    /// written to the metrics and the status.
    fn finish_step(&mut self, q: QueuedStep) -> Result<()> {
        // (numbers on the device: the blocking read below waits for them)
        let copies_pending = match &q.ready {
            Readiness::OnDevice => false,
            Readiness::AfterEvent(event) => !event.wait(),
            Readiness::AfterDevice => true,
        };
        if copies_pending {
            sync_device(self.drafter.device);
        }
        let sums: LossSums = q.sums.to_host();
        let grad_norm = q.grad_norm.double_value(&[]);
        let now = Instant::now();
        let step_s = now
            .duration_since(self.last_step_end)
            .as_secs_f64()
            .max(1e-9);
        self.last_step_end = now;
        self.shared
            .profile
            .record(ProfileEvent::StepTotal, now.duration_since(q.started));
        let rates = {
            let mut st = self.shared.status();
            st.rates.complete(now, q.tokens, q.samples);
            st.rates.windowed(now)
        };
        let record = StepRecord {
            step: q.step,
            epoch: q.epoch,
            loss: sums.loss(),
            accuracy: sums.accuracy(),
            accept_mean: sums.accept_mean(),
            lr: q.lr,
            grad_norm,
            tokens: q.tokens,
            samples: q.samples,
            blocks: sums.blocks.round() as u64,
            step_s,
            tokens_per_s: rates.tokens_per_s,
            samples_per_s: rates.samples_per_s,
            elapsed_s: self.shared.elapsed_s(),
        };
        if !record.loss.is_finite() {
            bail!("step {}: the loss is {} (diverged)", q.step, record.loss);
        }
        self.shared
            .metrics
            .write(&MetricsRecord::Step(record.clone()));
        let mut st = self.shared.status();
        st.step = q.step;
        st.epoch = q.epoch;
        st.tokens_seen = q.tokens_seen;
        st.samples_seen = q.samples_seen;
        if st.history.len() >= HISTORY {
            st.history.remove(0);
        }
        st.history.push(record);
        if st.phase == Some(Phase::WarmingUp) {
            st.phase = Some(Phase::Training);
        }
        Ok(())
    }
}

/// Clip, AdamW on the fp32 master weights, and the new weights into the compute copy; returns
/// the gradient norm before clipping, still on the device.
pub(crate) fn apply_update(
    optimizer: &mut AdamW,
    params: &[(String, &Tensor)],
    grad: &mut Tensor,
    clip: f64,
    lr: f64,
) -> Result<Tensor> {
    let norm = optimizer.update_clipped(grad, lr, clip)?;
    optimizer.write_params(params)?;
    Ok(norm)
}
