//! Building blocks shared by the target and the drafter: RMSNorm, rotary position embedding,
//! the projections of one attention layer, the decoder layer around them (its SwiGLU MLP is in
//! [`super::feed_forward`]).

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::config::TargetConfig;
use super::feed_forward::{AddFeedForward, Mlp};
use super::slots::{SlotBatch, SlotCache};
use crate::aten_ext::fused::{add_rms_norm_autograd, rms_norm_autograd, rotate_half, FusedKernels};
use crate::aten_ext::shared_input_linear;

/// `weight * x / sqrt(mean(x^2) + eps)` over the last dimension, through libtorch's
/// `rms_norm`: on a GPU one fused kernel each way (forward and backward) that accumulates in
/// float32 (the composite of six element-wise operations it replaces cost about as much as the
/// layer's matrix products). Hugging Face rounds the normalised `x` to the input dtype before
/// multiplying by the weight; here the product is rounded once, so in bf16 results can differ
/// by one rounding step.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let last = x.size().last().copied().unwrap_or(0);
    x.rms_norm([last], Some(weight), eps)
}

/// [`rms_norm`] as the drafter's training forward runs it: with `kernels`, one autograd node
/// whose passes are one kernel each ([`rms_norm_autograd`]: libtorch's backward pass reads the
/// activations twice); without, libtorch's operations.
pub fn rms_norm_with(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    kernels: Option<&FusedKernels>,
) -> Tensor {
    let Some(k) = kernels else {
        return rms_norm(x, weight, eps);
    };
    rms_norm_autograd(x, weight, eps, Some(k)).unwrap_or_else(|e| {
        log::warn!("the RMSNorm node failed ({e:#}); libtorch's operations instead");
        rms_norm(x, weight, eps)
    })
}

/// `(h + a, rms_norm(h + a))`: a residual sum and the norm of it, as the drafter's training
/// forward runs them: one autograd node ([`add_rms_norm_autograd`]) whose passes are one kernel
/// each with `kernels` (its backward pass adds the residual stream's own gradient in the norm's
/// kernel, where autograd would add it in a pass of its own), libtorch's operations without.
pub fn add_rms_norm_with(
    h: &Tensor,
    a: &Tensor,
    weight: &Tensor,
    eps: f64,
    kernels: Option<&FusedKernels>,
) -> (Tensor, Tensor) {
    add_rms_norm_autograd(h, a, weight, eps, kernels).unwrap_or_else(|e| {
        log::warn!("the residual RMSNorm node failed ({e:#}); libtorch's operations instead");
        let s = h + a;
        let y = rms_norm(&s, weight, eps);
        (s, y)
    })
}

/// Rotary position embedding (the rotate-half layout of Hugging Face Llama / Qwen).
#[derive(Debug)]
pub struct Rope {
    inv_freq: Tensor,
}

impl Rope {
    /// Inverse frequencies from `rope_theta` and the rotary dimensions (`head_dim`, or a
    /// hybrid's first `partial_rotary_factor` of it), with Llama 3 `rope_scaling` or
    /// `linear` scaling applied when the config asks for it.
    pub fn new(config: &TargetConfig, device: Device) -> Result<Self> {
        let d = config.rotary_dim();
        let theta = config.rope_theta;
        let mut inv_freq: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / theta.powf(2.0 * i as f64 / d as f64))
            .collect();
        config.rope_scaling.scale(&mut inv_freq);
        let inv_freq: Vec<f32> = inv_freq.into_iter().map(|f| f as f32).collect();
        Ok(Rope {
            inv_freq: Tensor::from_slice(&inv_freq).to_device(device),
        })
    }

    /// cos and signed sin for `positions` (any shape [..., L], int64): [..., L, head_dim] of
    /// `kind`, for [`Rope::apply`]. The sin has its first half negated (see there).
    pub fn cos_sin(&self, positions: &Tensor, kind: Kind) -> (Tensor, Tensor) {
        let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * &self.inv_freq;
        let cos = freqs.cos();
        let sin = freqs.sin();
        (
            Tensor::cat(&[&cos, &cos], -1).to_kind(kind),
            Tensor::cat(&[&sin.neg(), &sin], -1).to_kind(kind),
        )
    }

    /// The cos and signed sin of positions `0..len` (see [`RopeTable`]).
    pub fn table(&self, len: i64, kind: Kind) -> RopeTable {
        let positions = Tensor::arange(len, (Kind::Int64, self.inv_freq.device()));
        let (cos, sin) = self.cos_sin(&positions, kind);
        RopeTable { cos, sin }
    }

    /// Applies the rotation with `cos`/`sin` from [`Rope::cos_sin`], broadcast against `x`
    /// [..., L, head_dim]: `x * cos + rotate_half(x) * sin`, where rotate_half(x) = [-x2, x1]
    /// (in libtorch's operations: [`rotate_half`], which the fused kernel is checked against).
    pub fn apply(x: &Tensor, cos: &Tensor, signed_sin: &Tensor) -> Tensor {
        rotate_half(x, cos, signed_sin)
    }
}

/// [`Rope::cos_sin`] of every position up to a length, computed once: decoding gathers the rows
/// of its positions (two kernels instead of the nine that compute them).
#[derive(Debug)]
pub struct RopeTable {
    cos: Tensor,
    sin: Tensor,
}

impl RopeTable {
    /// cos and signed sin [n, head_dim] of `positions` [n] (int64, below the table's length).
    pub fn at(&self, positions: &Tensor) -> (Tensor, Tensor) {
        (rows(&self.cos, positions), rows(&self.sin, positions))
    }
}

/// The rows `index` [n] (int64) of `table` [m, w], as `index_select` but through advanced
/// indexing: on a GPU its kernel spreads over every element gathered, where index_select's
/// kernel for few indices walks them one after another (a block of 16 rows: about 2 us against
/// 8-11 us, several times in every decoding step). Inference only (no gradient).
pub(crate) fn rows(table: &Tensor, index: &Tensor) -> Tensor {
    table.index(&[Some(index)])
}

/// One attention projection: its weight, bias and per-head norm.
type Projection<'a> = (&'a Tensor, Option<&'a Tensor>, Option<&'a Tensor>);

/// The weights of one attention layer. Biases exist for Qwen2; q/k norms for Qwen3 and the
/// drafter.
#[derive(Debug)]
pub(crate) struct AttentionWeights {
    pub q_proj: Tensor,
    pub k_proj: Tensor,
    pub v_proj: Tensor,
    pub o_proj: Tensor,
    pub q_bias: Option<Tensor>,
    pub k_bias: Option<Tensor>,
    pub v_bias: Option<Tensor>,
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    /// After [`AttentionWeights::fuse`]: the q, k, v projections as one matrix [q; k; v] (and
    /// its bias), of which `q_proj`, `k_proj`, `v_proj` are views.
    pub fused: Option<(Tensor, Option<Tensor>)>,
    /// After [`AttentionWeights::fuse`], with q/k norms: their weights per head of the fused
    /// queries and keys, [heads + kv_heads, head_dim] (one multiplication for both).
    pub fused_qk_norm: Option<Tensor>,
}

impl AttentionWeights {
    /// Stores q, k and v as one matrix and makes the three projections views of it (no extra
    /// memory): one matrix product instead of three per forward, where each costs more to
    /// launch than to run (decoding). For frozen weights only (the views are not leaves).
    pub(crate) fn fuse(&mut self) {
        let w = Tensor::cat(&[&self.q_proj, &self.k_proj, &self.v_proj], 0);
        let (nq, nk) = (self.q_proj.size()[0], self.k_proj.size()[0]);
        let nv = self.v_proj.size()[0];
        let b = match (&self.q_bias, &self.k_bias, &self.v_bias) {
            (Some(q), Some(k), Some(v)) => Some(Tensor::cat(&[q, k, v], 0)),
            (None, None, None) => None,
            // mixed biases: not worth a special case
            _ => return,
        };
        self.q_proj = w.narrow(0, 0, nq);
        self.k_proj = w.narrow(0, nq, nk);
        self.v_proj = w.narrow(0, nq + nk, nv);
        if let Some(b) = &b {
            self.q_bias = Some(b.narrow(0, 0, nq));
            self.k_bias = Some(b.narrow(0, nq, nk));
            self.v_bias = Some(b.narrow(0, nq + nk, nv));
        }
        self.fused = Some((w, b));
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            let d = qn.size()[0].max(1);
            let rows = |n: &Tensor, width: i64| n.unsqueeze(0).expand([width / d, d], false);
            self.fused_qk_norm = Some(Tensor::cat(&[rows(qn, nq), rows(kn, nk)], 0));
        }
    }

    /// Queries [B, heads, L, d] and keys [B, kv_heads, L, d] rotated by `cos`, `sin` [L, d],
    /// and values [B, kv_heads, L, d], of `x` [B, L, H]. After [`AttentionWeights::fuse`] the
    /// queries and keys stay one tensor until they are rotated: one matrix product, one norm and
    /// one rotation for both (decoding steps cost their kernel launches). The norm then rounds
    /// twice, as Hugging Face's does (normalised, then times the weight).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn project_qkv_rotated(
        &self,
        x: &Tensor,
        heads: i64,
        kv_heads: i64,
        d: i64,
        eps: f64,
        cos: &Tensor,
        sin: &Tensor,
    ) -> (Tensor, Tensor, Tensor) {
        let has_norms = self.q_norm.is_some() || self.k_norm.is_some();
        let (Some((w, b)), true) = (&self.fused, !has_norms || self.fused_qk_norm.is_some()) else {
            // unfused weights (or a q norm without a k norm): one product each
            let q = Rope::apply(&self.queries(x, heads, d, eps, None), cos, sin);
            let k = Rope::apply(&self.keys(x, kv_heads, d, eps, None), cos, sin);
            return (q, k, self.values(x, kv_heads, d));
        };
        let (batch, len) = (x.size()[0], x.size()[1]);
        let y = x
            .linear(w, b.as_ref())
            .view([batch, len, heads + 2 * kv_heads, d]);
        // The norm and the rotation run on dense tensors: the queries and keys alone are a
        // strided view of `y` (every token's values sit between them), which the norm and the
        // roll would first copy, and on which the other elementwise kernels take their slower
        // strided form. So the norm covers every head of `y` (the values' rows are then
        // dropped, and the weight's product is a dense copy of the rest), and without norms the
        // rotation covers every head, values included; the values are read from `y` itself.
        let qk = match &self.fused_qk_norm {
            Some(weight) => {
                y.rms_norm([d], None::<&Tensor>, eps)
                    .narrow(2, 0, heads + kv_heads)
                    * weight
            }
            None => y.shallow_clone(),
        };
        // [L, d] -> [L, 1, d]: one angle per position, for every head
        let qk = Rope::apply(&qk, &cos.unsqueeze(-2), &sin.unsqueeze(-2));
        (
            qk.narrow(2, 0, heads).transpose(1, 2),
            qk.narrow(2, heads, kv_heads).transpose(1, 2),
            y.narrow(2, heads + kv_heads, kv_heads).transpose(1, 2),
        )
    }

    /// [`AttentionWeights::project_qkv_rotated`] of a batch whose rows share the positions of
    /// `rope` (cos, sin [L, d]), with the q/k norms and the rotation in one fused kernel where
    /// `kernels` take the call (keys and values come back fresh, not views of the projection).
    pub(crate) fn project_qkv_rotated_with(
        &self,
        x: &Tensor,
        shape: AttentionShape,
        rope: (&Tensor, &Tensor),
        kernels: Option<&FusedKernels>,
    ) -> (Tensor, Tensor, Tensor) {
        if let Some(out) = kernels.and_then(|k| self.rotated_by_kernel(x, shape, rope, k)) {
            return out;
        }
        let AttentionShape {
            heads,
            kv_heads,
            head_dim,
            eps,
        } = shape;
        self.project_qkv_rotated(x, heads, kv_heads, head_dim, eps, rope.0, rope.1)
    }

    /// [`AttentionWeights::project_qkv_rotated_with`] on `rotate_write` (as the decoding engines
    /// run it) over every token of the batch; `None` where the weights are not fused or the
    /// kernel refuses the call.
    fn rotated_by_kernel(
        &self,
        x: &Tensor,
        shape: AttentionShape,
        rope: (&Tensor, &Tensor),
        kernels: &FusedKernels,
    ) -> Option<(Tensor, Tensor, Tensor)> {
        let (heads, kv_heads, d) = (shape.heads, shape.kv_heads, shape.head_dim);
        let (cos, sin) = rope;
        let (w, b) = self.fused.as_ref()?;
        if self.q_norm.is_some() != self.k_norm.is_some() {
            return None;
        }
        let (batch, len) = (x.size()[0], x.size()[1]);
        let n = batch * len;
        let y = x.linear(w, b.as_ref());
        let (cos, sin) = match batch {
            1 => (cos.shallow_clone(), sin.shallow_clone()),
            _ => (cos.repeat([batch, 1]), sin.repeat([batch, 1])),
        };
        let opts = (y.kind(), y.device());
        let rows = Tensor::arange(n, (Kind::Int64, y.device()));
        let keys = Tensor::empty([n, kv_heads, d], opts);
        let values = Tensor::empty([n, kv_heads, d], opts);
        let queries = kernels
            .rotate_write(
                &y,
                1,
                heads,
                self.q_norm.as_ref(),
                self.k_norm.as_ref(),
                shape.eps,
                &cos,
                &sin,
                &rows,
                &keys,
                &values,
            )
            .map_err(|e| log::warn!("fused q/k rotation refused a call, libtorch instead: {e:#}"))
            .ok()??;
        let by_head = |t: Tensor, h: i64| t.view([batch, len, h, d]).transpose(1, 2);
        Some((
            by_head(queries, heads),
            by_head(keys, kv_heads),
            by_head(values, kv_heads),
        ))
    }

    /// `y` [B, L, heads * d] as heads [B, heads, L, d], each normed where `norm` is given.
    fn heads_of(
        y: Tensor,
        norm: Option<&Tensor>,
        heads: i64,
        d: i64,
        eps: f64,
        kernels: Option<&FusedKernels>,
    ) -> Tensor {
        let (batch, len) = (y.size()[0], y.size()[1]);
        let y = y.view([batch, len, heads, d]);
        let y = match norm {
            Some(n) => rms_norm_with(&y, n, eps, kernels),
            None => y,
        };
        y.transpose(1, 2)
    }

    /// The training forward's queries, keys and values of `x` (the block's own), normed where
    /// the layer norms them, not rotated, as [`AttentionWeights::queries`], `keys` and `values`
    /// give them. `shape`: query heads, key/value heads, head size, the norms' epsilon.
    pub(crate) fn qkv_train(
        &self,
        x: &Tensor,
        shape: (i64, i64, i64, f64),
        kernels: Option<&FusedKernels>,
    ) -> [Tensor; 3] {
        let (heads, kv_heads, d, eps) = shape;
        let [q, k, v] = self.projections();
        self.projections_train(
            x,
            [(q, heads), (k, kv_heads), (v, kv_heads)],
            (d, eps),
            kernels,
        )
    }

    /// [`AttentionWeights::qkv_train`]'s keys and values alone (the context's).
    pub(crate) fn kv_train(
        &self,
        x: &Tensor,
        shape: (i64, i64, i64, f64),
        kernels: Option<&FusedKernels>,
    ) -> [Tensor; 2] {
        let (_, kv_heads, d, eps) = shape;
        let [_, k, v] = self.projections();
        self.projections_train(x, [(k, kv_heads), (v, kv_heads)], (d, eps), kernels)
    }

    /// Each projection's weight, bias and per-head norm: queries, keys, values.
    fn projections(&self) -> [Projection<'_>; 3] {
        [
            (&self.q_proj, self.q_bias.as_ref(), self.q_norm.as_ref()),
            (&self.k_proj, self.k_bias.as_ref(), self.k_norm.as_ref()),
            (&self.v_proj, self.v_bias.as_ref(), None),
        ]
    }

    /// The projections `picked` (with their head counts) of `x` as heads. Without biases the
    /// products are one autograd node ([`shared_input_linear`]), whose backward pass sums x's
    /// gradient inside the products.
    fn projections_train<const N: usize>(
        &self,
        x: &Tensor,
        picked: [(Projection<'_>, i64); N],
        (d, eps): (i64, f64),
        kernels: Option<&FusedKernels>,
    ) -> [Tensor; N] {
        let weights = picked.map(|((w, _, _), _)| w);
        let shared = picked
            .iter()
            .all(|((_, b, _), _)| b.is_none())
            .then(|| shared_input_linear(x, &weights))
            .and_then(|r| {
                r.map_err(|e| log::warn!("shared-input projections failed ({e:#}); linear's"))
                    .ok()
            })
            .and_then(|v| <[Tensor; N]>::try_from(v).ok());
        let products = shared.unwrap_or_else(|| picked.map(|((w, b, _), _)| x.linear(w, b)));
        std::array::from_fn(|i| {
            let ((_, _, norm), heads) = picked[i];
            Self::heads_of(products[i].shallow_clone(), norm, heads, d, eps, kernels)
        })
    }

    /// The queries [B, heads, L, d], normed (the norm on `kernels` where given: a training
    /// forward's autograd node), not rotated.
    pub(crate) fn queries(
        &self,
        x: &Tensor,
        heads: i64,
        d: i64,
        eps: f64,
        kernels: Option<&FusedKernels>,
    ) -> Tensor {
        Self::heads_of(
            x.linear(&self.q_proj, self.q_bias.as_ref()),
            self.q_norm.as_ref(),
            heads,
            d,
            eps,
            kernels,
        )
    }

    /// The keys [B, kv_heads, L, d], as [`AttentionWeights::queries`].
    pub(crate) fn keys(
        &self,
        x: &Tensor,
        kv_heads: i64,
        d: i64,
        eps: f64,
        kernels: Option<&FusedKernels>,
    ) -> Tensor {
        Self::heads_of(
            x.linear(&self.k_proj, self.k_bias.as_ref()),
            self.k_norm.as_ref(),
            kv_heads,
            d,
            eps,
            kernels,
        )
    }

    pub(crate) fn values(&self, x: &Tensor, kv_heads: i64, d: i64) -> Tensor {
        Self::heads_of(
            x.linear(&self.v_proj, self.v_bias.as_ref()),
            None,
            kv_heads,
            d,
            0.0,
            None,
        )
    }

    /// [B, heads, L, head_dim] attention output -> [B, L, H].
    pub(crate) fn output(&self, attn: &Tensor) -> Tensor {
        merge_heads(attn).linear::<&Tensor>(&self.o_proj, None)
    }

    /// `residual += output(attn)` in place, the sum done by the matrix product itself
    /// ([`add_product`]): inference only.
    pub(crate) fn add_output(&self, residual: &mut Tensor, attn: &Tensor) {
        let a = merge_heads(attn);
        let width = a.size()[2];
        add_product(residual, &a.view([-1, width]), &self.o_proj);
    }

    pub(crate) fn tensors(&self) -> Vec<&Tensor> {
        let mut out = vec![&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj];
        out.extend(
            [
                &self.q_bias,
                &self.k_bias,
                &self.v_bias,
                &self.q_norm,
                &self.k_norm,
            ]
            .into_iter()
            .flatten(),
        );
        out
    }
}

/// [B, heads, L, head_dim] -> [B, L, heads * head_dim] (dense).
fn merge_heads(attn: &Tensor) -> Tensor {
    let (batch, heads, len, d) = attn.size4().unwrap_or((0, 0, 0, 0));
    attn.transpose(1, 2)
        .contiguous()
        .view([batch, len, heads * d])
}

/// `residual += x W^T` for `x` [n, in] and `weight` [out, in], `residual` [..., out] holding n
/// rows: one matrix product that adds into its output (`addmm_`, beta = 1) in place of a
/// product and an addition (a decoding step is launch-bound: two kernels a layer fewer). A
/// residual that is not dense takes the product and the addition.
pub(crate) fn add_product(residual: &mut Tensor, x: &Tensor, weight: &Tensor) {
    let out = weight.size()[0];
    if residual.is_contiguous() {
        let _ = residual.view([-1, out]).addmm_(x, &weight.tr());
    } else {
        *residual += x.matmul(&weight.tr()).view_as(residual);
    }
}

/// One decoder layer (Llama, Qwen and the DFlash drafter alike): pre-norm attention and an MLP
/// (the drafter's and a dense target's a SwiGLU [`Mlp`]; a target's may be a mixture of
/// experts, [`super::feed_forward::FeedForward`]), each added to the residual stream.
pub(crate) struct DecoderLayer<F = Mlp> {
    pub input_norm: Tensor,
    pub attn: AttentionWeights,
    pub post_norm: Tensor,
    pub mlp: F,
}

/// What a decoder layer's attention needs to know of its model: head counts, head size, the
/// norms' epsilon.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionShape {
    pub heads: i64,
    pub kv_heads: i64,
    pub head_dim: i64,
    pub eps: f64,
}

impl<F: AddFeedForward> DecoderLayer<F> {
    /// The layer `idx` over a [`SlotCache`] (inference): the residual stream `h` [1, n, H] of
    /// the batch's n new tokens, rotated by `rope` (cos, signed sin, [n, d]), is updated in
    /// place; their keys and values are written to the cache, and they attend to their
    /// sequence's rows (`causal`: to the rows before them and themselves). With the cache's
    /// fused kernels (fused weights only) one kernel does the q/k norms, rotation and cache
    /// writes, and one SwiGLU's product; else libtorch's operations do.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_slots(
        &self,
        h: &mut Tensor,
        idx: usize,
        shape: AttentionShape,
        rope: (&Tensor, &Tensor),
        batch: &SlotBatch,
        cache: &mut SlotCache,
        causal: bool,
    ) -> Result<()> {
        let AttentionShape {
            heads,
            kv_heads,
            head_dim: d,
            eps,
        } = shape;
        let kernels = cache.kernels().copied();
        let x = rms_norm(h, &self.input_norm, eps);
        let attn = &self.attn;
        let a = match (&kernels, &attn.fused) {
            (Some(_), Some((w, b))) => cache.attend_projected(
                idx,
                &x.linear(w, b.as_ref()),
                heads,
                (attn.q_norm.as_ref(), attn.k_norm.as_ref()),
                eps,
                rope,
                batch,
                causal,
            )?,
            _ => {
                let (q, k, v) =
                    attn.project_qkv_rotated(&x, heads, kv_heads, d, eps, rope.0, rope.1);
                cache.attend(idx, &q, &k, &v, batch, causal)?
            }
        };
        attn.add_output(h, &a);
        let normed = rms_norm(h, &self.post_norm, eps);
        match &kernels {
            Some(k) => self.mlp.add_forward_fused(h, &normed, k),
            None => {
                self.mlp.add_forward(h, &normed);
                Ok(())
            }
        }
    }
}

/// Fused attention with grouped-query heads: without a mask on a GPU the flash kernel, called
/// directly (libtorch's `scaled_dot_product_attention` would choose cuDNN's on Hopper GPUs,
/// which builds a plan for every new sequence length: tens of milliseconds each, and sequence
/// lengths vary from batch to batch and from decoding step to step); else
/// `scaled_dot_product_attention`.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: bool,
) -> Tensor {
    if mask.is_none() && crate::aten_ext::flash_eligible(q, k, v) {
        if let Ok(o) = crate::aten_ext::flash_attention(q, k, v, causal) {
            return o;
        }
    }
    let gqa = q.size()[1] != k.size()[1];
    Tensor::scaled_dot_product_attention(q, k, v, mask, 0.0, causal, None, gqa)
}

/// Fused attention with an additive float mask `bias` (0 = visible, -inf = hidden) of the
/// compute kind, broadcast over heads ([B, 1, Q, K]); grouped-query heads when `k` has fewer
/// heads than `q`. Every row must see at least one key.
pub fn attention_with_bias(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor) -> Tensor {
    let gqa = q.size()[1] != k.size()[1];
    Tensor::scaled_dot_product_attention(q, k, v, Some(bias), 0.0, false, None, gqa)
}

/// Copies `t` to `device` without making the host wait for the device. A plain `to_device`
/// from pageable host memory to a GPU waits until the stream has finished all queued work;
/// going through pinned memory with a non-blocking copy does not (libtorch's pinned-memory
/// cache keeps the staging buffer until the copy is done). Other moves are plain `to_device`.
pub(crate) fn upload(t: &Tensor, device: Device) -> Tensor {
    if t.device() == device {
        t.shallow_clone()
    } else if t.device() == Device::Cpu && device.is_cuda() {
        // `_pin_memory`: what `pin_memory` runs, without its deprecation warning about the
        // device argument (printed at every call)
        t.f_internal_pin_memory(device)
            .unwrap_or_else(|_| t.pin_memory(device))
            .to_device_(device, t.kind(), true, false)
    } else {
        t.to_device(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `add_product` leaves the residual holding residual + x W^T, in its own storage: dense
    /// (the product adds into it) and strided (the product, then the addition).
    #[test]
    fn add_product_adds_the_product_into_the_residual() {
        let opts = (Kind::Double, Device::Cpu);
        let x = Tensor::from_slice(&[1.0, 2.0, -1.0, 0.5, 3.0, -2.0]).view([3, 2]);
        let w = Tensor::from_slice(&[2.0, 0.0, 1.0, -1.0])
            .view([2, 2])
            .to_kind(opts.0);
        let x = x.to_kind(opts.0);
        let base = Tensor::arange(6, opts).view([1, 3, 2]);
        // x W^T row by row: [2, -1], [-2, -1.5], [6, 5]
        let want = Tensor::from_slice(&[2.0, 0.0, 0.0, 1.5, 10.0, 10.0])
            .view([1, 3, 2])
            .to_kind(opts.0);

        let mut dense = base.copy();
        let ptr = dense.data_ptr();
        add_product(&mut dense, &x, &w);
        assert_eq!(dense.data_ptr(), ptr);
        assert!(dense.allclose(&want, 0.0, 1e-12, false), "{dense}");

        let storage = base.transpose(1, 2).contiguous(); // [1, 2, 3]
        let mut strided = storage.transpose(1, 2); // [1, 3, 2], not dense
        assert!(!strided.is_contiguous());
        add_product(&mut strided, &x, &w);
        assert!(strided.allclose(&want, 0.0, 1e-12, false), "{strided}");
        assert!(storage.transpose(1, 2).allclose(&want, 0.0, 1e-12, false));
    }
}
