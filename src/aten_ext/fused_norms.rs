//! The target's norms as fused kernels (`scaled_rms_norm`, `gated_rms_norm` in
//! fused_kernels.cu): the zero-centred RMSNorm of the Qwen3.5 hybrids, three libtorch kernels
//! with float32 copies of the input, and the Gated DeltaNet's gated output norm, about ten;
//! and the Gated DeltaNet's gates (`gdn_gates`), five.
//! A 1 x 3072-token forward of the 27B shape runs them some 260 times over [3072, 5120] or its
//! heads: their cost is the passes over memory, one here.

use std::ffi::c_int;

use anyhow::{bail, ensure, Result};
use tch::{Kind, Tensor};

use super::super::nvrtc::{arg, kind_index};
use super::FusedKernels;

/// The kernels' `RowLayout`: rows of a tensor [outer, inner, width], row r at
/// (r / inner) * outer_stride + (r % inner) * inner_stride elements.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowLayout {
    outer_stride: i64,
    inner_stride: i64,
    inner: i64,
}

/// `t` [..., inner, width] as the kernels' rows: its last dimension dense and the ones before
/// `inner` of one stride (a dense tensor, or a view of a projection's columns); `None` where
/// they are not.
fn row_layout(t: &Tensor) -> Option<RowLayout> {
    let (size, stride) = (t.size(), t.stride());
    let n = size.len();
    if n == 0 || (size[n - 1] > 1 && stride[n - 1] != 1) {
        return None;
    }
    let (inner, inner_stride) = if n >= 2 {
        (size[n - 2], stride[n - 2])
    } else {
        (1, 0)
    };
    // the dimensions before `inner`, collapsed into one (size-one ones skipped)
    let (mut outer_stride, mut span) = (0, None);
    for d in (0..n.saturating_sub(2)).rev().filter(|&d| size[d] != 1) {
        match span {
            None => outer_stride = stride[d],
            Some(s) if s != stride[d] => return None,
            Some(_) => {}
        }
        span = Some(stride[d] * size[d]);
    }
    Some(RowLayout {
        outer_stride,
        inner_stride,
        inner,
    })
}

/// `t`'s layout, made dense first where its rows do not have one.
fn rows_of(t: &Tensor) -> (Tensor, RowLayout) {
    if let Some(l) = row_layout(t) {
        return (t.shallow_clone(), l);
    }
    let dense = t.contiguous();
    let l = row_layout(&dense).unwrap_or(RowLayout {
        outer_stride: 0,
        inner_stride: 0,
        inner: 1,
    });
    (dense, l)
}

/// Blocks, threads per block and threads per row of a norm over `rows` rows of `width`
/// elements of `bytes` each: a warp per row, 8 rows a block, for rows up to 1,024 (heads);
/// else a block per row, a warp per four 16-byte vectors of it (64 to 1,024 threads; 160 for
/// a bf16 row of 5,120). tests/cuda_emulation/fused_emulation.cpp launches as this does.
pub(super) fn norm_launch(rows: i64, width: i64, bytes: i64) -> (u32, u32, c_int) {
    if width <= 1024 {
        return (((rows + 7) / 8) as u32, 256, 32);
    }
    let vec = 16 / bytes;
    let threads = ((width + 4 * vec - 1) / (4 * vec) + 31) / 32 * 32;
    let threads = threads.clamp(64, 1024);
    (rows as u32, threads as u32, threads as c_int)
}

impl FusedKernels {
    /// Whether the kernels take `t`: on their device, of a storage type they exist for.
    pub fn serve(&self, t: &Tensor) -> bool {
        t.device() == self.device() && kind_index(t.kind()).is_some()
    }

    /// The rows count and width of a norm's input `x` [..., width], checked against the
    /// launch's limits.
    pub(super) fn norm_rows(&self, what: &str, x: &Tensor) -> Result<(usize, i64, i64)> {
        let kind = x.kind();
        let Some(which) = kind_index(kind) else {
            bail!("fused kernels: no kernel for {what} of {kind:?}");
        };
        ensure!(
            x.device() == self.device(),
            "fused kernels: {what} is on {:?}, the kernels on {:?}",
            x.device(),
            self.device()
        );
        let width = x.size().last().copied().unwrap_or(0);
        let rows = if width > 0 {
            x.numel() as i64 / width
        } else {
            0
        };
        ensure!(
            width <= i64::from(i32::MAX) && rows <= i64::from(i32::MAX),
            "fused kernels: {what} of shape {:?} (rows and their width must fit 32 bits)",
            x.size()
        );
        Ok((which, rows, width))
    }

    /// The zero-centred RMSNorm of `x` [..., width] (bf16, f16 or f32; its last dimension
    /// dense, the others dense or a view of a projection's columns): what
    /// `x.to_kind(Float).rms_norm([width], scale, eps).to_kind(x.kind())` computes, up to the
    /// order of the float sum, in one kernel. `scale` [width] float32 (`1 + w`). Dense output of
    /// `x`'s shape.
    pub fn scaled_rms_norm(&self, x: &Tensor, scale: &Tensor, eps: f64) -> Result<Tensor> {
        let (which, rows, width) = self.norm_rows("the norm's input", x)?;
        self.check("the norm's scale", scale, Kind::Float)?;
        ensure!(
            scale.numel() as i64 == width,
            "fused kernels: a scale of {} for rows of {width}",
            scale.numel()
        );
        let out = Tensor::empty(x.size(), (x.kind(), x.device()));
        if rows == 0 {
            return Ok(out);
        }
        let (x, mut layout) = rows_of(x);
        let (blocks, threads, mut row_threads) =
            norm_launch(rows, width, x.kind().elt_size_in_bytes() as i64);
        let (mut xp, mut sp, mut op) = (x.data_ptr(), scale.data_ptr(), out.data_ptr());
        let (mut r, mut w, mut e) = (rows, width as c_int, eps as f32);
        let mut params = [
            arg(&mut xp),
            arg(&mut layout),
            arg(&mut sp),
            arg(&mut op),
            arg(&mut r),
            arg(&mut w),
            arg(&mut e),
            arg(&mut row_threads),
        ];
        self.module.launch(
            self.scaled_rms_norm[which],
            (blocks, 1),
            threads,
            &mut params,
        )?;
        Ok(out)
    }

    /// The Gated DeltaNet's gated output norm (transformers' `Qwen3_5RMSNormGated`) of the
    /// rule's output `x` [..., width] with the gate `z` (same shape and type; either may be a
    /// view of a projection's columns, the last dimension dense): `round(round(round(x * rstd)
    /// * weight) * silu(z))`, rstd = rsqrt(mean(x^2) + eps) over each row in float32, `weight`
    /// [width] of the storage type; the roundings of libtorch's operations, in one kernel.
    /// Dense output of `x`'s shape.
    pub fn gated_rms_norm(
        &self,
        x: &Tensor,
        z: &Tensor,
        weight: &Tensor,
        eps: f64,
    ) -> Result<Tensor> {
        let (which, rows, width) = self.norm_rows("the gated norm's input", x)?;
        let kind = x.kind();
        ensure!(
            z.size() == x.size() && z.kind() == kind && z.device() == x.device(),
            "fused kernels: a gate {:?} {:?} for an input {:?} {kind:?}",
            z.size(),
            z.kind(),
            x.size()
        );
        self.check("the gated norm's weight", weight, kind)?;
        ensure!(
            weight.numel() as i64 == width,
            "fused kernels: a gated norm weight of {} for rows of {width}",
            weight.numel()
        );
        let out = Tensor::empty(x.size(), (kind, x.device()));
        if rows == 0 {
            return Ok(out);
        }
        let (x, mut x_layout) = rows_of(x);
        let (z, mut z_layout) = rows_of(z);
        let (blocks, threads, mut row_threads) =
            norm_launch(rows, width, kind.elt_size_in_bytes() as i64);
        let (mut xp, mut zp, mut wp, mut op) = (
            x.data_ptr(),
            z.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
        );
        let (mut r, mut w, mut e) = (rows, width as c_int, eps as f32);
        let mut params = [
            arg(&mut xp),
            arg(&mut x_layout),
            arg(&mut zp),
            arg(&mut z_layout),
            arg(&mut wp),
            arg(&mut op),
            arg(&mut r),
            arg(&mut w),
            arg(&mut e),
            arg(&mut row_threads),
        ];
        self.module.launch(
            self.gated_rms_norm[which],
            (blocks, 1),
            threads,
            &mut params,
        )?;
        Ok(out)
    }

    /// The Gated DeltaNet's gates of every token: `a`, `b` [..., heads] (bf16, f16 or f32;
    /// dense rows of `heads`, or columns of the projection: every row one stride apart),
    /// `dt_bias` [heads] of their type, `neg_a` [heads] float32. Returns `g` =
    /// `softplus(a.to_kind(Float) + dt_bias) * neg_a` (float32) and `beta` = `sigmoid(b)`
    /// (their type), both dense [..., heads]: what libtorch's five kernels compute, in one.
    pub fn gdn_gates(
        &self,
        a: &Tensor,
        b: &Tensor,
        dt_bias: &Tensor,
        neg_a: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (which, rows, heads) = self.norm_rows("the gates' a", a)?;
        let kind = a.kind();
        let row_stride = |t: &Tensor| -> Option<i64> {
            let (size, stride) = (t.size(), t.stride());
            let n = size.len();
            // rows of `heads` dense, and the dimensions before them collapsing into one stride
            if n < 1 || (size[n - 1] > 1 && stride[n - 1] != 1) {
                return None;
            }
            let mut row = None;
            let mut expected = None;
            for d in (0..n - 1).rev().filter(|&d| size[d] != 1) {
                match expected {
                    Some(e) if e != stride[d] => return None,
                    _ => {}
                }
                row.get_or_insert(stride[d]);
                expected = Some(stride[d] * size[d]);
            }
            Some(row.unwrap_or(heads))
        };
        ensure!(
            b.size() == a.size() && b.kind() == kind && b.device() == a.device(),
            "fused kernels: the gates' b {:?} {:?}, a {:?} {kind:?}",
            b.size(),
            b.kind(),
            a.size()
        );
        let (Some(stride_a), Some(stride_b)) = (row_stride(a), row_stride(b)) else {
            bail!("fused kernels: the gates' a and b must have rows one stride apart");
        };
        ensure!(
            stride_a == stride_b,
            "fused kernels: the gates' a and b have rows {stride_a} and {stride_b} apart"
        );
        self.check("dt_bias", dt_bias, kind)?;
        self.check("neg_a", neg_a, Kind::Float)?;
        ensure!(
            dt_bias.numel() as i64 == heads && neg_a.numel() as i64 == heads,
            "fused kernels: dt_bias and neg_a must hold {heads} values"
        );
        let g = Tensor::empty(a.size().as_slice(), (Kind::Float, a.device()));
        let beta = Tensor::empty(a.size().as_slice(), (kind, a.device()));
        let n = rows * heads;
        if n == 0 {
            return Ok((g, beta));
        }
        let (mut pa, mut pb, mut pd, mut pn, mut pg, mut pbeta) = (
            a.data_ptr(),
            b.data_ptr(),
            dt_bias.data_ptr(),
            neg_a.data_ptr(),
            g.data_ptr(),
            beta.data_ptr(),
        );
        let (mut stride, mut h, mut r) = (stride_a, heads as c_int, rows);
        let mut params = [
            arg(&mut pa),
            arg(&mut pb),
            arg(&mut stride),
            arg(&mut h),
            arg(&mut r),
            arg(&mut pd),
            arg(&mut pn),
            arg(&mut pg),
            arg(&mut pbeta),
        ];
        // a thread per value, grid-stride past 65,535 blocks
        let blocks = ((n + 255) / 256).min(65_535) as u32;
        self.module
            .launch(self.gdn_gates[which], (blocks, 1), 256, &mut params)?;
        Ok((g, beta))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Rows of dense tensors, of a projection's head views (q of gated attention: heads 2 d
    /// apart; z: heads d apart, tokens a projection's width apart) and of views that are
    /// neither (made dense first).
    #[test]
    fn rows_are_read_in_place_where_one_stride_reaches_them() {
        let layout = |t: &Tensor| row_layout(t);
        let dense = Tensor::zeros([2, 3, 8], (Kind::Float, tch::Device::Cpu));
        assert_eq!(
            layout(&dense),
            Some(RowLayout {
                outer_stride: 24,
                inner_stride: 8,
                inner: 3
            })
        );
        // [b 2, l 3, heads 4, 2 d] -> q [2, 3, 4, d]
        let (d, width) = (8i64, 4 * 16 + 40);
        let y = Tensor::zeros([2, 3, width], (Kind::Float, tch::Device::Cpu));
        let q = y
            .narrow(-1, 0, 4 * 2 * d)
            .view([2, 3, 4, 2 * d])
            .narrow(-1, 0, d);
        assert_eq!(
            layout(&q),
            Some(RowLayout {
                outer_stride: width,
                inner_stride: 2 * d,
                inner: 4
            })
        );
        let one_row = Tensor::zeros([8], (Kind::Float, tch::Device::Cpu));
        assert_eq!(
            layout(&one_row),
            Some(RowLayout {
                outer_stride: 0,
                inner_stride: 0,
                inner: 1
            })
        );
        // [2, 1, 3, 8] with a size-one dimension of any stride
        assert!(layout(&dense.unsqueeze(1)).is_some());
        // batches and tokens of a transposed tensor do not share one stride
        let t = Tensor::zeros([3, 2, 4, 8], (Kind::Float, tch::Device::Cpu)).transpose(0, 1);
        assert_eq!(layout(&t), None);
        let (made, l) = rows_of(&t);
        assert!(made.is_contiguous());
        assert_eq!((l.outer_stride, l.inner_stride, l.inner), (32, 8, 4));
        // columns not dense
        assert_eq!(layout(&dense.transpose(1, 2)), None);
    }

    /// The fused kernels' source compiled for a Hopper GPU, as PTX text; `None` where NVRTC is
    /// not there.
    pub(in crate::aten_ext::fused) fn fused_ptx() -> Option<String> {
        let nvrtc = super::super::super::nvrtc::nvrtc_for_tests()?;
        let ptx = nvrtc
            .compile_named(super::super::SOURCE, "fused_kernels.cu", 90)
            .unwrap();
        Some(ptx.to_str().unwrap().to_string())
    }

    /// The sizes of the parameters of `entry` in the PTX `text`, in order.
    pub(in crate::aten_ext::fused) fn param_sizes(text: &str, entry: &str) -> Vec<usize> {
        let start = text
            .find(&format!(".entry {entry}("))
            .unwrap_or_else(|| panic!("no .entry {entry} in the PTX"));
        let list = &text[start..];
        let list = &list[..list.find(')').unwrap()];
        list.lines()
            .filter(|l| l.trim_start().starts_with(".param"))
            .map(|l| match l.find('[') {
                Some(i) => l[i + 1..l.find(']').unwrap()].parse().unwrap(),
                None if l.contains("64") => 8,
                None if l.contains("32") => 4,
                None => panic!("a parameter of {entry} of unknown size: {l}"),
            })
            .collect()
    }

    /// Each norm kernel takes, in order, parameters of the sizes its launch passes (pointers,
    /// row layouts, 64-bit row count, 32-bit width, eps and threads per row): a launch with
    /// arguments out of step with the source would read garbage.
    #[test]
    fn the_norm_kernels_take_what_their_launches_pass() {
        let Some(text) = fused_ptx() else {
            return;
        };
        let text = text.as_str();
        let ptr = std::mem::size_of::<*mut std::ffi::c_void>();
        let layout = std::mem::size_of::<RowLayout>();
        let (long, int, float) = (8, std::mem::size_of::<c_int>(), std::mem::size_of::<f32>());
        for kind in ["bf16", "f16", "f32"] {
            assert_eq!(
                param_sizes(text, &format!("scaled_rms_norm_{kind}")),
                [ptr, layout, ptr, ptr, long, int, float, int]
            );
            assert_eq!(
                param_sizes(text, &format!("gated_rms_norm_{kind}")),
                [ptr, layout, ptr, layout, ptr, ptr, long, int, float, int]
            );
        }
    }

    /// A warp per row up to rows of 1,024, else a block per row of a warp per four vectors.
    #[test]
    fn norm_launches_fit_the_row() {
        assert_eq!(norm_launch(3072 * 24, 256, 2), (9216, 256, 32));
        assert_eq!(norm_launch(11, 128, 4), (2, 256, 32));
        assert_eq!(norm_launch(3072, 5120, 2), (3072, 160, 160));
        assert_eq!(norm_launch(3072, 5120, 4), (3072, 320, 320));
        assert_eq!(norm_launch(5, 1100, 2), (5, 64, 64));
        assert_eq!(norm_launch(5, 65536, 4), (5, 1024, 1024));
    }

    /// The norm kernels (and SwiGLU's product, a mixture of experts' combination) run on the
    /// CPU (tests/cuda_emulation/fused_emulation.cpp with cuda_emu.h: one host thread per CUDA
    /// thread, barriers for __syncthreads and the warp shuffles) compute what double-precision
    /// loops rounding where libtorch's operations round compute: rows of 5,120 and of heads,
    /// strided and misaligned rows, bf16 and f32. The router's top k equals the host's reading
    /// of libtorch's GPU selection and sort, ties included, and the grouping a stable sort. The
    /// optimizer's step equals AdamW in double precision to float32 rounding; RMSNorm's
    /// backward pass, the LM head's cross-entropy (loss, first-argmax check with ties,
    /// gradient), the q/k norms, rotation and cache writes of `rotate_write` (both launch
    /// forms) and the block attention's own-block part and merge, forward and backward (the
    /// thread-a-row, warp-cooperative and tensor-core forms), equal their double-precision
    /// formulas to a rounding.
    /// Needs a C++20 compiler (`$CXX`, else `c++`).
    #[test]
    fn the_norm_kernels_run_on_the_cpu_match_the_libtorch_roundings() {
        crate::aten_ext::nvrtc::run_cuda_emulation("fused_emulation", 135);
    }
}
