//! The drafter workers: each takes its share of a step's batches from `feature_q`, trains on
//! them (forward, loss, backward into the gradients), and replicas 1.. hand their gradients to
//! worker 0, the coordinator (see [`super::coordinator`]), and take the new weights back.

use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::{bail, Result};
use crossbeam_channel::{Receiver, Sender};
use tch::Tensor;

use super::shared::Shared;
use super::target_stage::FeatureItem;
use crate::config::TrainConfig;
use crate::data::packer::PackerState;
use crate::model::{AnchorBatch, Drafter, FrozenHead};
use crate::pipeline::collective::{self, ParamsMsg, ReplicaSync};
use crate::pipeline::queue::QueueClosed;
use crate::telemetry::profile::{ProfileEvent, ProfileStats};
use crate::telemetry::records::EventKind;
use crate::train::loss::{
    block_targets, loss_and_backward_deferred, sample_anchors, LossOptions, LossTensors,
};
use crate::train::optim::AdamW;

/// A replica's contribution to a step.
pub(super) struct GradMsg {
    /// Which replica (1..): its NCCL rank.
    pub(super) replica: usize,
    /// The flat gradient (and with NCCL the weight buffer), see [`collective::Outgoing`].
    pub(super) out: collective::Outgoing,
    pub(super) sums: LossTensors,
    pub(super) tokens: u64,
    pub(super) samples: u64,
    pub(super) last: Option<(u64, PackerState, u64)>,
}

/// Forward and backward of one replica over its micro-batches of a step.
pub(super) struct MicroResult {
    /// On the drafter's device (read once per step by the coordinator).
    pub(super) sums: LossTensors,
    pub(super) tokens: u64,
    pub(super) samples: u64,
    /// (seq, resume state, epoch) of the newest batch consumed
    pub(super) last: Option<(u64, PackerState, u64)>,
}

/// The anchor seed of the batch at `position` (0..) of the global step `step`: it depends on
/// the batch's place in the step, not on which replica or process trains it, so that a step
/// samples the same anchors whatever the layout (a single replica's micro-batch m is the
/// step's batch m, as before).
fn seed_for(seed: u64, step: u64, position: usize) -> u64 {
    crate::seed::mix64(
        seed ^ step.wrapping_mul(crate::seed::GOLDEN_GAMMA) ^ ((position as u64) << 20),
    )
}

/// [`Drafter::warm_up_attention`] on a drafter worker's thread (the kernels' plans are kept
/// per thread), with a line in the log.
pub(super) fn warm_up_attention(
    shared: &Shared,
    drafter: &Drafter,
    head: &FrozenHead,
    cfg: &TrainConfig,
    replica: usize,
) {
    let t = Instant::now();
    let warmed = drafter.warm_up_attention(head, cfg.data.max_len);
    if warmed > 0 {
        shared.event(
            EventKind::WarmUp,
            format!(
                "drafter worker {replica}: attention kernels planned for {warmed} context lengths in {:.1} s",
                t.elapsed().as_secs_f64()
            ),
        );
    }
}

/// What times the parts of [`train_on_item`]: the pipeline's [`ProfileStats`] (host time), or
/// the bench's per-stage clock (device time, and named ranges for its profiler trace).
pub(crate) trait StageTimer {
    fn time<R>(&self, event: ProfileEvent, f: impl FnOnce() -> R) -> R;
}

impl StageTimer for ProfileStats {
    fn time<R>(&self, event: ProfileEvent, f: impl FnOnce() -> R) -> R {
        ProfileStats::time(self, event, f)
    }
}

/// The drafter's work on one batch of target features: anchors, forward, loss, backward
/// (gradients accumulate into the parameters, scaled by `scale`). The loss sums stay on the
/// device: reading them is the step's one synchronisation, after the backward is queued.
pub(crate) fn train_on_item(
    profile: &impl StageTimer,
    cfg: &TrainConfig,
    drafter: &Drafter,
    head: &FrozenHead,
    item: &FeatureItem,
    seed: u64,
    scale: f64,
) -> LossTensors {
    let block = drafter.config.block_size as usize;
    let gamma = cfg.train.effective_gamma(drafter.config.block_size);
    let opts = LossOptions {
        kl_weight: cfg.train.kl_weight,
        kl_temperature: cfg.train.kl_temperature,
        streak_alpha: cfg.train.streak_alpha,
        streak_tau_power: cfg.train.streak_tau_power,
        chunk_rows: LossOptions::chunk_rows_for_vocab(head.lm_head.size()[0]),
        kernels: head.loss_kernels,
    };
    let b = &item.batch;
    let (plan, targets) = profile.time(ProfileEvent::DrafterAnchors, || {
        let plan = sample_anchors(
            &b.mask,
            &b.lengths,
            b.stride,
            block,
            cfg.train.num_anchors,
            seed,
        );
        let targets = block_targets(&b.ids, &b.mask, &b.lengths, b.stride, &plan, block, gamma);
        (plan, targets)
    });
    let dev = drafter.device;
    let rows = plan.rows as i64;
    let batch = AnchorBatch {
        input_ids: Tensor::from_slice(&b.ids).view([rows, b.stride as i64]),
        anchors: Tensor::from_slice(&plan.anchors).view([rows, plan.per_row as i64]),
        valid: Tensor::from_slice(&plan.valid).view([rows, plan.per_row as i64]),
    };
    let hidden = profile.time(ProfileEvent::DrafterForward, || {
        drafter.forward_train(head, &item.features.to_device(dev), &batch)
    });
    let teacher = item.teacher_hidden.as_ref().map(|t| t.to_device(dev));
    let (sums, pending) = profile.time(ProfileEvent::DrafterLoss, || {
        loss_and_backward_deferred(
            &hidden,
            &head.lm_head,
            &targets,
            &plan.valid,
            teacher.as_ref(),
            &opts,
            scale,
        )
    });
    if let Some(p) = pending {
        profile.time(ProfileEvent::DrafterBackward, || p.run());
    }
    sums
}

pub(super) fn accumulate(
    shared: &Shared,
    cfg: &TrainConfig,
    drafter: &Drafter,
    head: &FrozenHead,
    replica: usize,
    step: u64,
    // how long the caller already waited for the first batch (counted as its queue wait)
    first_wait: std::time::Duration,
) -> Result<Option<MicroResult>> {
    let mut out = MicroResult {
        sums: LossTensors::zeros(drafter.device),
        tokens: 0,
        samples: 0,
        last: None,
    };
    // Each batch's gradient counts 1 / (the global step's batches over all replicas of all
    // processes): the sum over them is the mean over the step's batches.
    let micro_batches = cfg.replica_batches(replica);
    let global = shared.share.global;
    let scale = 1.0 / global as f64;
    for micro in 0..micro_batches {
        // Replica 0 runs on the coordinator, which waits out a pause between steps (so that a
        // pause takes hold at a step boundary); the other replicas wait at their next batch.
        let go_on = if replica == 0 {
            !shared.stopping()
        } else {
            shared.wait_if_paused()
        };
        if !go_on {
            return Ok(None);
        }
        let t = Instant::now();
        let item = match shared.feature_q.pop() {
            Ok(i) => i,
            Err(QueueClosed::Stopped) => return Ok(None),
            Err(QueueClosed::Drained) => bail!("the target workers ended before training did"),
        };
        item.hand_over()?;
        let waited_before = if micro == 0 {
            first_wait
        } else {
            std::time::Duration::ZERO
        };
        shared
            .profile
            .record(ProfileEvent::FeatureQWait, t.elapsed() + waited_before);
        let b = &item.batch;
        let sums = train_on_item(
            &shared.profile,
            cfg,
            drafter,
            head,
            &item,
            seed_for(cfg.run.seed, step, (b.seq % global as u64) as usize),
            scale,
        );
        out.sums.add(&sums);
        out.tokens += b.lengths.iter().map(|&l| l as u64).sum::<u64>();
        out.samples += b.samples.len() as u64;
        for &s in &b.samples {
            if let Some(v) = shared.sample_visits.get(s) {
                v.fetch_add(1, Ordering::Relaxed);
            }
        }
        if out.last.is_none_or(|(seq, _, _)| b.seq > seq) {
            out.last = Some((b.seq, b.resume, b.epoch));
        }
    }
    Ok(Some(out))
}

#[allow(clippy::too_many_arguments)]
pub(super) fn replica(
    shared: &Shared,
    cfg: &TrainConfig,
    r: usize,
    drafter: Drafter,
    head: FrozenHead,
    tx: Sender<GradMsg>,
    rx: Receiver<ParamsMsg>,
    mut sync: ReplicaSync,
) -> Result<()> {
    let mut step = shared.status().step;
    sync.prepare(&drafter.named_parameters());
    warm_up_attention(shared, &drafter, &head, cfg, r);
    loop {
        let Some(res) = accumulate(shared, cfg, &drafter, &head, r, step, Default::default())?
        else {
            return Ok(());
        };
        let params = drafter.named_parameters();
        let out = shared.profile.time(ProfileEvent::GradSync, || {
            sync.outgoing(AdamW::flatten_grads(&params))
        });
        if tx
            .send(GradMsg {
                replica: r,
                out,
                sums: res.sums,
                tokens: res.tokens,
                samples: res.samples,
                last: res.last,
            })
            .is_err()
        {
            return Ok(());
        }
        if !sync.exchange(&rx, &params)? {
            return Ok(());
        }
        step += 1;
    }
}
