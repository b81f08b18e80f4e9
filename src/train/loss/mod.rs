//! DFlash training maths (dflash spec §2-3): anchors, block labels and weights, the
//! decay-weighted cross-entropy with optional soft labels and streak weighting, and the
//! metrics (loss, weighted accuracy, the anchor-mean acceptance).
//!
//! The LM head is applied in row chunks and its gradient is accumulated into a detached copy
//! of the hidden states, so the full-vocabulary logits of a batch never exist at once.
//!
//! [`loss_and_backward_deferred`] never makes the host wait for the device: host data goes up
//! through pinned memory, the normalisation stays on the device and the metrics come back as
//! [`LossTensors`], read once when they are needed.
//!
//! Files: `targets` (anchors, labels and weights), `sums` (the metrics), `streak` (streak
//! weighting), `lm_head` (the LM head's chunked forward and backward pass, soft labels).

mod lm_head;
mod streak;
mod sums;
mod targets;

use tch::{Kind, Reduction, Tensor};

use crate::aten_ext::fused::FusedKernels;

use lm_head::{lm_head_backward, lm_head_fused, Normalisation, PickedRows, RowLosses};
use streak::row_weights;
pub use sums::{LossSums, LossTensors};
pub use targets::{block_targets, sample_anchors, AnchorPlan, BlockTargets};

/// Loss options.
#[derive(Debug, Clone)]
pub struct LossOptions {
    pub kl_weight: f64,
    pub kl_temperature: f64,
    pub streak_alpha: f64,
    /// Power of the block's expected acceptance length that divides its streak weights
    /// (`streak_weights`); 0 = the spec's streak weighting.
    pub streak_tau_power: f64,
    /// Rows of LM-head output computed at once.
    pub chunk_rows: i64,
    /// The fused kernels of the hidden states' device: with them the cross-entropy, its
    /// gradient and the argmax check of a chunk of logits are one kernel (soft labels keep
    /// libtorch's operations); `None`: libtorch's operations.
    pub kernels: Option<FusedKernels>,
}

impl LossOptions {
    /// LM-head rows per chunk so that one chunk's float32 logits take about 1 GiB (2^28
    /// values), within 256..=8192 rows. A chunk's forward and backward hold about four
    /// tensors of that size at once (logits in bf16 and fp32, log-softmax, its gradient):
    /// for Qwen3's 151,936-row vocabulary 1,766 rows, by estimate about 4.5 GiB at the peak instead of
    /// about 20 GiB with 8,192 rows; the matrix products stay large.
    pub fn chunk_rows_for_vocab(vocab: i64) -> i64 {
        ((1i64 << 28) / vocab.max(1)).clamp(256, 8192)
    }
}

/// Per-row cross-entropy [rows] in float32 of `logits` [rows, V] in any float dtype (labels
/// -100 are ignored): log-softmax computed in float32 straight from the logits.
pub(crate) fn cross_entropy_f32(logits: &Tensor, labels: &Tensor) -> Tensor {
    logits
        .log_softmax(-1, Kind::Float)
        .g_nll_loss::<Tensor>(labels, None, Reduction::None, -100)
}

/// The last part of the backward pass: from the hidden states into the drafter.
pub struct PendingBackward {
    selected: Tensor,
    grad: Tensor,
}

impl PendingBackward {
    pub fn run(self) {
        (self.selected * self.grad).sum(Kind::Float).backward();
    }
}

/// Loss of one micro-batch, and its backward pass scaled by `grad_scale / sum(w)`: through the
/// LM head here, into the drafter when the returned [`PendingBackward`] runs.
///
/// `hidden` [B, N, block, H] from `Drafter::forward_train`; `lm_head` [V, H] frozen;
/// `teacher_hidden` [B, S, H] final-normed target states when soft labels are on.
///
/// Reads the metrics back to the host before returning, so the host waits here for the
/// forward pass and the LM-head backward to finish; [`loss_and_backward_deferred`] does not.
pub fn loss_and_backward(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &BlockTargets,
    valid: &[bool],
    teacher_hidden: Option<&Tensor>,
    opts: &LossOptions,
    grad_scale: f64,
) -> (LossSums, Option<PendingBackward>) {
    let (sums, pending) = loss_and_backward_deferred(
        hidden,
        lm_head,
        targets,
        valid,
        teacher_hidden,
        opts,
        grad_scale,
    );
    (sums.to_host(), pending)
}

/// [`loss_and_backward`] without any host synchronisation: the metric sums stay on the device
/// ([`LossTensors`]), host data goes up through pinned memory without blocking, and the
/// normalisation by `sum(w)` happens on the device. When `sum(w) == 0` the gradient is zero
/// (the pending backward still runs, adding zeros).
pub fn loss_and_backward_deferred(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &BlockTargets,
    valid: &[bool],
    teacher_hidden: Option<&Tensor>,
    opts: &LossOptions,
    grad_scale: f64,
) -> (LossTensors, Option<PendingBackward>) {
    let size = hidden.size();
    let (b, n, block, h) = (size[0], size[1], size[2], size[3]);
    let device = hidden.device();
    let rows = trained_rows(valid, block);
    let blocks = rows.len() as i64 / (block - 1).max(1);
    if rows.is_empty() {
        return (LossTensors::zeros(device), None);
    }
    let picked = PickedRows::upload(hidden, [b, n, block, h], targets, &rows, teacher_hidden);
    let chunk = opts.chunk_rows.max(1);
    let weights = row_weights(&picked, lm_head, opts, chunk, blocks, block);
    let norm = Normalisation::of(&weights, &picked.base_w, grad_scale);
    let head = RowLosses {
        lm_head,
        labels: &picked.labels,
        teacher: picked.teacher.as_ref(),
        opts,
    };
    let fused = opts
        .kernels
        .filter(|k| k.device() == device && (picked.teacher.is_none() || opts.kl_weight <= 0.0))
        .and_then(|k| {
            lm_head_fused(&picked, lm_head, &weights, &norm, chunk, &k)
                .map_err(|e| {
                    log::warn!(
                        "the fused loss kernel failed ({e:#}); libtorch's operations instead"
                    )
                })
                .ok()
        });
    let pass = fused.unwrap_or_else(|| {
        lm_head_backward(&picked, &head, &weights, &norm.grad_factor, chunk, device)
    });
    let selected = picked.selected;
    let grad = pass.grad.shallow_clone();
    let pending = grad.defined().then(|| PendingBackward { selected, grad });
    let sums = pass.metric_sums(&norm, blocks, block, device);
    (sums, pending)
}

/// Rows that matter: slots k >= 1 of valid blocks, as indices into the [B * N * block] slots
/// (block-major, k contiguous).
fn trained_rows(valid: &[bool], block: i64) -> Vec<i64> {
    let mut rows: Vec<i64> = Vec::new();
    for (slot, &ok) in valid.iter().enumerate() {
        if ok {
            rows.extend((1..block).map(|k| slot as i64 * block + k));
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_chunks_hold_about_a_gibibyte_of_logits() {
        let budget = 1i64 << 28;
        for vocab in [
            50, 1_000, 32_000, 49_152, 128_256, 151_936, 262_144, 10_000_000,
        ] {
            let rows = LossOptions::chunk_rows_for_vocab(vocab);
            assert!((256..=8192).contains(&rows), "vocab {vocab}: {rows} rows");
            // within the budget unless held at the floor, and one row more would exceed it
            // unless held at the ceiling
            assert!(rows == 256 || rows * vocab <= budget, "vocab {vocab}");
            assert!(rows == 8192 || (rows + 1) * vocab > budget, "vocab {vocab}");
        }
    }
}
