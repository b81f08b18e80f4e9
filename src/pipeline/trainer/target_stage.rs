//! The target workers: a frozen target's forward over each batch, its tapped hidden states
//! into `feature_q`.

use std::time::Instant;

use anyhow::{anyhow, Result};
use tch::Tensor;

use super::loader::BatchItem;
use super::shared::{injected_failure, sync_device, Shared};
use crate::config::{FailStage, TrainConfig};
use crate::model::layers::upload;
use crate::model::{ForwardRequest, TargetModel};
use crate::telemetry::profile::ProfileEvent;

/// Target features on their way to a drafter worker.
pub(crate) struct FeatureItem {
    pub(crate) batch: BatchItem,
    pub(crate) features: Tensor,
    pub(crate) teacher_hidden: Option<Tensor>,
}

/// `wait_for_device`: wait for each forward to finish on the device, so that `target.forward`
/// times the device's work. Off where a drafter shares the device: the wait would be for the
/// drafter's queued work too, and one stream orders the drafter after the forward anyway
/// (there `target.forward` is the time to queue the forward).
pub(super) fn target_worker(
    shared: &Shared,
    target: &TargetModel,
    taps: &[usize],
    cfg: &TrainConfig,
    wait_for_device: bool,
) -> Result<()> {
    let soft = cfg.train.kl_weight > 0.0;
    let req = ForwardRequest {
        tap_layers: taps.to_vec(),
        final_hidden: soft,
        logits: false,
    };
    let mut count = 0u64;
    loop {
        if !shared.wait_if_paused() {
            return Ok(());
        }
        let t = Instant::now();
        let batch = match shared.batch_q.pop() {
            Ok(b) => b,
            Err(_) => return Ok(()),
        };
        shared.profile.record(ProfileEvent::BatchQWait, t.elapsed());
        // pinned and non-blocking: a pageable copy would wait for the device's queued work
        let ids = shared.profile.time(ProfileEvent::TargetH2d, || {
            upload(&batch.input_ids, target.device)
        });
        let out = shared.profile.time(ProfileEvent::TargetForward, || {
            let out = target.run(&ids, None, &req);
            if wait_for_device {
                sync_device(target.device);
            }
            out
        });
        count += 1;
        if cfg.debug.fail_stage == FailStage::Target
            && cfg.debug.fail_at_step > 0
            && count == cfg.debug.fail_at_step
        {
            return Err(injected_failure(cfg, format!("batch {}", batch.seq)));
        }
        let features = out
            .features
            .ok_or_else(|| anyhow!("the target returned no features"))?;
        let item = FeatureItem {
            batch,
            features,
            teacher_hidden: out.final_hidden,
        };
        let t = Instant::now();
        let pushed = shared.feature_q.push(item);
        shared
            .profile
            .record(ProfileEvent::TargetHandoff, t.elapsed());
        if pushed.is_err() {
            return Ok(());
        }
    }
}
