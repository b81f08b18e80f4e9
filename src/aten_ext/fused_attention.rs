//! A Qwen3.5 gated attention layer's work around its attention call as fused kernels
//! (`gated_attention_prep`, `sigmoid_gate_mul` in fused_kernels.cu). After the q/k/v projection
//! libtorch runs the two zero-centred norms, a copy of the gate out of the projection, and for
//! the partial rotary embedding of queries and keys a product, a copy, a roll, an addcmul and a
//! concatenation each; after the attention a copy, the gate's sigmoid and the product: about
//! sixteen launches and as many passes over [tokens, heads, head_dim]. Here: two kernels, the
//! gate read where the projection left it.

use std::ffi::c_int;

use anyhow::{ensure, Result};
use tch::{Kind, Tensor};

use super::super::nvrtc::{arg, kind_index};
use super::FusedKernels;

/// Warps (heads) per block of `gated_attention_prep`, and the longest head it stages (the
/// source's `GATED_PREP_WARPS`, `GATED_PREP_MAX_D`).
const PREP_WARPS: i64 = 8;
const PREP_MAX_D: i64 = 512;

/// The shape of a gated attention layer's projection: query heads (each a query and a gate),
/// key/value heads, the head size and how much of each head the rotary embedding turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatedHeads {
    pub heads: i64,
    pub kv_heads: i64,
    pub head_dim: i64,
    pub rotary_dim: i64,
}

impl GatedHeads {
    /// Elements of one token's projection: per query head a query and a gate, then the keys
    /// and the values.
    fn row(&self) -> i64 {
        (2 * self.heads + 2 * self.kv_heads) * self.head_dim
    }
}

impl FusedKernels {
    /// The tokens of the dense projection `y` [..., row] of `shape` (bf16, f16 or f32 on the
    /// kernels' device) and its storage type's kernel index.
    fn gated_rows(&self, y: &Tensor, shape: GatedHeads) -> Result<(usize, i64)> {
        let kind = y.kind();
        let which = kind_index(kind)
            .ok_or_else(|| anyhow::anyhow!("fused kernels: no kernel for {kind:?}"))?;
        self.check("the projection", y, kind)?;
        let row = shape.row();
        ensure!(
            y.size().last() == Some(&row),
            "fused kernels: a projection of shape {:?}, not [..., {row}] for {shape:?}",
            y.size()
        );
        Ok((which, y.numel() as i64 / row.max(1)))
    }

    /// The queries [n, heads, d] and keys [n, kv_heads, d] of a gated attention layer from its
    /// dense projection `y` [..., row]: each head normed (`x * rstd * scale` in float32, rounded
    /// once, as [`FusedKernels::scaled_rms_norm`] computes it, up to nothing: the same sum),
    /// then its first `rotary_dim` turned by `cos`, `sin` [m, rotary_dim] (token t at row
    /// t % m; the sin's first half negated, as `Rope::cos_sin` makes it) with the roundings of
    /// `x * cos` and `addcmul(rotate_half(x), sin)`; the rest passed through. `q_scale`,
    /// `k_scale` [head_dim] float32 (`1 + w`).
    #[allow(clippy::too_many_arguments)]
    pub fn gated_attention_prep(
        &self,
        y: &Tensor,
        shape: GatedHeads,
        q_scale: &Tensor,
        k_scale: &Tensor,
        eps: f64,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (which, n) = self.gated_rows(y, shape)?;
        let GatedHeads {
            heads,
            kv_heads,
            head_dim: d,
            rotary_dim: rot,
        } = shape;
        ensure!(
            heads > 0
                && kv_heads > 0
                && d > 0
                && d <= PREP_MAX_D
                && rot >= 0
                && rot <= d
                && rot % 2 == 0,
            "fused kernels: gated attention heads {shape:?} (head_dim up to {PREP_MAX_D}, an even rotary part)"
        );
        for (what, t) in [("q_scale", q_scale), ("k_scale", k_scale)] {
            self.check(what, t, Kind::Float)?;
            ensure!(
                t.numel() as i64 == d,
                "fused kernels: {what} has {} elements for heads of {d}",
                t.numel()
            );
        }
        let m = if rot > 0 { cos.numel() as i64 / rot } else { 1 };
        for (what, t) in [("cos", cos), ("sin", sin)] {
            self.check(what, t, y.kind())?;
            ensure!(
                rot == 0 || (t.size().last() == Some(&rot) && m > 0 && n % m == 0),
                "fused kernels: {what} of shape {:?} for {n} tokens and a rotary part of {rot}",
                t.size()
            );
        }
        let q = Tensor::empty([n, heads, d], (y.kind(), y.device()));
        let k = Tensor::empty([n, kv_heads, d], (y.kind(), y.device()));
        if n == 0 {
            return Ok((q, k));
        }
        let (mut yp, mut qs, mut ks, mut cp, mut sp, mut qp, mut kp) = (
            y.data_ptr(),
            q_scale.data_ptr(),
            k_scale.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            q.data_ptr(),
            k.data_ptr(),
        );
        let (mut row_stride, mut rows, mut mm) = (shape.row(), n, m.max(1));
        let (mut h, mut kv, mut dd, mut r, mut e) = (
            heads as c_int,
            kv_heads as c_int,
            d as c_int,
            rot as c_int,
            eps as f32,
        );
        let mut params = [
            arg(&mut yp),
            arg(&mut row_stride),
            arg(&mut rows),
            arg(&mut h),
            arg(&mut kv),
            arg(&mut dd),
            arg(&mut r),
            arg(&mut qs),
            arg(&mut ks),
            arg(&mut e),
            arg(&mut cp),
            arg(&mut sp),
            arg(&mut mm),
            arg(&mut qp),
            arg(&mut kp),
        ];
        let items = n * (heads + kv_heads);
        let blocks = (items + PREP_WARPS - 1) / PREP_WARPS;
        ensure!(
            blocks <= i64::from(i32::MAX),
            "fused kernels: {items} heads are too many for one launch"
        );
        self.module.launch(
            self.gated_attention_prep[which],
            (blocks as u32, 1),
            (32 * PREP_WARPS) as u32,
            &mut params,
        )?;
        Ok((q, k))
    }

    /// The gated attention's output gate: `attn` [n, heads, d] (dense) times the sigmoid of
    /// each query head's gate, read in place from the projection `y` [..., row] the queries
    /// came from, each rounded as libtorch's sigmoid and product round. Returns [n, heads * d].
    pub fn sigmoid_gate_mul(&self, attn: &Tensor, y: &Tensor, shape: GatedHeads) -> Result<Tensor> {
        let (which, n) = self.gated_rows(y, shape)?;
        let (heads, d) = (shape.heads, shape.head_dim);
        self.check("the attention's output", attn, y.kind())?;
        ensure!(
            attn.numel() as i64 == n * heads * d,
            "fused kernels: an attention output of shape {:?} for {n} tokens of {heads} x {d}",
            attn.size()
        );
        let out = Tensor::empty([n, heads * d], (y.kind(), y.device()));
        if n == 0 {
            return Ok(out);
        }
        let (mut ap, mut yp, mut op) = (attn.data_ptr(), y.data_ptr(), out.data_ptr());
        let (mut row_stride, mut rows, mut h, mut dd) =
            (shape.row(), n, heads as c_int, d as c_int);
        let mut params = [
            arg(&mut ap),
            arg(&mut yp),
            arg(&mut row_stride),
            arg(&mut rows),
            arg(&mut h),
            arg(&mut dd),
            arg(&mut op),
        ];
        // 16-byte vectors where they fit (8 bf16 elements a thread), grid-stride past what
        // fills the device
        let per_thread = 16 / y.kind().elt_size_in_bytes() as i64;
        let threads = 256;
        let wanted = (n * heads * d / per_thread + threads - 1) / threads;
        let blocks = wanted.clamp(1, 32 * self.module.multiprocessors() as i64);
        self.module.launch(
            self.sigmoid_gate_mul[which],
            (blocks as u32, 1),
            threads as u32,
            &mut params,
        )?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::super::norms::tests::{fused_ptx, param_sizes};
    use std::ffi::c_int;

    /// The kernels take, in order, parameters of the sizes their launches pass.
    #[test]
    fn the_gated_attention_kernels_take_what_their_launches_pass() {
        let Some(text) = fused_ptx() else {
            return;
        };
        let text = text.as_str();
        let ptr = std::mem::size_of::<*mut std::ffi::c_void>();
        let (long, int, float) = (8, std::mem::size_of::<c_int>(), std::mem::size_of::<f32>());
        for kind in ["bf16", "f16", "f32"] {
            assert_eq!(
                param_sizes(text, &format!("gated_attention_prep_{kind}")),
                [ptr, long, long, int, int, int, int, ptr, ptr, float, ptr, ptr, long, ptr, ptr]
            );
            assert_eq!(
                param_sizes(text, &format!("sigmoid_gate_mul_{kind}")),
                [ptr, ptr, long, long, int, int, ptr]
            );
        }
    }
}
