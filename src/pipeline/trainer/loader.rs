//! The loader stage: packed batches from the data store into `batch_q`.

use std::sync::Arc;

use anyhow::{anyhow, Result};
use tch::Tensor;

use super::shared::{injected_failure, Shared};
use crate::config::{FailStage, TrainConfig};
use crate::data::packer::{collate, Packer, PackerState};
use crate::data::store::TokenStore;
use crate::pipeline::queue::QueueClosed;
use crate::telemetry::profile::ProfileEvent;

/// A batch on its way to a target worker.
pub(crate) struct BatchItem {
    pub(super) seq: u64,
    pub(super) resume: PackerState,
    pub(super) epoch: u64,
    pub(super) samples: Vec<usize>,
    pub(crate) lengths: Vec<usize>,
    pub(super) stride: usize,
    pub(super) ids: Vec<i64>,
    pub(super) mask: Vec<i64>,
    pub(crate) input_ids: Tensor,
}

/// Draws the packer's batches a global step at a time and queues this process's share of
/// each (all of them in a single process): every rank draws the same stream, so the global
/// step is the one a single process would train. Each queued batch carries its place in the
/// stream (`seq`) and the packer's state (and epoch) after its whole step, which a checkpoint at that
/// step boundary resumes from (whatever the number of processes then).
pub(super) fn loader(
    shared: &Shared,
    store: Arc<TokenStore>,
    cfg: &TrainConfig,
    mut packer: Packer,
) -> Result<()> {
    let share = shared.share;
    let mut seq = 0u64;
    loop {
        if !shared.wait_if_paused() {
            return Ok(());
        }
        let mut mine = Vec::with_capacity(share.count);
        let mut step_epoch = 0;
        for position in 0..share.global {
            let batch = shared
                .profile
                .time(ProfileEvent::LoaderFetch, || packer.next())
                .ok_or_else(|| anyhow!("the data set yields no batch"))?;
            step_epoch = batch.epoch;
            if share.takes(position) {
                mine.push((seq + position as u64, batch));
            }
        }
        seq += share.global as u64;
        let resume = packer.state();
        for (item_seq, batch) in mine {
            let mut item = shared.profile.time(ProfileEvent::LoaderPack, || {
                batch_item(&store, &batch, item_seq, resume)
            });
            // (the epoch that goes with `resume`: the step's last batch's, whichever rank has it)
            item.epoch = step_epoch;
            if cfg.debug.fail_stage == FailStage::Loader
                && cfg.debug.fail_at_step > 0
                && item_seq + 1 == cfg.debug.fail_at_step
            {
                return Err(injected_failure(cfg, format!("batch {item_seq}")));
            }
            match shared.batch_q.push(item) {
                Ok(()) => {}
                Err((_, QueueClosed::Stopped)) | Err((_, QueueClosed::Drained)) => return Ok(()),
            }
        }
    }
}

/// A packed batch as the target and drafter stages take it.
pub(crate) fn batch_item(
    store: &TokenStore,
    batch: &crate::data::packer::Batch,
    seq: u64,
    resume: PackerState,
) -> BatchItem {
    let c = collate(store, batch);
    let ids = Vec::<i64>::try_from(&c.input_ids.view([-1])).unwrap_or_default();
    let mask = Vec::<i64>::try_from(&c.loss_mask.view([-1])).unwrap_or_default();
    BatchItem {
        seq,
        resume,
        epoch: batch.epoch,
        samples: batch.indices.clone(),
        lengths: c.lengths,
        stride: batch.max_len,
        ids,
        mask,
        input_ids: c.input_ids,
    }
}
