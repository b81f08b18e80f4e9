//! A mixture of experts' routing, grouping and combination as fused kernels (`moe_topk_*`,
//! `moe_group_*` and `moe_combine` in fused_kernels.cu). Per MoE layer of a 1 x 3072-token
//! forward libtorch runs a radix selection and a bitonic sort for the router's top k (one block per token), a
//! radix sort of the 24,576 pairs' expert ids, a binary search and three index kernels for the
//! grouping, and four element-wise passes to add the shared expert and the residual: some
//! fifteen launches of a few to fifty microseconds, forty layers over. Here: one kernel for the
//! top k, three for the grouping, and the combination takes the shared expert and the residual.

use std::ffi::c_int;

use anyhow::{bail, ensure, Result};
use tch::{Kind, Tensor};

use super::super::nvrtc::{arg, kind_index};
use super::{FusedKernels, MOE_MAX_TOP_K};

/// The most experts the routing kernels take (the source's `MOE_MAX_EXPERTS`).
pub const MOE_MAX_EXPERTS: i64 = 1024;
/// Tokens per block of the grouping kernels (the source's `MOE_GROUP_TOKENS`).
const GROUP_TOKENS: i64 = 64;
/// Tokens per block of `moe_topk` (a warp each; the source's `MOE_TOPK_WARPS`).
const TOPK_WARPS: i64 = 8;

/// The (token, choice) pairs grouped by expert, as [`FusedKernels::moe_groups`] returns them.
#[derive(Debug)]
pub struct MoeGroups {
    /// [E] int32: the end (exclusive) of each expert's rows among the sorted pairs (the grouped
    /// products' offsets).
    pub ends: Tensor,
    /// [T k] int64: where pair `t k + j`'s row lies among the sorted pairs.
    pub positions: Tensor,
    /// [T k] int64: the token of each sorted row.
    pub row_tokens: Tensor,
}

impl FusedKernels {
    /// The rows and columns of `t`, a dense matrix of `kind` on this device.
    fn matrix(&self, what: &str, t: &Tensor, kind: Kind) -> Result<(i64, i64)> {
        self.check(what, t, kind)?;
        match t.size()[..] {
            [rows, columns] => Ok((rows, columns)),
            _ => bail!("fused kernels: {what} of shape {:?}", t.size()),
        }
    }

    /// The `k` largest of each row of `probs` [tokens, experts] (float32, dense; at most
    /// [`MOE_MAX_EXPERTS`] experts, `k` at most 32): values [tokens, k] and indices [tokens, k]
    /// (int64), the same as libtorch's `topk(k, -1, largest, sorted)` on a GPU returns them,
    /// equal values included (which of them it keeps and the order it leaves them in).
    pub fn moe_topk(&self, probs: &Tensor, k: i64) -> Result<(Tensor, Tensor)> {
        let (values, indices, _) = self.topk_launch(probs, k, None)?;
        Ok((values, indices))
    }

    /// [`FusedKernels::moe_topk`]'s choices with their routing weights [tokens, k] of
    /// `weight_kind` (bf16, f16 or f32) in the same kernel: the values divided by their sum
    /// where `normalize`, cast. Bit for bit what `(top / top.sum(-1, keepdim)).to(kind)` gives
    /// on a GPU (the kernel sums in libtorch's order), where libtorch runs three kernels.
    pub fn moe_route(
        &self,
        probs: &Tensor,
        k: i64,
        normalize: bool,
        weight_kind: Kind,
    ) -> Result<(Tensor, Tensor)> {
        let (_, indices, weights) = self.topk_launch(probs, k, Some((normalize, weight_kind)))?;
        let weights = weights.ok_or_else(|| anyhow::anyhow!("moe_topk wrote no weights"))?;
        Ok((weights, indices))
    }

    /// The launch of `moe_topk`: values, indices and, with `weights` = (normalize, kind), the
    /// routing weights.
    fn topk_launch(
        &self,
        probs: &Tensor,
        k: i64,
        weights: Option<(bool, Kind)>,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let (tokens, experts) = self.matrix("the router's probabilities", probs, Kind::Float)?;
        ensure!(
            (1..=MOE_MAX_EXPERTS).contains(&experts)
                && (1..=MOE_MAX_TOP_K.min(experts)).contains(&k),
            "fused kernels: the top {k} of {experts} experts (at most {MOE_MAX_TOP_K} of \
             {MOE_MAX_EXPERTS})"
        );
        let device = probs.device();
        let values = Tensor::empty([tokens, k], (Kind::Float, device));
        let indices = Tensor::empty([tokens, k], (Kind::Int64, device));
        let (mut normalize, mut weight_kind, out) = match weights {
            Some((normalize, kind)) => {
                let index = kind_index(kind)
                    .ok_or_else(|| anyhow::anyhow!("fused kernels: routing weights of {kind:?}"))?;
                let out = Tensor::empty([tokens, k], (kind, device));
                (c_int::from(normalize), index as c_int, Some(out))
            }
            None => (0, 0, None),
        };
        if tokens == 0 {
            return Ok((values, indices, out));
        }
        let blocks = (tokens + TOPK_WARPS - 1) / TOPK_WARPS;
        ensure!(
            blocks <= i64::from(i32::MAX),
            "fused kernels: {tokens} tokens are more than one launch takes"
        );
        let (mut p, mut v, mut i) = (probs.data_ptr(), values.data_ptr(), indices.data_ptr());
        let mut w = out.as_ref().map_or(std::ptr::null_mut(), |t| t.data_ptr());
        let (mut n, mut e, mut top) = (tokens, experts as c_int, k as c_int);
        let mut params = [
            arg(&mut p),
            arg(&mut n),
            arg(&mut e),
            arg(&mut top),
            arg(&mut v),
            arg(&mut i),
            arg(&mut normalize),
            arg(&mut weight_kind),
            arg(&mut w),
        ];
        // eight probabilities a lane up to 256 experts, else 32
        let which = usize::from(experts > 256);
        self.module.launch(
            self.moe_topk[which],
            (blocks as u32, 1),
            (32 * TOPK_WARPS) as u32,
            &mut params,
        )?;
        Ok((values, indices, out))
    }

    /// The pairs of `experts_of` [tokens, k] (int64, dense; each token's experts distinct, ids
    /// in `0..num_experts`) grouped by expert, stably (token order within an expert): what a
    /// stable sort of the flattened ids, a binary search for the ends and the inverse of the
    /// sorting permutation give, in three kernels.
    pub fn moe_groups(&self, experts_of: &Tensor, num_experts: i64) -> Result<MoeGroups> {
        let (tokens, k) = self.matrix("the router's choices", experts_of, Kind::Int64)?;
        ensure!(
            (1..=MOE_MAX_EXPERTS).contains(&num_experts) && (1..=MOE_MAX_TOP_K).contains(&k),
            "fused kernels: {k} choices of {num_experts} experts (at most {MOE_MAX_TOP_K} of \
             {MOE_MAX_EXPERTS})"
        );
        let device = experts_of.device();
        let chunks = (tokens + GROUP_TOKENS - 1) / GROUP_TOKENS;
        ensure!(
            chunks <= i64::from(i32::MAX) && tokens * k <= i64::from(i32::MAX),
            "fused kernels: {tokens} tokens are more than one launch takes"
        );
        // every end is written by moe_group_offsets (all zero with no tokens)
        let mut ends = Tensor::empty([num_experts], (Kind::Int, device));
        let positions = Tensor::empty([tokens * k], (Kind::Int64, device));
        let row_tokens = Tensor::empty([tokens * k], (Kind::Int64, device));
        if tokens == 0 {
            return Ok(MoeGroups {
                ends: ends.zero_(),
                positions,
                row_tokens,
            });
        }
        let counts = Tensor::empty([chunks, num_experts], (Kind::Int, device));
        let (mut ids, mut c, mut e_ptr) =
            (experts_of.data_ptr(), counts.data_ptr(), ends.data_ptr());
        let (mut pos, mut rows) = (positions.data_ptr(), row_tokens.data_ptr());
        let (mut n, mut choices, mut experts, mut blocks) =
            (tokens, k as c_int, num_experts as c_int, chunks);
        let grid = (chunks as u32, 1);
        self.module.launch(
            self.moe_group_count,
            grid,
            256,
            &mut [
                arg(&mut ids),
                arg(&mut n),
                arg(&mut choices),
                arg(&mut experts),
                arg(&mut c),
            ],
        )?;
        self.module.launch(
            self.moe_group_offsets,
            (1, 1),
            1024,
            &mut [
                arg(&mut c),
                arg(&mut blocks),
                arg(&mut experts),
                arg(&mut e_ptr),
            ],
        )?;
        self.module.launch(
            self.moe_group_place,
            grid,
            256,
            &mut [
                arg(&mut ids),
                arg(&mut n),
                arg(&mut choices),
                arg(&mut experts),
                arg(&mut c),
                arg(&mut pos),
                arg(&mut rows),
            ],
        )?;
        Ok(MoeGroups {
            ends,
            positions,
            row_tokens,
        })
    }

    /// A mixture of experts' output [tokens, hidden] from its routed products `y` [tokens * k,
    /// hidden] (dense, rows sorted by expert): per token t the sum over its choices j of
    /// `y[pos[t k + j]] * weights[t k + j]` (`pos` [tokens * k] int64, where the pair's product
    /// lies; `weights` [tokens * k] in y's type, token order), each product rounded to the type,
    /// the sum in float32 rounded once, as libtorch's scaling, `index_copy` and sum over the k
    /// compute it (up to the order of the float sum).
    pub fn moe_combine(
        &self,
        y: &Tensor,
        pos: &Tensor,
        weights: &Tensor,
        k: i64,
    ) -> Result<Tensor> {
        let (tokens, hidden) = combination_shape(y, k)?;
        let out = Tensor::empty([tokens, hidden], (y.kind(), y.device()));
        self.launch_combine(y, pos, weights, k, None, &out, false)?;
        Ok(out)
    }

    /// [`FusedKernels::moe_combine`] added into `residual` [tokens, hidden] (dense, y's type):
    /// `residual[t] = round(residual[t] + round(routed[t]))`, and with `shared` = (its output
    /// [tokens, hidden], its gate's logit [tokens] or [tokens, 1]) the routed sum plus
    /// `round(round(sigmoid(gate[t])) * shared[t])`, rounded, before that: Qwen3.5-MoE's block
    /// and the decoder layer's residual sum, rounded where transformers rounds. An error leaves
    /// `residual` as it was.
    pub fn moe_combine_add(
        &self,
        y: &Tensor,
        pos: &Tensor,
        weights: &Tensor,
        k: i64,
        shared: Option<(&Tensor, &Tensor)>,
        residual: &mut Tensor,
    ) -> Result<()> {
        self.launch_combine(y, pos, weights, k, shared, residual, true)
    }

    /// The checks and the launch of `moe_combine` into `out`.
    #[allow(clippy::too_many_arguments)]
    fn launch_combine(
        &self,
        y: &Tensor,
        pos: &Tensor,
        weights: &Tensor,
        k: i64,
        shared: Option<(&Tensor, &Tensor)>,
        out: &Tensor,
        accumulate: bool,
    ) -> Result<()> {
        let kind = y.kind();
        let Some(which) = kind_index(kind) else {
            bail!("fused kernels: no kernel for {kind:?}");
        };
        self.check("the experts' products", y, kind)?;
        self.check("the routing weights", weights, kind)?;
        self.check("the products' positions", pos, Kind::Int64)?;
        self.check("the combination's output", out, kind)?;
        let (tokens, hidden) = combination_shape(y, k)?;
        let pairs = tokens * k;
        ensure!(
            pos.size() == [pairs] && weights.size() == [pairs] && out.size() == [tokens, hidden],
            "fused kernels: positions {:?}, weights {:?} and output {:?} for {tokens} tokens x \
             {k} products of {hidden}",
            pos.size(),
            weights.size(),
            out.size()
        );
        let (mut shared_ptr, mut gate_ptr) = (std::ptr::null_mut(), std::ptr::null_mut());
        if let Some((shared_out, gate)) = shared {
            self.check("the shared expert's output", shared_out, kind)?;
            self.check("the shared expert's gate", gate, kind)?;
            ensure!(
                shared_out.size() == [tokens, hidden] && gate.numel() == tokens as usize,
                "fused kernels: shared expert output {:?} and gate {:?} for {tokens} tokens \
                 of {hidden}",
                shared_out.size(),
                gate.size()
            );
            (shared_ptr, gate_ptr) = (shared_out.data_ptr(), gate.data_ptr());
        }
        if tokens == 0 || hidden == 0 {
            return Ok(());
        }
        ensure!(
            tokens <= i64::from(i32::MAX),
            "fused kernels: {tokens} tokens are more than one launch takes"
        );
        let vector = 16 / kind.elt_size_in_bytes() as i64;
        let aligned = |p: *mut std::ffi::c_void| (p as usize).is_multiple_of(16);
        let mut vectors =
            c_int::from(hidden % vector == 0 && aligned(y.data_ptr()) && aligned(out.data_ptr()));
        let (mut y_ptr, mut pos_ptr, mut w_ptr, mut out_ptr) = (
            y.data_ptr(),
            pos.data_ptr(),
            weights.data_ptr(),
            out.data_ptr(),
        );
        let (mut width, mut choices, mut add) = (hidden, k as c_int, c_int::from(accumulate));
        let mut params = [
            arg(&mut y_ptr),
            arg(&mut pos_ptr),
            arg(&mut w_ptr),
            arg(&mut shared_ptr),
            arg(&mut gate_ptr),
            arg(&mut out_ptr),
            arg(&mut width),
            arg(&mut choices),
            arg(&mut vectors),
            arg(&mut add),
        ];
        self.module.launch(
            self.moe_combine[which],
            (tokens as u32, 1),
            256,
            &mut params,
        )
    }
}

/// The tokens and width of the routed products `y` [tokens * k, hidden] of `k` choices each.
fn combination_shape(y: &Tensor, k: i64) -> Result<(i64, i64)> {
    let (pairs, hidden) = match y.size()[..] {
        [pairs, hidden] => (pairs, hidden),
        _ => bail!("fused kernels: experts' products of shape {:?}", y.size()),
    };
    ensure!(
        (1..=MOE_MAX_TOP_K).contains(&k) && pairs % k == 0,
        "fused kernels: {pairs} expert products are not tokens x {k} choices (1 to \
         {MOE_MAX_TOP_K})"
    );
    Ok((pairs / k, hidden))
}
