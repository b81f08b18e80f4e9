//! RMSNorm of the drafter's training forward as an autograd node ([`rms_norm_autograd`]):
//! forward the `scaled_rms_norm` kernel (one pass, with the weight as its float32 scale),
//! backward the `rms_norm_backward` kernel (fused_kernels.cu), which reads x and the output's
//! gradient once and writes the input's gradient and per-block partial sums of the weight's.
//! libtorch's fused pair costs about twice the memory traffic at the 8B shape: its backward
//! pass reads x and the gradient once for the input's gradient and again for the weight's.
//! Where there are no kernels, or they refuse the tensors, the passes are libtorch's
//! operations.

use std::ffi::{c_char, c_int, c_void};

use anyhow::{anyhow, ensure, Result};
use tch::{Kind, Tensor};

use super::super::ffi;
use super::super::nvrtc::{arg, kind_index};
use super::autograd::{apply_node, apply_node_outputs, borrowed, guarded_pass, two_input_pass};
use super::FusedKernels;

/// The 16-byte vectors of a row each thread of `rms_norm_backward` holds (the kernel's
/// `RMS_BWD_VECTORS`).
const VECTORS_PER_THREAD: i64 = 4;

/// Blocks, threads per block and threads per row of `rms_norm_backward` over `rows` rows of
/// `width` elements of `bytes` each on a device of `multiprocessors`: rows of up to 32 vectors
/// take a power of two of lanes (a vector each; several rows a warp, 256 threads a block), longer
/// ones a block of whole warps, each thread up to four vectors; enough blocks to fill the device
/// about once, each looping over its share of the rows (the weight's gradient is summed per
/// thread across them). `None` where the width is not whole vectors or needs more than 1,024
/// threads. tests/cuda_emulation/fused_emulation.cpp launches as this does.
fn rms_backward_launch(
    rows: i64,
    width: i64,
    bytes: i64,
    multiprocessors: i64,
) -> Option<(u32, u32, c_int)> {
    let vec = 16 / bytes.max(1);
    if width <= 0 || width % vec != 0 {
        return None;
    }
    let vectors = width / vec;
    let (threads, row_threads) = if vectors <= 32 {
        (256, (vectors as u64).next_power_of_two() as i64)
    } else {
        let row = ((vectors + VECTORS_PER_THREAD - 1) / VECTORS_PER_THREAD + 31) / 32 * 32;
        (row, row)
    };
    if row_threads > 1024 {
        return None;
    }
    let groups = threads / row_threads;
    let wanted = (rows + groups - 1) / groups;
    let blocks = wanted
        .min(multiprocessors.max(1) * (1024 / threads).max(1))
        .max(1);
    Some((blocks as u32, threads as u32, row_threads as c_int))
}

impl FusedKernels {
    /// The backward pass of `x.rms_norm([width], weight, eps)` for dense `x` [..., width] and
    /// the output's gradient `grad` (dense, x's shape), `weight` [width], all of one storage
    /// type on this device: the gradients of x (x's shape) and of the weight ([width], summed
    /// over rows in float32, then rounded). What libtorch's two backward kernels compute, up to
    /// the order of the float sums, in one pass over x and the gradient.
    ///
    /// With `residual` (dense, x's shape and type), x's gradient also adds it, in the same pass:
    /// the gradient of a residual stream that x continues ([`add_rms_norm_autograd`]).
    pub fn rms_norm_backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        grad: &Tensor,
        residual: Option<&Tensor>,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        let (which, rows, width) = self.norm_rows("the norm's input", x)?;
        let kind = x.kind();
        self.check("the norm's input", x, kind)?;
        self.check("the norm's weight", weight, kind)?;
        self.check("the norm's output gradient", grad, kind)?;
        ensure!(
            grad.size() == x.size() && weight.numel() as i64 == width,
            "fused kernels: an RMSNorm backward of x {:?}, gradient {:?}, weight {:?}",
            x.size(),
            grad.size(),
            weight.size()
        );
        if let Some(r) = residual {
            self.check("the residual's gradient", r, kind)?;
            ensure!(
                r.size() == x.size(),
                "fused kernels: a residual gradient {:?} for x {:?}",
                r.size(),
                x.size()
            );
        }
        let aligned = [x, weight, grad]
            .into_iter()
            .chain(residual)
            .all(|t| (t.data_ptr() as usize).is_multiple_of(16));
        let multiprocessors = i64::from(self.module.multiprocessors());
        let launch = rms_backward_launch(
            rows,
            width,
            kind.elt_size_in_bytes() as i64,
            multiprocessors,
        )
        .filter(|_| aligned)
        .ok_or_else(|| {
            anyhow!("fused kernels: no RMSNorm backward launch for rows of {width} ({kind:?})")
        })?;
        let dx = x.empty_like();
        if rows == 0 {
            return Ok((dx, weight.zeros_like()));
        }
        let (blocks, threads, mut row_threads) = launch;
        let partial_rows = i64::from(blocks) * i64::from(threads / row_threads as u32);
        let partial = Tensor::empty([partial_rows, width], (Kind::Float, x.device()));
        let (mut xp, mut wp, mut gp, mut rp, mut dp, mut pp) = (
            x.data_ptr(),
            weight.data_ptr(),
            grad.data_ptr(),
            residual.map_or(std::ptr::null_mut(), |r| r.data_ptr()),
            dx.data_ptr(),
            partial.data_ptr(),
        );
        let (mut r, mut w, mut e) = (rows, width as c_int, eps as f32);
        self.module.launch(
            self.rms_norm_backward[which],
            (blocks, 1),
            threads,
            &mut [
                arg(&mut xp),
                arg(&mut wp),
                arg(&mut gp),
                arg(&mut rp),
                arg(&mut dp),
                arg(&mut pp),
                arg(&mut r),
                arg(&mut w),
                arg(&mut e),
                arg(&mut row_threads),
            ],
        )?;
        let dw = partial
            .sum_dim_intlist([0i64].as_slice(), false, Kind::Float)
            .to_kind(weight.kind());
        Ok((dx, dw))
    }

    /// `s = h + a` and `y = s.rms_norm([width], weight, eps)` of dense `h`, `a` [..., width]
    /// (one storage type, on this device) with `scale` the weight as float32 [width]: what
    /// libtorch's addition and rms_norm compute (s rounded, the norm in float32 and rounded once),
    /// up to the order of the float sum, in one pass.
    pub fn add_rms_norm(
        &self,
        h: &Tensor,
        a: &Tensor,
        scale: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        let (which, rows, width) = self.norm_rows("the residual norm's input", h)?;
        let kind = h.kind();
        self.check("the residual", h, kind)?;
        self.check("the residual's addend", a, kind)?;
        self.check("the norm's scale", scale, Kind::Float)?;
        ensure!(
            a.size() == h.size()
                && h.is_contiguous()
                && a.is_contiguous()
                && scale.numel() as i64 == width,
            "fused kernels: a residual norm of dense h {:?} and a {:?} with a scale of {}",
            h.size(),
            a.size(),
            scale.numel()
        );
        let (s, y) = (h.empty_like(), h.empty_like());
        if rows == 0 {
            return Ok((s, y));
        }
        let (blocks, threads, mut row_threads) =
            super::norms::norm_launch(rows, width, kind.elt_size_in_bytes() as i64);
        let (mut hp, mut ap, mut cp, mut sp, mut yp) = (
            h.data_ptr(),
            a.data_ptr(),
            scale.data_ptr(),
            s.data_ptr(),
            y.data_ptr(),
        );
        let (mut r, mut w, mut e) = (rows, width as c_int, eps as f32);
        self.module.launch(
            self.add_rms_norm[which],
            (blocks, 1),
            threads,
            &mut [
                arg(&mut hp),
                arg(&mut ap),
                arg(&mut cp),
                arg(&mut sp),
                arg(&mut yp),
                arg(&mut r),
                arg(&mut w),
                arg(&mut e),
                arg(&mut row_threads),
            ],
        )?;
        Ok((s, y))
    }
}

/// `x.rms_norm([width], weight, eps)` over the last dimension (`weight` [width]) as one autograd
/// node: on `kernels`' device one kernel each way; elsewhere (or where they refuse the tensors)
/// libtorch's operations.
pub fn rms_norm_autograd(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    kernels: Option<&FusedKernels>,
) -> Result<Tensor> {
    apply_node("RMSNorm", kernels, |state, len, out| {
        // SAFETY: live tensors (see apply_node)
        unsafe {
            ffi::dflash_rms_norm_autograd(
                x.as_ptr().cast(),
                weight.as_ptr().cast(),
                eps,
                rms_norm_callback,
                state,
                len,
                out,
            )
        }
    })
}

/// `(s, y) = (h + a, s.rms_norm([width], weight, eps))` over the last dimension (h, a the same
/// shape, `weight` [width]) as one autograd node: on `kernels`' device one kernel each way (the
/// backward pass adds s's own gradient to the norm's input gradient in the same pass, where
/// autograd would sum them in a pass of its own); elsewhere (or where they refuse the tensors)
/// libtorch's operations. A layer's residual stream: s goes on to the next residual sum, y
/// into the layer's next block.
pub fn add_rms_norm_autograd(
    h: &Tensor,
    a: &Tensor,
    weight: &Tensor,
    eps: f64,
    kernels: Option<&FusedKernels>,
) -> Result<(Tensor, Tensor)> {
    let [s, y] = apply_node_outputs("the residual RMSNorm", kernels, |state, len, out| {
        // SAFETY: live tensors (see apply_node_outputs)
        unsafe {
            ffi::dflash_add_rms_norm_autograd(
                h.as_ptr().cast(),
                a.as_ptr().cast(),
                weight.as_ptr().cast(),
                eps,
                add_rms_norm_callback,
                state,
                len,
                out,
            )
        }
    })?;
    Ok((s, y))
}

/// One pass of the residual norm node: forward `[s, y]` from h and a; backward `[dx, dw]`
/// from s, s's own gradient (where it has one) and y's; the kernels where they take the
/// tensors, else libtorch's operations.
fn add_rms_norm_pass(
    kernels: Option<&FusedKernels>,
    x0: &Tensor,
    x1: Option<&Tensor>,
    weight: &Tensor,
    grad: Option<&Tensor>,
    eps: f64,
) -> Vec<Tensor> {
    let on_kernels =
        kernels.filter(|k| k.device() == x0.device() && kind_index(x0.kind()).is_some());
    if let Some(k) = on_kernels {
        let done = match (grad, x1) {
            (None, Some(a)) => k
                .add_rms_norm(&dense(x0), &dense(a), &weight.to_kind(Kind::Float), eps)
                .map(|(s, y)| vec![s, y]),
            (None, None) => Err(anyhow!("a residual norm's forward pass without its addend")),
            (Some(g), r) => {
                let r = r.map(dense);
                k.rms_norm_backward(&dense(x0), &dense(weight), &dense(g), r.as_ref(), eps)
                    .map(|(dx, dw)| vec![dx, dw])
            }
        };
        match done {
            Ok(out) => return out,
            Err(e) => {
                log::debug!("residual RMSNorm kernels refused ({e:#}); libtorch's operations")
            }
        }
    }
    let width = x0.size().last().copied().unwrap_or(0);
    match grad {
        None => {
            let s = match x1 {
                Some(a) => x0 + a,
                None => x0.shallow_clone(),
            };
            let y = s.rms_norm([width], Some(weight), eps);
            vec![s, y]
        }
        Some(g) => {
            let (dx, dw) = rms_norm_backward_reference(x0, weight, g, eps);
            let dx = match x1 {
                Some(r) => dx + r,
                None => dx,
            };
            vec![dx, dw]
        }
    }
}

/// The residual norm node's passes (autograd.cpp's `dflash_add_rms_norm_fn`); `grad` null for
/// the forward.
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn add_rms_norm_callback(
    state: *const c_void,
    x0: *const c_void,
    x1: *const c_void,
    weight: *const c_void,
    grad: *const c_void,
    eps: f64,
    out0: *mut *mut c_void,
    out1: *mut *mut c_void,
    msg: *mut c_char,
    msg_len: usize,
) -> c_int {
    guarded_pass(&[out0, out1], (msg, msg_len), || {
        // SAFETY: `state` holds the bytes of an Option<FusedKernels> (apply_node_outputs); the
        // tensors are live `at::Tensor`s (x1 and grad may be null), shallow-copied here.
        let kernels: Option<FusedKernels> = std::ptr::read_unaligned(state.cast());
        let x0 = borrowed(x0);
        let x1 = (!x1.is_null()).then(|| borrowed(x1));
        let weight = borrowed(weight);
        let grad = (!grad.is_null()).then(|| borrowed(grad));
        add_rms_norm_pass(
            kernels.as_ref(),
            &x0,
            x1.as_ref(),
            &weight,
            grad.as_ref(),
            eps,
        )
    })
}

/// A tensor's dense form (itself where it already is).
fn dense(t: &Tensor) -> Tensor {
    if t.is_contiguous() {
        t.shallow_clone()
    } else {
        t.contiguous()
    }
}

/// One pass of the node: forward `[y]`, backward `[dx, dw]`; the kernels where they take the
/// tensors, else libtorch's operations.
fn rms_norm_pass(
    kernels: Option<&FusedKernels>,
    x: &Tensor,
    weight: &Tensor,
    grad: Option<&Tensor>,
    eps: f64,
) -> Vec<Tensor> {
    let on_kernels = kernels.filter(|k| k.device() == x.device() && kind_index(x.kind()).is_some());
    if let Some(k) = on_kernels {
        let x = dense(x);
        let done = match grad {
            None => k
                .scaled_rms_norm(&x, &weight.to_kind(Kind::Float), eps)
                .map(|y| vec![y]),
            Some(g) => k
                .rms_norm_backward(&x, &dense(weight), &dense(g), None, eps)
                .map(|(dx, dw)| vec![dx, dw]),
        };
        match done {
            Ok(out) => return out,
            Err(e) => log::debug!("RMSNorm kernels refused ({e:#}); libtorch's operations"),
        }
    }
    let width = x.size().last().copied().unwrap_or(0);
    match grad {
        None => vec![x.rms_norm([width], Some(weight), eps)],
        Some(g) => {
            let (dx, dw) = rms_norm_backward_reference(x, weight, g, eps);
            vec![dx, dw]
        }
    }
}

/// The backward pass of RMSNorm in libtorch's operations, in float32 (float64 for float64
/// tensors): `dx = rstd (g w - x_hat mean(g w x_hat))`, `dw = sum over rows of g x_hat`, with
/// `x_hat = x rstd`; each rounded once to its tensor's type.
fn rms_norm_backward_reference(
    x: &Tensor,
    weight: &Tensor,
    grad: &Tensor,
    eps: f64,
) -> (Tensor, Tensor) {
    let acc = if x.kind() == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    };
    let width = x.size().last().copied().unwrap_or(0);
    let xf = x.to_kind(acc);
    let gf = grad.to_kind(acc);
    let rstd = (xf.square().mean_dim(-1, true, acc) + eps).rsqrt();
    let x_hat = &xf * &rstd;
    let gw = &gf * weight.to_kind(acc);
    let mean_gwxh = (&gw * &x_hat).mean_dim(-1, true, acc);
    let dx = (&rstd * (gw - &x_hat * mean_gwxh)).to_kind(x.kind());
    let dw = (gf * x_hat)
        .reshape([-1, width])
        .sum_dim_intlist([0i64].as_slice(), false, acc)
        .to_kind(weight.kind());
    (dx, dw)
}

/// The node's passes (autograd.cpp's `dflash_rms_norm_fn`); `grad` null for the forward.
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rms_norm_callback(
    state: *const c_void,
    x: *const c_void,
    weight: *const c_void,
    grad: *const c_void,
    eps: f64,
    out0: *mut *mut c_void,
    out1: *mut *mut c_void,
    msg: *mut c_char,
    msg_len: usize,
) -> c_int {
    two_input_pass(
        state,
        (x, weight),
        grad,
        (out0, out1),
        (msg, msg_len),
        |kernels, x, weight, grad| rms_norm_pass(kernels, x, weight, grad, eps),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// On the CPU (libtorch's operations in the node's passes): the node's values are
    /// libtorch's `rms_norm`, and the gradients of x and of the weight are what autograd takes
    /// through `rms_norm`, in float64, for an output gradient in another layout than x's.
    #[test]
    fn the_node_computes_rms_norm_and_its_gradients() {
        tch::manual_seed(11);
        let opts = (Kind::Double, Device::Cpu);
        let x = Tensor::randn([3, 5, 16], opts).set_requires_grad(true);
        let w = (Tensor::randn([16], opts) * 0.3 + 1.0).set_requires_grad(true);
        let g = Tensor::randn([5, 3, 16], opts).transpose(0, 1);
        let eps = 1e-6;
        let y = rms_norm_autograd(&x, &w, eps, None).unwrap();
        let want = x.rms_norm([16], Some(&w), eps);
        assert!(y.allclose(&want, 0.0, 0.0, false), "values");
        let grads = |y: &Tensor| {
            let gs = Tensor::run_backward(&[(y * &g).sum(Kind::Double)], &[&x, &w], false, false);
            (gs[0].copy(), gs[1].copy())
        };
        let (dx, dw) = grads(&y);
        let (want_dx, want_dw) = grads(&want);
        let close = |a: &Tensor, b: &Tensor| a.allclose(b, 1e-12, 1e-12, false);
        assert!(close(&dx, &want_dx), "the input's gradient");
        assert!(close(&dw, &want_dw), "the weight's gradient");
        // and in float32 (the kernels' accumulation type), within its rounding
        let (x32, w32, g32) = (
            x.detach().to_kind(Kind::Float),
            w.detach().to_kind(Kind::Float),
            g.to_kind(Kind::Float),
        );
        let (dx32, dw32) = rms_norm_backward_reference(&x32, &w32, &g32, eps);
        assert!(dx32
            .to_kind(Kind::Double)
            .allclose(&want_dx, 1e-5, 1e-5, false));
        assert!(dw32
            .to_kind(Kind::Double)
            .allclose(&want_dw, 1e-5, 1e-5, false));
    }

    /// On the CPU (libtorch's operations in the node's passes): the residual norm node's
    /// outputs are `h + a` and its `rms_norm`, and the gradients of h, a and the weight are
    /// what autograd takes through them (float64), with s's own gradient and without it.
    #[test]
    fn the_residual_node_computes_the_sum_its_norm_and_their_gradients() {
        tch::manual_seed(12);
        let opts = (Kind::Double, Device::Cpu);
        let leaf = |shape: &[i64]| Tensor::randn(shape, opts).set_requires_grad(true);
        let (h, a) = (leaf(&[2, 5, 16]), leaf(&[2, 5, 16]));
        let w = (Tensor::randn([16], opts) * 0.3 + 1.0).set_requires_grad(true);
        let (gs, gy) = (
            Tensor::randn([2, 5, 16], opts),
            Tensor::randn([2, 5, 16], opts),
        );
        let (s, y) = add_rms_norm_autograd(&h, &a, &w, 1e-6, None).unwrap();
        let want_s = &h + &a;
        let want_y = want_s.rms_norm([16], Some(&w), 1e-6);
        assert!(s.allclose(&want_s, 0.0, 0.0, false), "the sum");
        assert!(y.allclose(&want_y, 0.0, 0.0, false), "the norm");
        for with_sum in [true, false] {
            let grads = |s: &Tensor, y: &Tensor| {
                let mut loss = (y * &gy).sum(Kind::Double);
                if with_sum {
                    loss += (s * &gs).sum(Kind::Double);
                }
                Tensor::run_backward(&[loss], &[&h, &a, &w], true, false)
            };
            let got = grads(&s, &y);
            let want = grads(&want_s, &want_y);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.allclose(w, 1e-12, 1e-12, false),
                    "gradient {i}, sum used {with_sum}"
                );
            }
        }
    }

    /// The launch: heads of 128 bf16 take 16 lanes a row (16 rows a block), rows of 4,096 a
    /// block of 128 threads (four vectors each), 5,120 one of 160; the grid fills the device
    /// about once and never has more row groups than rows need; odd widths are refused.
    #[test]
    fn the_backward_launch_covers_every_row() {
        assert_eq!(
            rms_backward_launch(100_000, 128, 2, 132),
            Some((528, 256, 16))
        );
        assert_eq!(rms_backward_launch(20, 128, 2, 132), Some((2, 256, 16)));
        assert_eq!(
            rms_backward_launch(14_000, 4096, 2, 132),
            Some((1056, 128, 128))
        );
        assert_eq!(rms_backward_launch(3, 5120, 2, 132), Some((3, 160, 160)));
        assert_eq!(rms_backward_launch(10, 4096, 4, 132), Some((10, 256, 256)));
        assert_eq!(rms_backward_launch(10, 100, 2, 132), None);
        assert_eq!(rms_backward_launch(10, 65_536, 2, 132), None);
        for (rows, width, bytes) in [(1, 8, 2), (7, 64, 4), (1000, 256, 2), (33, 2048, 2)] {
            let (blocks, threads, row_threads) =
                rms_backward_launch(rows, width, bytes, 4).unwrap();
            let groups = i64::from(threads) / i64::from(row_threads);
            let vectors = width / (16 / bytes);
            assert!(
                i64::from(row_threads) * VECTORS_PER_THREAD >= vectors,
                "{width}"
            );
            assert!(
                (i64::from(blocks) - 1) * groups < rows,
                "no block without a row"
            );
        }
    }
}
