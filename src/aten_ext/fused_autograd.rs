//! Operations of the drafter's training forward as autograd nodes whose passes are one kernel
//! each (fused_kernels.cu), where libtorch runs several passes over the same activations:
//! - the rotary embedding ([`rotary_autograd`], the `rotary_*` kernel): forward
//!   `x * cos + roll(x) * sin`, backward the transposed rotation of the gradient, so that
//!   nothing of `x` is saved; libtorch runs three kernels forward (a product, `roll`,
//!   `addcmul`) and four backward;
//! - SwiGLU's product ([`swiglu_autograd`], the `swiglu_*` kernel): `silu(gate) * up`, saving
//!   gate and up only; libtorch runs two kernels forward and three backward, and keeps
//!   `silu(gate)` as well.
//!
//! The nodes are libtorch's (autograd.cpp: tch cannot attach a backward pass from Rust); their
//! passes call back into Rust here ([`rotate_callback`], [`swiglu_callback`]), which falls back
//! to libtorch's operations where there are no kernels or they refuse the tensors.

use std::ffi::{c_char, c_int, c_void};

use anyhow::{anyhow, bail, ensure, Result};
use tch::Tensor;

use super::super::nvrtc::{arg, kind_index};
use super::super::{check, ffi};
use super::FusedKernels;

/// Threads per block of `rotary` (rows of `d` elements, `d / vec` threads a row).
const ROTARY_THREADS: i64 = 256;

impl FusedKernels {
    /// `x * cos + roll(x, d / 2) * sin` (with `inverse`, `x * cos - roll(x, d / 2) * sin`) of
    /// `x` [rows, d], `heads` consecutive rows a position, with `cos` and `sin`
    /// [rows / heads, d]: all dense and of one kind (bf16, f16, f32), on this device.
    pub fn rotary(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        heads: i64,
        inverse: bool,
    ) -> Result<Tensor> {
        let kind = x.kind();
        let which = kind_index(kind).ok_or_else(|| anyhow!("fused kernels: rotary of {kind:?}"))?;
        let (rows, d) = match x.size()[..] {
            [rows, d] => (rows, d),
            _ => bail!("fused kernels: rotary of shape {:?}", x.size()),
        };
        ensure!(
            d % 2 == 0 && (2..=1024).contains(&d) && heads > 0 && rows % heads == 0,
            "fused kernels: rotary of rows of {d} elements, {heads} a position, {rows} rows"
        );
        for (what, t) in [("x", x), ("cos", cos), ("sin", sin)] {
            self.check(what, t, kind)?;
            ensure!(
                t.is_contiguous(),
                "fused kernels: rotary's {what} is not dense"
            );
        }
        for t in [cos, sin] {
            ensure!(
                t.size() == [rows / heads, d],
                "fused kernels: rotary's tables {:?} for {rows} rows of {d}, {heads} a position",
                t.size()
            );
        }
        let out = x.empty_like();
        if rows == 0 {
            return Ok(out);
        }
        // 16-byte vectors where half a row holds whole ones and every row starts aligned
        let vector = 16 / x.kind().elt_size_in_bytes() as i64;
        let aligned = [x, cos, sin, &out]
            .iter()
            .all(|t| (t.data_ptr() as usize).is_multiple_of(16));
        let vec = if (d / 2) % vector == 0 && aligned {
            vector
        } else {
            1
        };
        let per_row = d / vec;
        let threads = if ROTARY_THREADS % per_row == 0 {
            ROTARY_THREADS
        } else {
            per_row
        };
        let per_block = threads / per_row;
        let blocks = (rows + per_block - 1) / per_block;
        ensure!(
            blocks <= i64::from(i32::MAX),
            "fused kernels: {rows} rows are more than one launch takes"
        );
        let (mut px, mut pc, mut ps, mut po) =
            (x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr());
        let (mut n, mut h, mut width, mut inv, mut v) = (
            rows,
            heads as c_int,
            d as c_int,
            c_int::from(inverse),
            vec as c_int,
        );
        self.module.launch(
            self.rotary[which],
            (blocks as u32, 1),
            threads as u32,
            &mut [
                arg(&mut px),
                arg(&mut pc),
                arg(&mut ps),
                arg(&mut po),
                arg(&mut n),
                arg(&mut h),
                arg(&mut width),
                arg(&mut inv),
                arg(&mut v),
            ],
        )?;
        Ok(out)
    }
}

/// The rotary embedding of `x` [B, heads, L, d] with `cos`, `sin` broadcast against it
/// ([B or 1, 1, L, d], as `Rope::cos_sin` makes them) as one autograd node: what
/// [`rotate_half`] (`Rope::apply`)
/// computes, with a backward pass that is one more rotation. On `kernels`' device their
/// `rotary` kernel runs both passes; elsewhere (or where it refuses the tensors) libtorch's
/// operations do.
pub fn rotary_autograd(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    kernels: Option<&FusedKernels>,
) -> Result<Tensor> {
    apply_node("the rotary embedding", kernels, |state, len, out| {
        // SAFETY: live tensors (see apply_node)
        unsafe {
            ffi::dflash_rotary_autograd(
                x.as_ptr().cast(),
                cos.as_ptr().cast(),
                sin.as_ptr().cast(),
                rotate_callback,
                state,
                len,
                out,
            )
        }
    })
}

/// Records a node through the shim: `call` passes it the bytes of `kernels` (an
/// `Option<FusedKernels>`, which the shim copies and hands back to the node's passes, read
/// there as the same type) and the out-pointer it writes the node's output to on success.
pub(super) fn apply_node(
    what: &str,
    kernels: Option<&FusedKernels>,
    call: impl FnOnce(*const c_void, usize, *mut *mut c_void) -> *mut c_char,
) -> Result<Tensor> {
    let [out] = apply_node_outputs(what, kernels, call)?;
    Ok(out)
}

/// [`apply_node`] for a node of `N` outputs: `call` writes them to the `N` slots its last
/// argument points to.
pub(super) fn apply_node_outputs<const N: usize>(
    what: &str,
    kernels: Option<&FusedKernels>,
    call: impl FnOnce(*const c_void, usize, *mut *mut c_void) -> *mut c_char,
) -> Result<[Tensor; N]> {
    let state: Option<FusedKernels> = kernels.copied();
    let mut out: [*mut c_void; N] = [std::ptr::null_mut(); N];
    let err = call(
        (&state as *const Option<FusedKernels>).cast(),
        std::mem::size_of::<Option<FusedKernels>>(),
        out.as_mut_ptr(),
    );
    // SAFETY: `err` is the shim's message or null; each slot of `out` a new tensor where it is
    // not null, taken over once.
    unsafe {
        check(err)?;
        if out.iter().any(|p| p.is_null()) {
            bail!("{what} returned no tensor");
        }
        Ok(out.map(|p| Tensor::from_ptr(p.cast())))
    }
}

/// The rotary embedding in libtorch's operations, `x * cos + rotate_half(x) * sin` with
/// `rotate_half(x) = [-x2, x1]` (the layout of Hugging Face Llama / Qwen), written as
/// `x * cos + roll(x) * signed_sin` (roll by half a head: [x2, x1]; the sin's first half
/// negated): three kernels instead of five (a narrow, a negation and a concatenation fewer).
/// `Rope::apply`, and the reference of the `rotary` kernel.
pub fn rotate_half(x: &Tensor, cos: &Tensor, signed_sin: &Tensor) -> Tensor {
    let half = x.size()[x.dim() - 1] / 2;
    let mut out = x * cos;
    let _ = out.addcmul_(&x.roll([half], [-1]), signed_sin);
    out
}

/// One pass of the node: the kernel where it takes the tensors, else libtorch's operations.
fn rotate(
    kernels: Option<&FusedKernels>,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    inverse: bool,
) -> Tensor {
    if let Some(k) = kernels.filter(|k| k.device() == x.device()) {
        match rotate_on_kernel(k, x, cos, sin, inverse) {
            Ok(out) => return out,
            Err(e) => log::debug!("rotary kernel refused ({e:#}); libtorch's operations"),
        }
    }
    if inverse {
        rotate_half(x, cos, &sin.neg())
    } else {
        rotate_half(x, cos, sin)
    }
}

/// [`FusedKernels::rotary`] of `x` [B, heads, L, d] in the layout the projections leave it in
/// (a [B, L, heads, d] tensor transposed; other layouts are copied into it first).
fn rotate_on_kernel(
    k: &FusedKernels,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    inverse: bool,
) -> Result<Tensor> {
    let (b, heads, l, d) = x.size4()?;
    let rows = x.transpose(1, 2);
    let rows = if rows.is_contiguous() {
        rows
    } else {
        rows.contiguous()
    };
    let table = |t: &Tensor| -> Result<Tensor> {
        ensure!(
            t.dim() == 4 && t.size()[1] == 1,
            "rotary tables of shape {:?}",
            t.size()
        );
        Ok(t.f_expand([b, 1, l, d], false)?
            .squeeze_dim(1)
            .contiguous()
            .view([b * l, d]))
    };
    let (c, s) = (table(cos)?, table(sin)?);
    let out = k.rotary(&rows.view([b * l * heads, d]), &c, &s, heads, inverse)?;
    Ok(out.view([b, l, heads, d]).transpose(1, 2))
}

/// The node's passes (autograd.cpp's `dflash_rotate_fn`): `*out` = the rotation of `x`, or its
/// inverse. Returns 0, or 1 with a message in `msg` (nothing unwinds into C++).
unsafe extern "C" fn rotate_callback(
    state: *const c_void,
    x: *const c_void,
    cos: *const c_void,
    sin: *const c_void,
    inverse: c_int,
    out: *mut *mut c_void,
    msg: *mut c_char,
    msg_len: usize,
) -> c_int {
    guarded_pass(&[out], (msg, msg_len), || {
        // SAFETY: `state` holds the bytes of an Option<FusedKernels> (rotary_autograd); the
        // tensors are live `at::Tensor`s, shallow-copied here.
        let kernels: Option<FusedKernels> = std::ptr::read_unaligned(state.cast());
        let (x, cos, sin) = (borrowed(x), borrowed(cos), borrowed(sin));
        vec![rotate(kernels.as_ref(), &x, &cos, &sin, inverse != 0)]
    })
}

/// A live `at::Tensor` of the C++ side as a tch tensor (a shallow copy).
pub(super) unsafe fn borrowed(t: *const c_void) -> Tensor {
    Tensor::clone_from_ptr(t.cast_mut().cast())
}

/// Runs one pass of a node for the C++ side: the tensors `pass` returns go to `outs` (taken over
/// by the C++ side); a panic becomes status 1 and its message in `msg` (at most `msg.1` bytes
/// with the terminating zero), so that nothing unwinds into C++.
pub(super) unsafe fn guarded_pass(
    outs: &[*mut *mut c_void],
    msg: (*mut c_char, usize),
    pass: impl FnOnce() -> Vec<Tensor>,
) -> c_int {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(pass)) {
        Ok(tensors) if tensors.len() == outs.len() => {
            for (mut t, &out) in tensors.into_iter().zip(outs) {
                *out = t.as_mut_ptr().cast();
                // the C++ side takes the tensor over (and deletes it)
                std::mem::forget(t);
            }
            0
        }
        Ok(_) => write_message(msg, "a pass returned the wrong number of tensors"),
        Err(panic) => {
            let text = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("a panic");
            write_message(msg, text)
        }
    }
}

/// `text` into the C++ side's message buffer; returns the failure status 1.
unsafe fn write_message((msg, len): (*mut c_char, usize), text: &str) -> c_int {
    if len > 0 && !msg.is_null() {
        let n = text.len().min(len - 1);
        std::ptr::copy_nonoverlapping(text.as_ptr(), msg.cast::<u8>(), n);
        *msg.add(n) = 0;
    }
    1
}

impl FusedKernels {
    /// SwiGLU's product of `gate` and `up` (dense, the same shape and kind: bf16, f16, f32, on
    /// this device): without `grad`, `silu(gate) * up`; with the output's gradient `grad`
    /// (dense, same shape), the gradients of gate and up.
    pub fn swiglu(
        &self,
        gate: &Tensor,
        up: &Tensor,
        grad: Option<&Tensor>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let kind = gate.kind();
        let which = kind_index(kind).ok_or_else(|| anyhow!("fused kernels: swiglu of {kind:?}"))?;
        let mut dense = vec![("gate", gate), ("up", up)];
        dense.extend(grad.map(|g| ("the gradient", g)));
        for (what, t) in dense {
            self.check(what, t, kind)?;
            ensure!(
                t.is_contiguous(),
                "fused kernels: swiglu's {what} is not dense"
            );
            ensure!(
                t.size() == gate.size(),
                "fused kernels: swiglu's {what} {:?}, gate {:?}",
                t.size(),
                gate.size()
            );
        }
        let n = gate.numel() as i64;
        let out = gate.empty_like();
        let d_up = grad.map(|_| gate.empty_like());
        if n == 0 {
            return Ok((out, d_up));
        }
        let threads: i64 = 256;
        // a grid-stride loop over 16-byte vectors (8 bf16 a thread a round): enough blocks to
        // fill the device a few times over, not one per 256 elements (most of those would find
        // nothing to do)
        let per_block = threads * (16 / kind.elt_size_in_bytes() as i64);
        let blocks = ((n + per_block - 1) / per_block)
            .min(i64::from(self.module.multiprocessors().max(1)) * 32);
        let null = std::ptr::null_mut();
        let (mut pg, mut pu, mut po) = (gate.data_ptr(), up.data_ptr(), out.data_ptr());
        let mut pgrad = grad.map_or(null, |g| g.data_ptr());
        let mut pdu = d_up.as_ref().map_or(null, |t| t.data_ptr());
        let mut count = n;
        self.module.launch(
            self.swiglu[which],
            (blocks as u32, 1),
            threads as u32,
            &mut [
                arg(&mut pg),
                arg(&mut pu),
                arg(&mut pgrad),
                arg(&mut po),
                arg(&mut pdu),
                arg(&mut count),
            ],
        )?;
        Ok((out, d_up))
    }
}

/// `silu(gate) * up` as one autograd node (gate, up: [..., I], the same shape): on `kernels`'
/// device their `swiglu` kernel runs both passes; elsewhere (or where it refuses the tensors)
/// libtorch's operations do.
pub fn swiglu_autograd(
    gate: &Tensor,
    up: &Tensor,
    kernels: Option<&FusedKernels>,
) -> Result<Tensor> {
    apply_node("SwiGLU", kernels, |state, len, out| {
        // SAFETY: live tensors (see apply_node)
        unsafe {
            ffi::dflash_swiglu_autograd(
                gate.as_ptr().cast(),
                up.as_ptr().cast(),
                swiglu_callback,
                state,
                len,
                out,
            )
        }
    })
}

/// One pass of the SwiGLU node: forward `[silu(gate) * up]`, backward `[d_gate, d_up]`; the
/// kernel where it takes the tensors, else libtorch's operations (silu, mul, silu_backward:
/// what autograd runs through `gate.silu() * up`).
fn swiglu_pass(
    kernels: Option<&FusedKernels>,
    gate: &Tensor,
    up: &Tensor,
    grad: Option<&Tensor>,
) -> Vec<Tensor> {
    if let Some(k) = kernels.filter(|k| k.device() == gate.device()) {
        let dense = |t: &Tensor| {
            if t.is_contiguous() {
                t.shallow_clone()
            } else {
                t.contiguous()
            }
        };
        let grad = grad.map(dense);
        match k.swiglu(&dense(gate), &dense(up), grad.as_ref()) {
            Ok((out, None)) => return vec![out],
            Ok((d_gate, Some(d_up))) => return vec![d_gate, d_up],
            Err(e) => log::debug!("swiglu kernel refused ({e:#}); libtorch's operations"),
        }
    }
    let silu = gate.silu();
    match grad {
        None => vec![silu * up],
        Some(g) => vec![gate.silu_backward(&(g * up)), g * silu],
    }
}

/// The SwiGLU node's passes (autograd.cpp's `dflash_swiglu_fn`); `grad` null for the forward.
unsafe extern "C" fn swiglu_callback(
    state: *const c_void,
    gate: *const c_void,
    up: *const c_void,
    grad: *const c_void,
    out0: *mut *mut c_void,
    out1: *mut *mut c_void,
    msg: *mut c_char,
    msg_len: usize,
) -> c_int {
    two_input_pass(
        state,
        (gate, up),
        grad,
        (out0, out1),
        (msg, msg_len),
        swiglu_pass,
    )
}

/// Runs one pass of a node of two inputs for the C++ side: the forward where `grad` is null (one
/// tensor, to `outs.0`), else the backward (two, to `outs.0` and `outs.1`). `pass` gets the
/// node's kernels (the bytes of `state`), the inputs and the gradient; see [`guarded_pass`].
pub(super) unsafe fn two_input_pass(
    state: *const c_void,
    inputs: (*const c_void, *const c_void),
    grad: *const c_void,
    outs: (*mut *mut c_void, *mut *mut c_void),
    msg: (*mut c_char, usize),
    pass: impl FnOnce(Option<&FusedKernels>, &Tensor, &Tensor, Option<&Tensor>) -> Vec<Tensor>,
) -> c_int {
    let both = [outs.0, outs.1];
    let outs = if grad.is_null() {
        &both[..1]
    } else {
        &both[..]
    };
    guarded_pass(outs, msg, || {
        // SAFETY: `state` holds the bytes of an Option<FusedKernels> (apply_node); the tensors
        // are live `at::Tensor`s, shallow-copied here.
        let kernels: Option<FusedKernels> = std::ptr::read_unaligned(state.cast());
        let (a, b) = (borrowed(inputs.0), borrowed(inputs.1));
        let grad = (!grad.is_null()).then(|| borrowed(grad));
        pass(kernels.as_ref(), &a, &b, grad.as_ref())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// The rotation of a [B, heads, L, d] view of [B, L, heads, d] rows (as the projections
    /// leave queries and keys), its tables from positions of each row.
    fn inputs(kind: Kind, device: Device) -> (Tensor, Tensor, Tensor) {
        let (b, heads, l, d) = (2, 3, 5, 8);
        let x = Tensor::randn([b, l, heads, d], (kind, device)).transpose(1, 2);
        let positions = Tensor::randint(100, [b, l], (Kind::Int64, device));
        let inv_freq = Tensor::from_slice(&[1.0f32, 0.1, 0.01, 0.001]).to_device(device);
        let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * inv_freq;
        let cos = Tensor::cat(&[freqs.cos(), freqs.cos()], -1)
            .to_kind(kind)
            .unsqueeze(1);
        let sin = Tensor::cat(&[freqs.sin().neg(), freqs.sin()], -1)
            .to_kind(kind)
            .unsqueeze(1);
        (x, cos, sin)
    }

    /// On the CPU (libtorch's operations in the node's passes): the values of rotate_half
    /// exactly, and the gradient autograd takes through it up to a float32 rounding, for a
    /// gradient in another layout than x's.
    #[test]
    fn the_node_computes_rope_and_its_gradient() {
        tch::manual_seed(3);
        let (x, cos, sin) = inputs(Kind::Float, Device::Cpu);
        let x = x.detach().set_requires_grad(true);
        let want = rotate_half(&x, &cos, &sin);
        let got = rotary_autograd(&x, &cos, &sin, None).expect("the node");
        assert!(got.equal(&want));
        // a gradient that is not in x's layout
        let g = Tensor::randn(want.size().as_slice(), (Kind::Float, Device::Cpu));
        let grads = |y: &Tensor| {
            let mut v = Tensor::run_backward(&[(y * &g).sum(Kind::Float)], &[&x], false, false);
            v.pop().expect("a gradient")
        };
        let want_g = grads(&want);
        let got_g = grads(&got);
        // the same products; the node's inverse rotation adds them in one addcmul, where
        // autograd adds a product and a rolled product: a float32 rounding apart
        let diff = (&got_g - &want_g).abs().max().double_value(&[]);
        let scale = want_g.abs().max().double_value(&[]);
        assert!(diff <= 1e-6 * scale, "gradient off by {diff} of {scale}");
        // without grad mode the node is a plain rotation
        let plain = tch::no_grad(|| rotary_autograd(&x, &cos, &sin, None)).expect("no grad");
        assert!(plain.equal(&want) && !plain.requires_grad());
    }

    /// On the CPU (libtorch's operations in the node's passes): SwiGLU's values and the
    /// gradients of gate and up as autograd takes them through `gate.silu() * up`, exactly.
    #[test]
    fn the_swiglu_node_computes_swiglu_and_its_gradients() {
        tch::manual_seed(4);
        let gate =
            (Tensor::randn([3, 5, 16], (Kind::Float, Device::Cpu)) * 3.0).set_requires_grad(true);
        let up = Tensor::randn([3, 5, 16], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let want = gate.silu() * &up;
        let got = swiglu_autograd(&gate, &up, None).expect("the node");
        assert!(got.equal(&want));
        let g = Tensor::randn([3, 5, 16], (Kind::Float, Device::Cpu));
        let grads = |y: &Tensor| {
            Tensor::run_backward(&[(y * &g).sum(Kind::Float)], &[&gate, &up], false, false)
        };
        let (want_g, got_g) = (grads(&want), grads(&got));
        assert!(got_g[0].equal(&want_g[0]), "the gate's gradient");
        assert!(got_g[1].equal(&want_g[1]), "up's gradient");
    }

    /// On a GPU, the nodes on the `rotary` and `swiglu` kernels against libtorch's operations:
    /// values and gradients (for the rotation a gradient in another layout than x's, tables of
    /// one row broadcast over the batch) within a rounding of the storage type, in float32 and
    /// bf16; SwiGLU's almost all bit for bit.
    /// `cargo test --release --lib -- --ignored fused::autograd` on a CUDA device.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn cuda_nodes_equal_libtorchs_operations() {
        let runtime = crate::runtime::TorchRuntime::init();
        assert!(runtime.cuda_devices() >= 1, "this test needs a CUDA device");
        let device = Device::Cuda(0);
        let kernels = crate::runtime::fused_kernels_or_warn(device).expect("the fused kernels");
        tch::manual_seed(5);
        for (kind, tol) in [(Kind::Float, 1e-6), (Kind::BFloat16, 1.0 / 128.0)] {
            // big enough for several blocks, queries of 128 wide
            let x = Tensor::randn([2, 37, 4, 128], (kind, device)).transpose(1, 2);
            let positions = Tensor::arange(37, (Kind::Int64, device)).unsqueeze(0);
            let inv: Vec<f32> = (0..64).map(|i| 10000f32.powf(-(i as f32) / 64.0)).collect();
            let freqs = positions.to_kind(Kind::Float).unsqueeze(-1)
                * Tensor::from_slice(&inv).to_device(device);
            let cos = Tensor::cat(&[freqs.cos(), freqs.cos()], -1)
                .to_kind(kind)
                .unsqueeze(1);
            let sin = Tensor::cat(&[freqs.sin().neg(), freqs.sin()], -1)
                .to_kind(kind)
                .unsqueeze(1);
            let x = x.detach().set_requires_grad(true);
            let want = rotate_half(&x, &cos, &sin);
            let got = rotary_autograd(&x, &cos, &sin, Some(&kernels)).expect("the node");
            let close = |a: &Tensor, b: &Tensor, what: &str| {
                let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
                let diff = (&a - &b).abs().max().double_value(&[]);
                let scale = b.abs().max().double_value(&[]);
                assert!(
                    diff <= tol * scale,
                    "{kind:?} {what}: off by {diff} of {scale}"
                );
            };
            close(&got, &want, "values");
            let g = Tensor::randn(want.size().as_slice(), (kind, device));
            let grad = |y: &Tensor| {
                let loss = (y.to_kind(Kind::Float) * g.to_kind(Kind::Float)).sum(Kind::Float);
                Tensor::run_backward(&[loss], &[&x], false, false)
                    .pop()
                    .expect("a gradient")
            };
            close(&grad(&got), &grad(&want), "gradient");
        }
        // SwiGLU: the kernel rounds where libtorch's silu, mul and silu_backward round
        for (kind, tol) in [(Kind::Float, 1e-6), (Kind::BFloat16, 1.0 / 128.0)] {
            let gate = (Tensor::randn([2, 37, 300], (Kind::Float, device)) * 3.0).to_kind(kind);
            let gate = gate.set_requires_grad(true);
            let up = Tensor::randn([2, 37, 300], (kind, device)).set_requires_grad(true);
            let want = gate.silu() * &up;
            let got = swiglu_autograd(&gate, &up, Some(&kernels)).expect("the node");
            let g = Tensor::randn([2, 37, 300], (kind, device));
            let grads = |y: &Tensor| {
                let loss = (y.to_kind(Kind::Float) * g.to_kind(Kind::Float)).sum(Kind::Float);
                Tensor::run_backward(&[loss], &[&gate, &up], false, false)
            };
            for (what, a, b) in [("values", got.shallow_clone(), want.shallow_clone())]
                .into_iter()
                .chain(
                    ["gate's gradient", "up's gradient"]
                        .into_iter()
                        .zip(grads(&got).into_iter().zip(grads(&want)))
                        .map(|(w, (a, b))| (w, a, b)),
                )
            {
                let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
                let diff = (&a - &b).abs();
                let bound = b.abs() * tol + 1e-6;
                let over = diff.gt_tensor(&bound).sum(Kind::Int64).int64_value(&[]);
                let same = diff.eq(0.0).to_kind(Kind::Float).mean(Kind::Float);
                let same = same.double_value(&[]);
                assert!(
                    over == 0 && same > 0.99,
                    "SwiGLU {kind:?} {what}: {over} off, {same} equal"
                );
            }
        }
    }
}
