//! The LM head's forward and backward pass over the trained rows, chunk by chunk (libtorch's
//! operations or the fused kernel), with soft labels, and what the metrics need of it.

use tch::{Device, Kind, Tensor};

use crate::aten_ext::fused::FusedKernels;
use crate::model::layers::upload;

use super::{cross_entropy_f32, BlockTargets, LossOptions, LossTensors};

/// The trained rows of a micro-batch on the device, picked on the host, so that only the rows
/// used go up.
pub(super) struct PickedRows {
    /// Number of rows.
    pub(super) m: i64,
    /// Label of each row [m].
    pub(super) labels: Tensor,
    /// Decay and mask weight of each row [m] (no streak weighting).
    pub(super) base_w: Tensor,
    /// The drafter's hidden states of the rows [m, H] (in the autograd graph).
    pub(super) selected: Tensor,
    /// The teacher's states at each row's teacher position [m, H], with soft labels.
    pub(super) teacher: Option<Tensor>,
}

impl PickedRows {
    /// `dims` is `hidden`'s [B, N, block, H].
    pub(super) fn upload(
        hidden: &Tensor,
        dims: [i64; 4],
        targets: &BlockTargets,
        rows: &[i64],
        teacher_hidden: Option<&Tensor>,
    ) -> PickedRows {
        let [b, n, block, h] = dims;
        let device = hidden.device();
        let host_labels: Vec<i64> = rows.iter().map(|&r| targets.labels[r as usize]).collect();
        let host_w: Vec<f32> = rows.iter().map(|&r| targets.weights[r as usize]).collect();
        let idx = upload(&Tensor::from_slice(rows), device);
        let labels = upload(&Tensor::from_slice(&host_labels), device);
        let base_w = upload(&Tensor::from_slice(&host_w), device);
        let selected = hidden.reshape([b * n * block, h]).index_select(0, &idx);
        let teacher = teacher_hidden.map(|t| {
            let s = t.size()[1];
            let flat = t.reshape([b * s, h]);
            // teacher position of slot (r, j, k) lives in row r of the teacher states
            let mut pos = Vec::with_capacity(rows.len());
            for &row in rows {
                let r = row / (n * block);
                pos.push(r * s + targets.teacher_pos[row as usize]);
            }
            flat.index_select(0, &upload(&Tensor::from_slice(&pos), device))
        });
        PickedRows {
            m: rows.len() as i64,
            labels,
            base_w,
            selected,
            teacher,
        }
    }
}

/// The per-row loss of the LM head's output, one chunk of rows at a time: cross-entropy, mixed
/// with the KL divergence from the teacher when soft labels are on.
pub(super) struct RowLosses<'a> {
    pub(super) lm_head: &'a Tensor,
    pub(super) labels: &'a Tensor,
    pub(super) teacher: Option<&'a Tensor>,
    pub(super) opts: &'a LossOptions,
}

impl RowLosses<'_> {
    /// Loss [len] and whether the argmax is the label [len] (float32) of rows
    /// `start..start + len` of `hd`.
    fn chunk(&self, hd: &Tensor, start: i64, len: i64) -> (Tensor, Tensor) {
        // Logits stay in the compute dtype; the log-softmax reads them and works and writes in
        // float32 (the same numbers as converting first: bf16 -> f32 is exact, without a
        // float32 copy of the logits and its backward pass).
        let logits = hd
            .narrow(0, start, len)
            .linear::<&Tensor>(self.lm_head, None);
        let lab = self.labels.narrow(0, start, len);
        let ce = cross_entropy_f32(&logits, &lab);
        let correct = logits
            .argmax(-1, false)
            .eq_tensor(&lab)
            .to_kind(Kind::Float);
        let loss = match (self.teacher, self.opts.kl_weight > 0.0) {
            (Some(th), true) => self.with_soft_labels(&ce, &logits, th, start, len),
            _ => ce.shallow_clone(),
        };
        (loss, correct)
    }

    /// `(1 - kl_weight) * ce + kl_weight * T^2 * KL(teacher || drafter)` at temperature T, the
    /// teacher's logits from rows `start..start + len` of `th` (no gradient).
    fn with_soft_labels(
        &self,
        ce: &Tensor,
        logits: &Tensor,
        th: &Tensor,
        start: i64,
        len: i64,
    ) -> Tensor {
        let t = self.opts.kl_temperature;
        let logits = logits.to_kind(Kind::Float);
        let tl = tch::no_grad(|| {
            th.narrow(0, start, len)
                .linear::<&Tensor>(self.lm_head, None)
                .to_kind(Kind::Float)
        });
        let p_t = (tl / t).softmax(-1, Kind::Float);
        let log_p_t = p_t.clamp_min(1e-30).log();
        let log_p_d = (&logits / t).log_softmax(-1, Kind::Float);
        let kl = (&p_t * (log_p_t - log_p_d)).sum_dim_intlist(-1, false, Kind::Float);
        ce * (1.0 - self.opts.kl_weight) + kl * (self.opts.kl_weight * t * t)
    }
}

/// The normalisation by `sum(w)`, on the device.
pub(super) struct Normalisation {
    /// sum of the base weights (streak weights excluded)
    base_sum: Tensor,
    /// 1 / sum(w), or 0 when no slot has weight
    inv_w: Tensor,
    /// `grad_scale / sum(w)`: the scale of the backward pass
    pub(super) grad_factor: Tensor,
}

impl Normalisation {
    pub(super) fn of(weights: &Tensor, base_w: &Tensor, grad_scale: f64) -> Normalisation {
        let w_sum = weights.sum(Kind::Float);
        let base_sum = base_w.sum(Kind::Float);
        let inv_w = w_sum.gt(0.0).to_kind(Kind::Float) / w_sum.clamp_min(1e-12);
        let grad_factor = &inv_w * grad_scale;
        Normalisation {
            base_sum,
            inv_w,
            grad_factor,
        }
    }
}

/// The LM head's forward and backward pass, chunk by chunk, and what the metrics need of it.
pub(super) struct LmHeadPass {
    /// The gradient of the rows' hidden states [m, H], the one into the drafter.
    pub(super) grad: Tensor,
    /// sum of w * loss (streak weights included)
    loss_sum: Tensor,
    /// sum of base w * correct
    weighted_correct: Tensor,
    /// Whether the argmax is the label, per row, chunk by chunk.
    correct: Vec<Tensor>,
}

/// Runs the loss chunk by chunk through the LM head, each chunk's backward scaled by
/// `grad_factor`, accumulating the gradient into a detached copy of the rows' hidden states.
pub(super) fn lm_head_backward(
    picked: &PickedRows,
    head: &RowLosses,
    weights: &Tensor,
    grad_factor: &Tensor,
    chunk: i64,
    device: Device,
) -> LmHeadPass {
    let m = picked.m;
    let hd = picked.selected.detach().set_requires_grad(true);
    let mut pass = LmHeadPass::start(device);
    let mut s = 0;
    while s < m {
        let len = chunk.min(m - s);
        let (loss, correct) = head.chunk(&hd, s, len);
        let w = weights.narrow(0, s, len);
        let part = (&loss * &w).sum(Kind::Float);
        (&part * grad_factor).backward();
        pass.add_chunk(part.detach(), correct, &picked.base_w, s);
        s += len;
    }
    pass.grad = hd.grad();
    pass
}

/// [`lm_head_backward`] with the fused kernel: per chunk the logits (one matrix product), then
/// the loss, the argmax check and the logits' gradient in one kernel (in place), then the
/// gradient of the chunk's hidden states (one matrix product into its rows of the result). The
/// same numbers as libtorch's operations up to the order of float sums, without the
/// full-vocabulary float32 tensors of log-softmax and its backward pass.
pub(super) fn lm_head_fused(
    picked: &PickedRows,
    lm_head: &Tensor,
    weights: &Tensor,
    norm: &Normalisation,
    chunk: i64,
    kernels: &FusedKernels,
) -> anyhow::Result<LmHeadPass> {
    let m = picked.m;
    let hd = picked.selected.detach();
    let mut pass = LmHeadPass::start(hd.device());
    pass.grad = Tensor::empty([m, hd.size()[1]], (hd.kind(), hd.device()));
    let scale = (weights * &norm.grad_factor).to_kind(Kind::Float);
    tch::no_grad(|| -> anyhow::Result<()> {
        let mut s = 0;
        while s < m {
            let len = chunk.min(m - s);
            let logits = hd.narrow(0, s, len).linear::<&Tensor>(lm_head, None);
            let (loss, correct) = kernels.cross_entropy_grad(
                &logits,
                &picked.labels.narrow(0, s, len),
                &scale.narrow(0, s, len),
            )?;
            // the logits now hold their gradient
            let _rows_written = logits.f_mm_out(&pass.grad.narrow(0, s, len), lm_head)?;
            let loss_sum = (&loss * weights.narrow(0, s, len)).sum(Kind::Float);
            pass.add_chunk(loss_sum, correct, &picked.base_w, s);
            s += len;
        }
        Ok(())
    })?;
    Ok(pass)
}

impl LmHeadPass {
    /// A pass with nothing summed yet, its gradient to be filled in.
    fn start(device: Device) -> LmHeadPass {
        LmHeadPass {
            grad: Tensor::new(),
            loss_sum: Tensor::zeros([], (Kind::Float, device)),
            weighted_correct: Tensor::zeros([], (Kind::Float, device)),
            correct: Vec::new(),
        }
    }

    /// Adds the chunk of rows `start..start + correct.len()`: its sum of w * loss and its
    /// argmax check, weighted by the rows' base weights.
    fn add_chunk(&mut self, loss_sum: Tensor, correct: Tensor, base_w: &Tensor, start: i64) {
        let len = correct.size()[0];
        self.loss_sum += loss_sum;
        self.weighted_correct += (&correct * base_w.narrow(0, start, len)).sum(Kind::Float);
        self.correct.push(correct);
    }

    /// The metric sums of [`LossTensors`], on the device.
    pub(super) fn metric_sums(
        self,
        norm: &Normalisation,
        blocks: i64,
        block: i64,
        device: Device,
    ) -> LossTensors {
        let correct = Tensor::cat(&self.correct, 0).view([blocks, block - 1]);
        let accepted = correct.cumprod(1, Kind::Float).sum(Kind::Float);
        // weighted_loss is normalised like the loss (streak weights included) and scaled back
        // to the base weight, so that LossSums::loss() = sum(w * loss) / sum(w).
        let weighted_loss = self.loss_sum * &norm.base_sum * &norm.inv_w;
        let sums = Tensor::stack(
            &[
                weighted_loss.to_kind(Kind::Double),
                norm.base_sum.to_kind(Kind::Double),
                self.weighted_correct.to_kind(Kind::Double),
                accepted.to_kind(Kind::Double),
                Tensor::full([], blocks as f64, (Kind::Double, device)),
            ],
            0,
        );
        LossTensors::from_tensor(sums)
    }
}
