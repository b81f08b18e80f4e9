//! The target workers: a frozen target's forward over each batch, its tapped hidden states
//! into `feature_q`.

use std::time::Instant;

use anyhow::{anyhow, Result};
use tch::{Device, Tensor};

use super::loader::BatchItem;
use super::shared::{injected_failure, sync_device, Shared};
use crate::aten_ext::graph::{GraphLibrary, StreamEvent};
use crate::config::{FailStage, TrainConfig};
use crate::model::layers::upload;
use crate::model::{ForwardRequest, TargetModel};
use crate::telemetry::profile::ProfileEvent;

/// Target features on their way to a drafter worker.
pub(crate) struct FeatureItem {
    pub(crate) batch: BatchItem,
    pub(crate) features: Tensor,
    pub(crate) teacher_hidden: Option<Tensor>,
    /// The end of the forward that made them, where it ran on the target worker's own stream:
    /// the drafter's stream must wait for it ([`FeatureItem::order_before_use`]).
    pub(crate) ready: Option<StreamEvent>,
}

impl FeatureItem {
    /// Orders this thread's stream after the forward that made the features (where it ran on
    /// another stream) and marks them used on it. Where that cannot be done, waits for the
    /// device instead and returns true: the caller must wait again before dropping the item
    /// (its memory would otherwise go back to the target's stream under queued work).
    pub(crate) fn order_before_use(&self) -> bool {
        let Some(ready) = &self.ready else {
            return false;
        };
        let mut used = vec![&self.features];
        used.extend(self.teacher_hidden.as_ref());
        match ready.order_after(&used) {
            Ok(()) => false,
            Err(e) => {
                log::warn!("target features: {e:#}; waiting for the device instead");
                sync_device(self.features.device());
                true
            }
        }
    }
}

/// `wait_for_device`: wait for each forward to finish on the device, so that `target.forward`
/// times the device's work (where the target has its device to itself). `own_stream`: queue
/// the forwards on a stream of this thread's own, each item carrying an event that marks its
/// forward's end (where a drafter shares the device: the device then runs the drafter's
/// kernels while the target's host queues its forward, and the target's while the drafter's
/// host is busy); there `target.forward` is the time to queue the forward.
pub(super) fn target_worker(
    shared: &Shared,
    target: &TargetModel,
    taps: &[usize],
    cfg: &TrainConfig,
    wait_for_device: bool,
    own_stream: Option<GraphLibrary>,
) -> Result<()> {
    let device_index = match target.device {
        Device::Cuda(i) => i,
        _ => 0,
    };
    let own_stream = own_stream.filter(|graphs| match graphs.use_pool_stream(device_index) {
        Ok(()) => true,
        Err(e) => {
            log::warn!("target worker: no stream of its own ({e:#}); sharing the drafter's");
            false
        }
    });
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
        let ready = match own_stream.map(|graphs| graphs.record_event(device_index)) {
            Some(Ok(event)) => Some(event),
            Some(Err(e)) => {
                // the drafter's stream cannot be ordered after this forward: wait for it here
                log::warn!("target worker: {e:#}; waiting for the forward");
                sync_device(target.device);
                None
            }
            None => None,
        };
        let item = FeatureItem {
            batch,
            features,
            teacher_hidden: out.final_hidden,
            ready,
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
