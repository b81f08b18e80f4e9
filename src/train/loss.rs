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

use rand::seq::index::sample;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tch::{Device, Kind, Reduction, Tensor};

use crate::aten_ext::fused::FusedKernels;
use crate::model::layers::upload;

/// Anchors of a batch: [B, N] positions and validity, N = the largest count of any row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnchorPlan {
    pub rows: usize,
    pub per_row: usize,
    pub anchors: Vec<i64>,
    pub valid: Vec<bool>,
}

/// Draws anchors for every row (spec §2.2): candidates are positions p with
/// `loss_mask[p] == 1` and `p <= len - block`; `min(num_anchors, #candidates)` of them uniformly
/// without replacement, sorted; shorter rows padded with invalid blocks at position 0.
pub fn sample_anchors(
    loss_mask: &[i64],
    lengths: &[usize],
    stride: usize,
    block: usize,
    num_anchors: usize,
    seed: u64,
) -> AnchorPlan {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut per_row: Vec<Vec<i64>> = Vec::with_capacity(lengths.len());
    for (r, &len) in lengths.iter().enumerate() {
        let row = &loss_mask[r * stride..r * stride + len];
        let candidates: Vec<i64> = if len >= block {
            (0..=len - block)
                .filter(|&p| row[p] == 1)
                .map(|p| p as i64)
                .collect()
        } else {
            Vec::new()
        };
        let n = num_anchors.min(candidates.len());
        let mut chosen: Vec<i64> = sample(&mut rng, candidates.len(), n)
            .into_iter()
            .map(|i| candidates[i])
            .collect();
        chosen.sort_unstable();
        per_row.push(chosen);
    }
    let n = per_row.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let mut anchors = vec![0i64; lengths.len() * n];
    let mut valid = vec![false; lengths.len() * n];
    for (r, chosen) in per_row.iter().enumerate() {
        for (j, &a) in chosen.iter().enumerate() {
            anchors[r * n + j] = a;
            valid[r * n + j] = true;
        }
    }
    AnchorPlan {
        rows: lengths.len(),
        per_row: n,
        anchors,
        valid,
    }
}

/// Labels and weights of every block slot: [B, N, block].
#[derive(Debug, Clone)]
pub struct BlockTargets {
    pub labels: Vec<i64>,
    pub weights: Vec<f32>,
    /// Teacher position a_j + k - 1 of each slot (for soft labels).
    pub teacher_pos: Vec<i64>,
}

/// `w[j,k] = valid_j * [k >= 1] * [a_j + k < len] * loss_mask[a_j + k] * exp(-(k - 1) / gamma)`
/// and label `x[a_j + k]` (no shift) (spec §2.5, §3).
pub fn block_targets(
    ids: &[i64],
    loss_mask: &[i64],
    lengths: &[usize],
    stride: usize,
    plan: &AnchorPlan,
    block: usize,
    gamma: f64,
) -> BlockTargets {
    let total = plan.rows * plan.per_row * block;
    let mut labels = vec![0i64; total];
    let mut weights = vec![0f32; total];
    let mut teacher_pos = vec![0i64; total];
    for r in 0..plan.rows {
        for j in 0..plan.per_row {
            let slot = r * plan.per_row + j;
            let a = plan.anchors[slot] as usize;
            for k in 0..block {
                let i = slot * block + k;
                let p = a + k;
                if p < lengths[r] {
                    labels[i] = ids[r * stride + p];
                    teacher_pos[i] = (p.max(1) - 1) as i64;
                    if plan.valid[slot] && k >= 1 && loss_mask[r * stride + p] == 1 {
                        weights[i] = (-((k - 1) as f64) / gamma).exp() as f32;
                    }
                }
            }
        }
    }
    BlockTargets {
        labels,
        weights,
        teacher_pos,
    }
}

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

/// Metrics of one micro-batch (sums, so that they can be combined).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossSums {
    /// sum of w * loss
    pub weighted_loss: f64,
    /// sum of w (decay and mask; streak weights excluded)
    pub weight: f64,
    /// sum of w * correct
    pub weighted_correct: f64,
    /// sum over valid blocks of the accepted-prefix length
    pub accepted: f64,
    pub blocks: f64,
}

impl LossSums {
    pub fn add(&mut self, o: &LossSums) {
        self.weighted_loss += o.weighted_loss;
        self.weight += o.weight;
        self.weighted_correct += o.weighted_correct;
        self.accepted += o.accepted;
        self.blocks += o.blocks;
    }
    pub fn loss(&self) -> f64 {
        self.weighted_loss / self.weight.max(1e-12)
    }
    pub fn accuracy(&self) -> f64 {
        self.weighted_correct / self.weight.max(1e-12)
    }
    /// The anchor-mean acceptance `1 + mean_j sum_k prod_{i<=k} [argmax == label]` (the
    /// spec's `tau_train`): a mean over anchor positions, not the acceptance length decoding
    /// gets (decoding crosses easy stretches in a few long steps and hard ones in many short
    /// ones); see [`crate::train::validation`] for what decoding gets.
    pub fn accept_mean(&self) -> f64 {
        1.0 + self.accepted / self.blocks.max(1.0)
    }
}

/// Metric sums of one or more micro-batches, kept on the device so that no step waits for
/// it: the fields of [`LossSums`] in order (weighted_loss, weight, weighted_correct,
/// accepted, blocks) as a float64 tensor [5]. Add them up over micro-batches and steps with
/// [`LossTensors::add`] and read them with [`LossTensors::to_host`] (one synchronisation)
/// only when the numbers are needed.
#[derive(Debug)]
pub struct LossTensors {
    sums: Tensor,
}

impl LossTensors {
    pub fn zeros(device: Device) -> Self {
        LossTensors {
            sums: Tensor::zeros([5], (Kind::Double, device)),
        }
    }

    /// Sums summed elsewhere (over the processes of a run): the float64 tensor [5].
    pub(crate) fn from_tensor(sums: Tensor) -> Self {
        LossTensors { sums }
    }

    /// The float64 tensor [5] of sums.
    pub fn tensor(&self) -> &Tensor {
        &self.sums
    }

    /// Adds `other` on this one's device (no synchronisation with the host).
    pub fn add(&mut self, other: &LossTensors) {
        let o = other.sums.to_device(self.sums.device());
        self.sums = &self.sums + o;
    }

    /// A copy on the host, queued behind the work the sums depend on without waiting for it
    /// (pinned memory, non-blocking): its values are there once the device has run that work
    /// (wait for an event recorded after this call, or for the device). On the CPU, a copy.
    pub(crate) fn to_host_async(&self) -> LossTensors {
        LossTensors {
            sums: self.sums.to_device_(Device::Cpu, Kind::Double, true, false),
        }
    }

    /// Reads the sums (waits for the device to finish the work they depend on).
    pub fn to_host(&self) -> LossSums {
        let v = Vec::<f64>::try_from(self.sums.to_device(Device::Cpu)).unwrap_or_default();
        let at = |i: usize| v.get(i).copied().unwrap_or(0.0);
        LossSums {
            weighted_loss: at(0),
            weight: at(1),
            weighted_correct: at(2),
            accepted: at(3),
            blocks: at(4),
        }
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

/// The trained rows of a micro-batch on the device, picked on the host, so that only the rows
/// used go up.
struct PickedRows {
    /// Number of rows.
    m: i64,
    /// Label of each row [m].
    labels: Tensor,
    /// Decay and mask weight of each row [m] (no streak weighting).
    base_w: Tensor,
    /// The drafter's hidden states of the rows [m, H] (in the autograd graph).
    selected: Tensor,
    /// The teacher's states at each row's teacher position [m, H], with soft labels.
    teacher: Option<Tensor>,
}

impl PickedRows {
    /// `dims` is `hidden`'s [B, N, block, H].
    fn upload(
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
struct RowLosses<'a> {
    lm_head: &'a Tensor,
    labels: &'a Tensor,
    teacher: Option<&'a Tensor>,
    opts: &'a LossOptions,
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

/// The weight of each row [m]: the base weight, times the streak weight when streak
/// weighting is on. Streak weighting needs every slot's CE before any weight is final: a
/// first pass without gradients.
fn row_weights(
    picked: &PickedRows,
    lm_head: &Tensor,
    opts: &LossOptions,
    chunk: i64,
    blocks: i64,
    block: i64,
) -> Tensor {
    if opts.streak_alpha > 0.0 {
        let m = picked.m;
        let ce_all = tch::no_grad(|| {
            let mut parts = Vec::new();
            let mut s = 0;
            while s < m {
                let len = chunk.min(m - s);
                let logits = picked
                    .selected
                    .narrow(0, s, len)
                    .linear::<&Tensor>(lm_head, None);
                parts.push(cross_entropy_f32(&logits, &picked.labels.narrow(0, s, len)));
                s += len;
            }
            Tensor::cat(&parts, 0)
        });
        let ce = ce_all.view([blocks, block - 1]);
        let s = streak_weights(&ce, opts.streak_alpha, opts.streak_tau_power).view([m]);
        &picked.base_w * s
    } else {
        picked.base_w.shallow_clone()
    }
}

/// The streak weights [blocks, block - 1] of blocks from the cross-entropy of their trained
/// slots 1..block [blocks, block - 1]: confidence `q_k = exp(-CE_k)`, `q'_k = (1 - alpha) q_k +
/// alpha`, `C_k = prod_{i<=k} q'_i`, `s_k = sum_{m>=k} C_m` (the spec's streak weighting), then
/// divided by the block's expected acceptance length `tau = 1 + s_1` to the power `tau_power`.
///
/// With alpha 0, `sum_j s_1j` is the anchors' expected accepted length if slots were accepted
/// independently, and its gradient in `log q_jk` is `s_jk`: power 0 follows it. Decoding starts
/// a step at a position about 1 / tau of the time, so the expected number of steps is about
/// `sum_j 1 / tau_j`, whose gradient in `log q_jk` is `-s_jk / tau_j^2`: power 2 follows that,
/// counting the hard positions where decoding spends its steps more.
fn streak_weights(ce: &Tensor, alpha: f64, tau_power: f64) -> Tensor {
    let q = ce.neg().exp() * (1.0 - alpha) + alpha;
    let c = q.cumprod(1, Kind::Float);
    // s_k = sum_{m >= k} C_m: a reversed cumulative sum
    let s = c.flip([1]).cumsum(1, Kind::Float).flip([1]);
    if tau_power > 0.0 {
        let tau = s.narrow(1, 0, 1) + 1.0;
        s * tau.pow_tensor_scalar(-tau_power)
    } else {
        s
    }
}

/// The normalisation by `sum(w)`, on the device.
struct Normalisation {
    /// sum of the base weights (streak weights excluded)
    base_sum: Tensor,
    /// 1 / sum(w), or 0 when no slot has weight
    inv_w: Tensor,
    /// `grad_scale / sum(w)`: the scale of the backward pass
    grad_factor: Tensor,
}

impl Normalisation {
    fn of(weights: &Tensor, base_w: &Tensor, grad_scale: f64) -> Normalisation {
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
struct LmHeadPass {
    /// The gradient of the rows' hidden states [m, H], the one into the drafter.
    grad: Tensor,
    /// sum of w * loss (streak weights included)
    loss_sum: Tensor,
    /// sum of base w * correct
    weighted_correct: Tensor,
    /// Whether the argmax is the label, per row, chunk by chunk.
    correct: Vec<Tensor>,
}

/// Runs the loss chunk by chunk through the LM head, each chunk's backward scaled by
/// `grad_factor`, accumulating the gradient into a detached copy of the rows' hidden states.
fn lm_head_backward(
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
fn lm_head_fused(
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
    fn metric_sums(
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
        LossTensors { sums }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchors_follow_the_candidate_rule() {
        // row 0: length 10, loss on 3..10; row 1: length 6, loss everywhere
        let stride = 10;
        let mut mask = vec![0i64; 20];
        mask[3..10].fill(1);
        mask[10..16].fill(1);
        let plan = sample_anchors(&mask, &[10, 6], stride, 4, 100, 1);
        assert_eq!(plan.per_row, 4); // row 0: p in 3..=6 -> 4 candidates; row 1: 0..=2 -> 3
        assert_eq!(&plan.anchors[..4], &[3, 4, 5, 6]);
        assert_eq!(&plan.anchors[4..7], &[0, 1, 2]);
        assert_eq!(
            plan.valid,
            vec![true, true, true, true, true, true, true, false]
        );
        let few = sample_anchors(&mask, &[10, 6], stride, 4, 2, 1);
        assert_eq!(few.per_row, 2);
        assert!(few.anchors[..2].windows(2).all(|w| w[0] < w[1]));
        assert_eq!(
            few,
            sample_anchors(&mask, &[10, 6], stride, 4, 2, 1),
            "seeded"
        );
    }

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

    fn values(t: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(t.to_kind(Kind::Double).reshape([-1])).expect("a float tensor")
    }

    fn assert_close(got: &[f64], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() < 1e-5 * (1.0 + w.abs()),
                "{what}[{i}]: {g} vs {w}"
            );
        }
    }

    #[test]
    fn streak_weights_of_an_oracle_and_an_always_wrong_drafter() {
        // an oracle (CE 0, q = 1): C_k = 1, s_k = slots left from k, tau = block
        let oracle = Tensor::zeros([2, 15], (Kind::Float, Device::Cpu));
        let left: Vec<f64> = (1..=15).rev().map(f64::from).collect();
        assert_close(
            &values(&streak_weights(&oracle, 0.0, 0.0))[..15],
            &left,
            "oracle",
        );
        let by_tau2: Vec<f64> = left.iter().map(|s| s / 256.0).collect();
        assert_close(
            &values(&streak_weights(&oracle, 0.0, 2.0))[15..],
            &by_tau2,
            "oracle",
        );
        // always wrong (q = 0) with alpha 0.5: q' = 0.5, C = 0.5^k, s = (0.875, 0.375, 0.125)
        let wrong = Tensor::full([1, 3], f64::INFINITY, (Kind::Float, Device::Cpu));
        let s = [0.875, 0.375, 0.125];
        assert_close(&values(&streak_weights(&wrong, 0.5, 0.0)), &s, "wrong");
        let by_tau: Vec<f64> = s.iter().map(|x| x / 1.875).collect();
        assert_close(&values(&streak_weights(&wrong, 0.5, 1.0)), &by_tau, "wrong");
        // q = (0.5, 1, 0.25): C = (0.5, 0.5, 0.125), s = (1.125, 0.625, 0.125), tau 2.125
        let ce = Tensor::from_slice(&[0.5f32.ln(), 0.0, 0.25f32.ln()])
            .neg()
            .view([1, 3]);
        let tau2 = 2.125f64.powi(2);
        let want: Vec<f64> = [1.125, 0.625, 0.125].iter().map(|x| x / tau2).collect();
        assert_close(&values(&streak_weights(&ce, 0.0, 2.0)), &want, "mixed");
    }

    #[test]
    fn streak_weights_are_the_gradients_of_accepted_length_and_of_decoding_steps() {
        // log q of 3 blocks of 5 slots, drawn from a seeded generator
        tch::manual_seed(5);
        let log_q =
            (Tensor::rand([3, 5], (Kind::Double, Device::Cpu)) * -3.0).set_requires_grad(true);
        let s = |log_q: &Tensor| {
            let c = log_q.exp().cumprod(1, Kind::Double);
            c.flip([1]).cumsum(1, Kind::Double).flip([1])
        };
        let ce = log_q.detach().neg().to_kind(Kind::Float);
        // power 0: d(sum_j s_1j) / d log q = s
        let accepted = s(&log_q).narrow(1, 0, 1).sum(Kind::Double);
        let grad = Tensor::run_backward(&[accepted], &[&log_q], false, false);
        let want = values(&streak_weights(&ce, 0.0, 0.0));
        assert_close(&values(&grad[0]), &want, "accepted length");
        // power 2: d(sum_j 1 / tau_j) / d log q = -s / tau^2
        let steps = (s(&log_q).narrow(1, 0, 1) + 1.0)
            .reciprocal()
            .sum(Kind::Double);
        let grad = Tensor::run_backward(&[steps], &[&log_q], false, false);
        let want: Vec<f64> = values(&streak_weights(&ce, 0.0, 2.0))
            .iter()
            .map(|w| -w)
            .collect();
        assert_close(&values(&grad[0]), &want, "decoding steps");
    }

    #[test]
    fn targets_have_no_shift_and_decay() {
        let ids: Vec<i64> = (100..110).collect();
        let mask = vec![1i64; 10];
        let plan = AnchorPlan {
            rows: 1,
            per_row: 2,
            anchors: vec![2, 0],
            valid: vec![true, false],
        };
        let t = block_targets(&ids, &mask, &[10], 10, &plan, 4, 7.0);
        assert_eq!(&t.labels[..4], &[102, 103, 104, 105]);
        assert_eq!(t.weights[0], 0.0, "slot 0 has no loss");
        assert_eq!(t.weights[1], 1.0);
        assert!((t.weights[2] - (-1.0f64 / 7.0).exp() as f32).abs() < 1e-7);
        assert!(t.weights[4..].iter().all(|&w| w == 0.0), "invalid block");
        assert_eq!(
            t.teacher_pos[1], 2,
            "slot k is taught by position a + k - 1"
        );
    }
}
