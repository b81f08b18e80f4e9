//! The staged trainer (control-room spec §1): a loader thread, one target worker per target
//! device, one drafter worker per drafter device, joined by resizable queues. Drafter worker 0
//! coordinates: it averages the replicas' flat gradients, clips, runs AdamW on the fp32 master
//! weights, hands the new weights back (by copies or NCCL collectives, see [`super::collective`]),
//! writes metrics and checkpoints. Everything is steered through [`TrainerHandle::command`] and
//! observed through [`TrainerHandle::snapshot`].
//!
//! One file per role: `prepare` loads everything before any thread starts; `loader`,
//! `target_stage` and `drafter_stage` are the stages; `coordinator` is drafter worker 0's step
//! and `periodic` its work at step boundaries; `shared` is what they all share. This file starts
//! the threads and is the front ends' handle on them.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use crossbeam_channel::{Receiver, Sender};
use tch::Device;

use super::collective::{ParamsMsg, ReplicaSync};
use super::command::Command;
use super::queue::{QueueName, ResizableQueue};
use crate::aten_ext::graph::GraphLibrary;
use crate::config::TrainConfig;
use crate::data::packer::Packer;
use crate::data::store::TokenStore;
use crate::device_event::DeviceEvents;
use crate::model::{Drafter, FrozenHead, SharedTarget};
use crate::pipeline::distributed::step::StepShare;
use crate::pipeline::distributed::Distributed;
use crate::runtime::{device_name, TorchRuntime};
use crate::telemetry::profile::{ProfileReport, ProfileStats, StageWorkers};
use crate::telemetry::records::{
    EventKind, MetricsRecord, MetricsWriter, Phase, RunHistory, Snapshot, StepRecord,
};
use crate::train::checkpoint::{checkpoints_dir, remove_stale_partials};
use coordinator::Coordinator;
use drafter_stage::{replica, GradMsg};
use loader::loader;
use prepare::Prepared;
use shared::{Status, StopRequest, StopState, EVAL_HISTORY, HISTORY};
use target_stage::{target_worker, TargetPlacement};

pub use shared::Shared;

// The bench's stages-alone measurement (crate::bench) runs the stages' own code.
pub(crate) use coordinator::apply_update;
pub(crate) use drafter_stage::{train_on_item, StageTimer};
pub(crate) use loader::{batch_item, BatchItem};
pub(crate) use prepare::prepare;
pub(crate) use shared::sync_device;
pub(crate) use target_stage::FeatureItem;

mod coordinator;
mod drafter_stage;
mod failure;
mod loader;
mod periodic;
mod prepare;
mod ranks;
mod shared;
mod target_stage;

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOutcome {
    pub phase: Phase,
    pub steps: u64,
    /// The steps the run was to train.
    pub total_steps: u64,
    pub error: Option<String>,
    pub last_checkpoint: Option<PathBuf>,
    pub final_step: Option<StepRecord>,
    /// Why the run stopped before its last step (a command, early stopping), if it did.
    pub stop_reason: Option<String>,
}

/// A running trainer.
pub struct TrainerHandle {
    pub shared: Arc<Shared>,
    threads: Vec<StageThread>,
}

/// Whether the run in `run_dir` ever wrote a checkpoint: a `step-*` folder or `latest` in its
/// `checkpoints/` (what a writer that died left, dot-named, does not count). A resume of a run
/// without one starts from step 0.
pub(crate) fn ever_checkpointed(run_dir: &Path) -> bool {
    std::fs::read_dir(checkpoints_dir(run_dir))
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| !e.file_name().to_string_lossy().starts_with('.'))
}

/// Starts a run: loads everything, then the stage threads. Errors before the threads start
/// (configuration, inputs, models) come back here. A `resume` of a run that has no checkpoint
/// yet (see [`ever_checkpointed`]) starts from step 0, its metrics kept up to there.
pub fn start(
    runtime: &TorchRuntime,
    config: &TrainConfig,
    run_dir: &Path,
    resume: bool,
) -> Result<TrainerHandle> {
    start_with(runtime, config, run_dir, resume, None)
}

/// [`start`] as one rank of a multi-process run (`dist`, see docs/distributed.md), or as a
/// single process (`None`). Every rank resumes from `run_dir`'s checkpoints (rank 0's,
/// on a file system they share); rank 0 writes checkpoints and records there, any other
/// rank only its own records, in `run_dir/ranks/rank-N/`.
pub fn start_with(
    runtime: &TorchRuntime,
    config: &TrainConfig,
    run_dir: &Path,
    resume: bool,
    dist: Option<Arc<Distributed>>,
) -> Result<TrainerHandle> {
    let leader = dist.as_ref().is_none_or(|d| d.is_leader());
    let from_checkpoint = resume && ever_checkpointed(run_dir);
    let prepared = prepare(runtime, config, from_checkpoint.then_some(run_dir), leader)?;
    let records_dir = match &dist {
        Some(d) if !leader => rank_dir(run_dir, d.rank()),
        _ => run_dir.to_path_buf(),
    };
    std::fs::create_dir_all(&records_dir)
        .with_context(|| format!("cannot create {}", records_dir.display()))?;
    if leader {
        for gone in remove_stale_partials(run_dir) {
            log::info!("removed {}, left by a writer that is gone", gone.display());
        }
    }
    let share = match &dist {
        Some(d) => StepShare::of_rank(d.rank(), d.world(), config.step_batches()),
        None => StepShare::whole(config.step_batches()),
    };
    let run_dir = records_dir.as_path();
    let metrics_path = run_dir.join("metrics.jsonl");
    let (metrics, before) = if resume {
        let metrics = MetricsWriter::open_resumed(&metrics_path, prepared.start_step)?;
        (metrics, RunHistory::read(&metrics_path)?)
    } else {
        (MetricsWriter::open(&metrics_path)?, RunHistory::default())
    };
    let metrics = metrics.with_tensorboard(run_dir, prepared.start_step);
    let stop = Arc::new(AtomicBool::new(false));
    let shared = Arc::new(Shared {
        batch_q: ResizableQueue::new(
            QueueName::Batch,
            config.pipeline.batch_queue_depth,
            stop.clone(),
        ),
        feature_q: ResizableQueue::new(
            QueueName::Feature,
            config.pipeline.feature_queue_depth,
            stop.clone(),
        ),
        stop,
        paused: AtomicBool::new(false),
        pause_lock: Mutex::new(()),
        pause_cv: Condvar::new(),
        checkpoint_requested: AtomicBool::new(false),
        stop_requested: StopRequest::default(),
        profile: ProfileStats::with_workers(StageWorkers {
            targets: prepared.target_devices.len(),
            drafters: prepared.drafter_devices.len(),
        }),
        profile_interval_s: Mutex::new(config.telemetry.profile_interval_s),
        status: Mutex::new(Status {
            phase: Some(Phase::WarmingUp),
            step: prepared.start_step,
            epoch: prepared.start_epoch,
            tokens_seen: prepared.tokens_seen,
            samples_seen: prepared.samples_seen,
            stage_devices: prepared
                .target_devices
                .iter()
                .map(|d| ("target".to_string(), device_name(*d)))
                .chain(
                    prepared
                        .drafter_devices
                        .iter()
                        .map(|d| ("drafter".to_string(), device_name(*d))),
                )
                .collect(),
            history: tail(before.steps, HISTORY),
            evals: tail(before.evals, EVAL_HISTORY),
            validations: tail(before.validations, EVAL_HISTORY),
            last_checkpoint: prepared.resumed_from.clone(),
            ..Default::default()
        }),
        metrics,
        sample_visits: (0..prepared.store.len())
            .map(|_| AtomicU32::new(0))
            .collect(),
        started: Instant::now(),
        elapsed_before_s: before.elapsed_s,
        run_dir: run_dir.to_path_buf(),
        run_name: config.run.name.clone(),
        target: prepared
            .targets
            .first()
            .map(|t| crate::model::describe_target(&t.config)),
        total_steps: prepared.total_steps,
        dist: dist.clone(),
        share,
    });
    shared.event(
        EventKind::Start,
        format!(
            "run {} in {}: {} steps from step {}, targets on {:?}, drafters on {:?}",
            config.run.name,
            run_dir.display(),
            prepared.total_steps,
            prepared.start_step,
            prepared.target_devices,
            prepared.drafter_devices
        ),
    );
    spawn_stages(shared, prepared)
}

/// Where rank `rank` (> 0) of a multi-process run keeps its own records.
pub fn rank_dir(run_dir: &Path, rank: usize) -> PathBuf {
    run_dir.join("ranks").join(format!("rank-{rank}"))
}

/// The last `n` of `items`.
fn tail<T>(mut items: Vec<T>, n: usize) -> Vec<T> {
    let cut = items.len().saturating_sub(n);
    items.drain(..cut);
    items
}

/// A stage's thread and its name.
type StageThread = (String, JoinHandle<()>);

fn spawn_stages(shared: Arc<Shared>, p: Prepared) -> Result<TrainerHandle> {
    let config = Arc::new(p.config.clone());
    // The NCCL communicators, if any, before any thread starts.
    let (coordinator_sync, replica_syncs, sync_note) = p.grad_sync.connect(&p.drafter_devices)?;
    shared.event(EventKind::GradSync, sync_note);

    let mut threads = vec![spawn_loader(&shared, &config, p.store.clone(), p.packer)?];
    let taps = p.drafters[0].config.target_layer_ids().to_vec();
    threads.extend(spawn_targets(
        &shared,
        &config,
        p.targets,
        &taps,
        &p.drafter_devices,
        p.side_streams,
    )?);
    // Drafter workers: 0 coordinates.
    let replicas = p.drafters.len();
    let (grad_tx, grad_rx) = crossbeam_channel::unbounded::<GradMsg>();
    let mut param_txs = Vec::new();
    let mut param_rxs = Vec::new();
    for _ in 1..replicas {
        let (tx, rx) = crossbeam_channel::unbounded::<ParamsMsg>();
        param_txs.push(tx);
        param_rxs.push(rx);
    }
    let mut drafters = p.drafters.into_iter();
    let mut heads = p.heads.into_iter();
    let coordinator = Coordinator {
        shared: shared.clone(),
        config: config.clone(),
        drafter: drafters
            .next()
            .ok_or_else(|| anyhow!("no drafter device"))?,
        head: heads.next().ok_or_else(|| anyhow!("no drafter device"))?,
        optimizer: p.optimizer,
        grad_rx,
        param_txs,
        sync: coordinator_sync,
        step: p.start_step,
        total_steps: p.total_steps,
        last_seen: None,
        tokens_seen: p.tokens_seen,
        samples_seen: p.samples_seen,
        last_save: Instant::now(),
        saved_step: None,
        retry: None,
        injected_checkpoint_failures: 0,
        // (rank 0 alone measures, keeps the best drafter and checkpoints)
        held_out: p.held_out.filter(|_| shared.is_leader()),
        queued: None,
        events: DeviceEvents::load(),
        last_step_end: Instant::now(),
    };
    threads.push(spawn_coordinator(&shared, coordinator)?);
    let workers = drafters.zip(heads.zip(param_rxs.into_iter().zip(replica_syncs)));
    threads.extend(spawn_replicas(&shared, &config, workers, &grad_tx)?);
    shared.set_phase(Phase::WarmingUp);
    Ok(TrainerHandle { shared, threads })
}

fn spawn(name: String, f: Box<dyn FnOnce() + Send>) -> Result<StageThread> {
    let h = std::thread::Builder::new()
        .name(name.clone())
        .spawn(f)
        .with_context(|| format!("cannot start thread {name}"))?;
    Ok((name, h))
}

/// The loader; `batch_q` closes when it ends.
fn spawn_loader(
    shared: &Arc<Shared>,
    config: &Arc<TrainConfig>,
    store: Arc<TokenStore>,
    packer: Packer,
) -> Result<StageThread> {
    let shared = shared.clone();
    let cfg = config.clone();
    spawn(
        "loader".into(),
        Box::new(move || {
            run_stage(&shared, "loader", || loader(&shared, store, &cfg, packer));
            shared.batch_q.close();
        }),
    )
}

/// One worker per target device; `feature_q` closes when the last one ends.
fn spawn_targets(
    shared: &Arc<Shared>,
    config: &Arc<TrainConfig>,
    targets: Vec<Arc<SharedTarget>>,
    taps: &[usize],
    drafter_devices: &[Device],
    side_streams: Option<GraphLibrary>,
) -> Result<Vec<StageThread>> {
    let mut threads = Vec::new();
    let n_targets = targets.len();
    let finished_targets = Arc::new(AtomicU32::new(0));
    for (i, target) in targets.into_iter().enumerate() {
        let shared = shared.clone();
        let cfg = config.clone();
        let taps = taps.to_vec();
        let done = finished_targets.clone();
        let shares_device = drafter_devices.contains(&target.device);
        let placement = match side_streams {
            Some(library) if shares_device && target.device.is_cuda() => {
                TargetPlacement::SideStream(library)
            }
            _ if shares_device => TargetPlacement::DrafterStream,
            _ => TargetPlacement::OwnDevice,
        };
        threads.push(spawn(
            format!("target-{i}"),
            Box::new(move || {
                run_stage(&shared, &format!("target worker {i}"), || {
                    target_worker(&shared, &target, &taps, &cfg, placement)
                });
                if done.fetch_add(1, Ordering::SeqCst) + 1 == n_targets as u32 {
                    shared.feature_q.close();
                }
            }),
        )?);
    }
    Ok(threads)
}

/// Drafter worker 0; when it ends, the replicas and every other stage stop.
fn spawn_coordinator(shared: &Arc<Shared>, coordinator: Coordinator) -> Result<StageThread> {
    let shared = shared.clone();
    spawn(
        "drafter-0".into(),
        Box::new(move || {
            let mut c = coordinator;
            run_stage(&shared, "drafter worker 0", || c.run());
            for tx in &c.param_txs {
                let _ = tx.send(ParamsMsg::Stop);
            }
            shared.stop.store(true, Ordering::Relaxed);
            shared.batch_q.wake_all();
            shared.feature_q.wake_all();
        }),
    )
}

/// Drafter workers 1.., each with its drafter, head, weights channel and collective.
fn spawn_replicas(
    shared: &Arc<Shared>,
    config: &Arc<TrainConfig>,
    workers: impl Iterator<Item = (Drafter, (FrozenHead, (Receiver<ParamsMsg>, ReplicaSync)))>,
    grad_tx: &Sender<GradMsg>,
) -> Result<Vec<StageThread>> {
    let mut threads = Vec::new();
    for (r, (drafter, (head, (rx, sync)))) in workers.enumerate() {
        let r = r + 1;
        let shared = shared.clone();
        let cfg = config.clone();
        let tx = grad_tx.clone();
        threads.push(spawn(
            format!("drafter-{r}"),
            Box::new(move || {
                run_stage(&shared, &format!("drafter worker {r}"), || {
                    replica(&shared, &cfg, r, drafter, head, tx, rx, sync)
                });
                // a replica that ends (or fails) stops the step it would have joined
                shared.stop.store(true, Ordering::Relaxed);
                shared.batch_q.wake_all();
                shared.feature_q.wake_all();
            }),
        )?);
    }
    Ok(threads)
}

/// Runs a stage's work, turning a panic into the run's failure like an error: the panic
/// message goes to the log and `metrics.jsonl` and every stage stops (the caller then closes
/// its queues, as after a normal end).
fn run_stage(shared: &Shared, stage: &str, work: impl FnOnce() -> Result<()>) {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
    let error = match outcome {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e,
        Err(payload) => anyhow!(
            "panicked: {}",
            crate::aten_ext::graph::panic_message(payload.as_ref())
        ),
    };
    shared.fail(stage, &error);
}

impl TrainerHandle {
    /// Applies a command; the reply says what happened or why it could not apply.
    pub fn command(&self, cmd: &Command) -> std::result::Result<String, String> {
        let reply = self.apply(cmd);
        // Every operator command and its answer, whichever way it came.
        match &reply {
            Ok(r) => log::info!("command {cmd}: {r}"),
            Err(e) => log::warn!("command {cmd} refused: {e}"),
        }
        reply
    }

    fn apply(&self, cmd: &Command) -> std::result::Result<String, String> {
        let s = &self.shared;
        let phase = s.status().phase;
        if phase.is_some_and(Phase::is_ended) {
            return Err(format!(
                "the run has ended ({}); {cmd} ignored",
                phase.unwrap_or(Phase::Finished)
            ));
        }
        let reply = match cmd {
            Command::Pause => {
                s.paused.store(true, Ordering::SeqCst);
                s.set_phase(Phase::Paused);
                "paused: stages stop at the next item boundary".to_string()
            }
            Command::Resume => {
                s.paused.store(false, Ordering::SeqCst);
                s.pause_cv.notify_all();
                let step = s.status().step;
                s.set_phase(if step > 0 {
                    Phase::Training
                } else {
                    Phase::WarmingUp
                });
                "resumed".to_string()
            }
            Command::Queue { name, depth } => {
                match name {
                    QueueName::Batch => s.batch_q.set_capacity(*depth),
                    QueueName::Feature => s.feature_q.set_capacity(*depth),
                }?;
                format!("{name} depth set to {depth}")
            }
            Command::Checkpoint => {
                s.checkpoint_requested.store(true, Ordering::SeqCst);
                "checkpoint requested for the next step boundary".to_string()
            }
            Command::Profile { seconds } => {
                *s.profile_interval_s
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = *seconds;
                if *seconds > 0.0 {
                    format!("profile interval {seconds} s")
                } else {
                    "profile reports off".to_string()
                }
            }
            Command::Stop { checkpoint } => {
                s.stop_requested.store(if *checkpoint {
                    StopState::AfterCheckpoint
                } else {
                    StopState::WithoutCheckpoint
                });
                // Paused stages must wake up to reach the step boundary.
                s.paused.store(false, Ordering::SeqCst);
                s.pause_cv.notify_all();
                if *checkpoint {
                    "stopping after a checkpoint at the next step boundary".to_string()
                } else {
                    "stopping without checkpoint".to_string()
                }
            }
            Command::Status | Command::Snapshot { .. } => {
                return Err(format!(
                    "{cmd} is answered by the front end, not the trainer"
                ))
            }
        };
        s.metrics.write(&MetricsRecord::Event {
            elapsed_s: s.elapsed_s(),
            kind: EventKind::Command,
            message: format!("{cmd}: {reply}"),
        });
        Ok(reply)
    }

    /// Stops every stage at once (second signal, or a front end that gives up).
    pub fn abort(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.pause_cv.notify_all();
        self.shared.batch_q.wake_all();
        self.shared.feature_q.wake_all();
    }

    /// Ends the run as failed by `what` (the front end): the error is logged, recorded as an
    /// event and in the summary, and every stage stops.
    pub fn fail(&self, what: &str, error: &anyhow::Error) {
        self.shared.fail(what, error);
        self.abort();
    }

    /// Steps done, the phase and the error, without copying the chart history (for polling).
    pub fn progress(&self) -> (u64, Phase, Option<String>) {
        let st = self.shared.status();
        (
            st.step,
            st.phase.unwrap_or(Phase::LoadingModel),
            st.error.clone(),
        )
    }

    pub fn is_finished(&self) -> bool {
        self.threads.iter().all(|(_, h)| h.is_finished())
    }

    pub fn profile_interval_s(&self) -> f64 {
        *self
            .shared
            .profile_interval_s
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Closes the current ProfileStats interval, records and returns the report.
    pub fn profile_report(&self) -> ProfileReport {
        let report = self.shared.profile.report();
        self.shared
            .metrics
            .write(&MetricsRecord::Profile(report.clone()));
        self.shared.status().last_profile = Some(report.clone());
        report
    }

    pub(crate) fn write_record(&self, record: &MetricsRecord) {
        self.shared.metrics.write(record);
    }

    /// The run as screens show it, with the whole step history (up to [`HISTORY`] records).
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot_with(|history| history.to_vec())
    }

    /// The same with only the step records after `step`: a poll that has the older ones copies
    /// only what is new (the whole history is 20,000 records).
    pub fn snapshot_since(&self, step: u64) -> Snapshot {
        self.snapshot_with(|history| {
            // (pushed step by step: ascending)
            let new = history.partition_point(|r| r.step <= step);
            history[new..].to_vec()
        })
    }

    fn snapshot_with(&self, history: impl FnOnce(&[StepRecord]) -> Vec<StepRecord>) -> Snapshot {
        let s = &self.shared;
        let st = s.status();
        let last = st.history.last().cloned();
        let now = Instant::now();
        let phase = st.phase.unwrap_or(Phase::LoadingModel);
        let remaining = s.total_steps.saturating_sub(st.step);
        let (rates, eta_s) = st.rates.live(now, remaining, phase);
        Snapshot {
            run_name: s.run_name.clone(),
            run_dir: s.run_dir.display().to_string(),
            target: s.target.clone(),
            phase,
            step: st.step,
            total_steps: s.total_steps,
            epoch: st.epoch,
            elapsed_s: s.elapsed_s(),
            eta_s,
            tokens_per_s: rates.tokens_per_s,
            samples_per_s: rates.samples_per_s,
            last,
            history: history(&st.history),
            evals: st.evals.clone(),
            validations: st.validations.clone(),
            queues: s.queue_levels(),
            profile: st.last_profile.clone(),
            profile_interval_s: *s
                .profile_interval_s
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
            gpus: None,
            gpu_error: None,
            host: None,
            stage_devices: st.stage_devices.clone(),
            last_checkpoint: st.last_checkpoint.as_ref().map(|p| p.display().to_string()),
            error: st.error.clone(),
            ranks: Vec::new(),
        }
    }

    /// Waits for every stage and writes the summary record.
    pub fn join(self) -> RunOutcome {
        for (name, h) in self.threads {
            if h.join().is_err() {
                let e = anyhow!("thread {name} panicked");
                self.shared.fail(&name, &e);
            }
        }
        let st = self.shared.status();
        let phase = if st.error.is_some() {
            Phase::Failed
        } else if st.step >= self.shared.total_steps {
            Phase::Finished
        } else {
            Phase::Stopped
        };
        let last = st.history.last().cloned();
        self.shared.metrics.write(&MetricsRecord::Summary {
            phase,
            steps: st.step,
            elapsed_s: self.shared.elapsed_s(),
            tokens_seen: st.tokens_seen,
            samples_seen: st.samples_seen,
            final_loss: last.as_ref().map(|l| l.loss),
            final_accuracy: last.as_ref().map(|l| l.accuracy),
            final_accept_mean: last.as_ref().map(|l| l.accept_mean),
            last_checkpoint: st.last_checkpoint.as_ref().map(|p| p.display().to_string()),
            error: st.error.clone(),
            stop_reason: st.stop_reason.clone(),
        });
        RunOutcome {
            phase,
            steps: st.step,
            total_steps: self.shared.total_steps,
            error: st.error.clone(),
            last_checkpoint: st.last_checkpoint.clone(),
            final_step: last,
            stop_reason: st.stop_reason.clone(),
        }
    }
}
