//! The loader stage: packed batches from the data store into `batch_q`.

use std::sync::Arc;

use anyhow::{anyhow, Result};
use tch::Tensor;

use super::shared::{injected_failure, Shared};
use crate::config::{FailStage, TrainConfig};
use crate::data::packer::{collate, Packer, PackerState};
use crate::data::store::TokenStore;
use crate::pipeline::queue::QueueClosed;
use crate::telemetry::profile::Event;

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

pub(super) fn loader(
    shared: &Shared,
    store: Arc<TokenStore>,
    cfg: &TrainConfig,
    mut packer: Packer,
) -> Result<()> {
    let mut seq = 0u64;
    loop {
        if !shared.wait_if_paused() {
            return Ok(());
        }
        let batch = shared
            .profile
            .time(Event::LOADER_FETCH, || packer.next())
            .ok_or_else(|| anyhow!("the data set yields no batch"))?;
        let resume = packer.state();
        let item = shared.profile.time(Event::LOADER_PACK, || {
            batch_item(&store, &batch, seq, resume)
        });
        if cfg.debug.fail_stage == FailStage::Loader
            && cfg.debug.fail_at_step > 0
            && seq + 1 == cfg.debug.fail_at_step
        {
            return Err(injected_failure(cfg, format!("batch {seq}")));
        }
        seq += 1;
        match shared.batch_q.push(item) {
            Ok(()) => {}
            Err((_, QueueClosed::Stopped)) | Err((_, QueueClosed::Drained)) => return Ok(()),
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
