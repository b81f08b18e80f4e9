//! The target workers: a frozen target's forward over each batch, its tapped hidden states
//! into `feature_q`.

use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use tch::Tensor;

use super::loader::BatchItem;
use super::shared::{injected_failure, sync_device, Shared};
use crate::aten_ext::graph::GraphLibrary;
use crate::aten_ext::streams::{SideStream, StreamEvent};
use crate::config::{FailStage, TrainConfig};
use crate::model::layers::upload;
use crate::model::{ForwardRequest, TargetModel};
use crate::telemetry::profile::ProfileEvent;

/// Target features on their way to a drafter worker.
pub(crate) struct FeatureItem {
    pub(crate) batch: BatchItem,
    pub(crate) features: Tensor,
    pub(crate) teacher_hidden: Option<Tensor>,
    /// Recorded after the forward on the target's side stream (see [`TargetPlacement`]): the
    /// drafter's stream waits for it before reading the features ([`FeatureItem::hand_over`]).
    pub(crate) ready: Option<StreamEvent>,
}

impl FeatureItem {
    /// Orders the drafter's stream (this thread's) after the forward that made the features,
    /// where it ran on a side stream; nothing to do where it ran on the same stream, or on
    /// another device (the copy to the drafter's device waits for it).
    pub(crate) fn hand_over(&self) -> Result<()> {
        let Some(ready) = &self.ready else {
            return Ok(());
        };
        let mut tensors = vec![&self.features];
        tensors.extend(self.teacher_hidden.as_ref());
        ready.hand_over(&tensors)
    }
}

/// Where a target worker's forwards run.
#[derive(Clone, Copy)]
pub(super) enum TargetPlacement {
    /// On a device no drafter trains on: each forward is waited for, so that `target.forward`
    /// times the device's work.
    OwnDevice,
    /// On a drafter's device, queued on the same stream: one stream orders the drafter after
    /// the forward, and `target.forward` is the time to queue it (a wait would be for the
    /// drafter's queued work too).
    DrafterStream,
    /// On a drafter's device, on a stream of libtorch's pool (`devices.concurrent_target`): the
    /// GPU runs the forward beside the drafter's work; an event recorded after it hands the
    /// features over.
    SideStream(GraphLibrary),
}

pub(super) fn target_worker(
    shared: &Shared,
    target: &TargetModel,
    taps: &[usize],
    cfg: &TrainConfig,
    placement: TargetPlacement,
) -> Result<()> {
    let side = match placement {
        TargetPlacement::SideStream(library) => Some((
            library,
            SideStream::enter(library, target.device).context("the target's side stream")?,
        )),
        _ => None,
    };
    let wait_for_device = matches!(placement, TargetPlacement::OwnDevice);
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
        let ready = side
            .as_ref()
            .map(|(library, _)| StreamEvent::record(*library, target.device))
            .transpose()
            .context("the event after the target's forward")?;
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
