//! libtorch operations that tch 0.24 does not bind, through a small C++ shim (ops.cpp, compiled
//! by build.rs against the libtorch headers): the fused AdamW step (used by
//! [`crate::train::optim`]), the flash attention kernel called directly (also in its
//! variable-length form over a key/value cache), and dropping a gradient; libtorch's profiler
//! ([`ProfilerTrace`], profiler.cpp); CUDA graphs ([`graph`], a second library loaded once
//! CUDA is there); the drafter's fused decoding kernels ([`fused`], compiled at run time); and
//! the gated delta rule of Gated DeltaNet layers ([`gdn`], compiled at run time), both compiled
//! and loaded through [`nvrtc`].

pub mod fused;
pub mod gdn;
pub(crate) mod graph;
mod linear;
mod nvrtc;
pub(crate) mod streams;

pub use linear::shared_input_linear;

use std::ffi::{c_char, c_void};

use anyhow::{anyhow, bail, Result};
use tch::{Device, Kind, Tensor};

pub(crate) mod ffi {
    use std::ffi::{c_char, c_void};

    /// autograd.cpp's `dflash_rotate_fn`: (state, x, cos, sin, inverse, out, msg, msg_len).
    pub(crate) type RotatePass = unsafe extern "C" fn(
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        i32,
        *mut *mut c_void,
        *mut c_char,
        usize,
    ) -> i32;

    /// autograd.cpp's `dflash_swiglu_fn`: (state, gate, up, grad or null, out0, out1, msg,
    /// msg_len).
    pub(crate) type SwiGluPass = unsafe extern "C" fn(
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        *mut *mut c_void,
        *mut *mut c_void,
        *mut c_char,
        usize,
    ) -> i32;

    /// autograd.cpp's `dflash_rms_norm_fn`: (state, x, weight, grad or null, eps, out0, out1,
    /// msg, msg_len).
    pub(crate) type RmsNormPass = unsafe extern "C" fn(
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        f64,
        *mut *mut c_void,
        *mut *mut c_void,
        *mut c_char,
        usize,
    ) -> i32;
    /// autograd.cpp's `dflash_block_attention_fn`: (state, q, kb, vb, anchors, o, lse, dout or
    /// null, dq or null, out0, out1, msg, msg_len).
    pub(crate) type BlockAttentionPass = unsafe extern "C" fn(
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
        *mut c_char,
        usize,
    ) -> i32;

    /// autograd.cpp's `dflash_add_rms_norm_fn`: (state, x0, x1 or null, weight, grad or null,
    /// eps, out0, out1, msg, msg_len).
    pub(crate) type AddRmsNormPass = unsafe extern "C" fn(
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        *const c_void,
        f64,
        *mut *mut c_void,
        *mut *mut c_void,
        *mut c_char,
        usize,
    ) -> i32;

    extern "C" {
        // The tensors are `at::Tensor *` (tch's `as_ptr`); `grad_scale` may be null. Each
        // returns null, or an error message to free with `dflash_free_error`.
        pub(crate) fn dflash_fused_adamw(
            param: *const c_void,
            grad: *const c_void,
            exp_avg: *const c_void,
            exp_avg_sq: *const c_void,
            state_step: *const c_void,
            grad_scale: *const c_void,
            lr: f64,
            beta1: f64,
            beta2: f64,
            weight_decay: f64,
            eps: f64,
        ) -> *mut c_char;
        pub(crate) fn dflash_flash_attention(
            query: *const c_void,
            key: *const c_void,
            value: *const c_void,
            is_causal: bool,
            out: *mut *mut c_void,
        ) -> *mut c_char;
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn dflash_flash_varlen(
            query: *const c_void,
            key: *const c_void,
            value: *const c_void,
            cu_q: *const c_void,
            cu_k: *const c_void,
            seqused_k: *const c_void,
            max_q: i64,
            max_k: i64,
            is_causal: bool,
            window_left: i64,
            out: *mut *mut c_void,
        ) -> *mut c_char;
        pub(crate) fn dflash_clear_grad(tensor: *const c_void) -> *mut c_char;
        pub(crate) fn dflash_profiler_start(cuda: i32) -> *mut c_char;
        pub(crate) fn dflash_profiler_stop(path: *const c_char) -> *mut c_char;
        pub(crate) fn dflash_profiler_range_begin(name: *const c_char) -> *mut c_void;
        pub(crate) fn dflash_profiler_range_end(range: *mut c_void);
        pub(crate) fn dflash_free_error(err: *mut c_char);
        // autograd.cpp: the rotary embedding as an autograd node whose passes call `rotate`
        // (fused_autograd.rs) with a copy of `state`'s bytes
        pub(crate) fn dflash_rotary_autograd(
            x: *const c_void,
            cos: *const c_void,
            sin: *const c_void,
            rotate: RotatePass,
            state: *const c_void,
            state_len: usize,
            out: *mut *mut c_void,
        ) -> *mut c_char;
        // autograd.cpp: SwiGLU's product as an autograd node whose passes call `swiglu`
        pub(crate) fn dflash_swiglu_autograd(
            gate: *const c_void,
            up: *const c_void,
            swiglu: SwiGluPass,
            state: *const c_void,
            state_len: usize,
            out: *mut *mut c_void,
        ) -> *mut c_char;
        // autograd.cpp: a residual sum and its RMSNorm as an autograd node whose passes call
        // `add_rms_norm`; the sum to `out[0]`, the norm's output to `out[1]`
        pub(crate) fn dflash_add_rms_norm_autograd(
            h: *const c_void,
            a: *const c_void,
            weight: *const c_void,
            eps: f64,
            add_rms_norm: AddRmsNormPass,
            state: *const c_void,
            state_len: usize,
            out: *mut *mut c_void,
        ) -> *mut c_char;
        // autograd.cpp: the products of one input with `n` weights as one autograd node,
        // into `out[0..n]`
        pub(crate) fn dflash_shared_input_linear(
            x: *const c_void,
            weights: *const *const c_void,
            n: usize,
            out: *mut *mut c_void,
        ) -> *mut c_char;
        // autograd.cpp: RMSNorm as an autograd node whose passes call `rms_norm`
        pub(crate) fn dflash_rms_norm_autograd(
            x: *const c_void,
            weight: *const c_void,
            eps: f64,
            rms_norm: RmsNormPass,
            state: *const c_void,
            state_len: usize,
            out: *mut *mut c_void,
        ) -> *mut c_char;
        // autograd.cpp: one layer of the drafter's block attention in groups of consecutive
        // blocks as an autograd node (`n` groups: `biases` their masks, `groups` their
        // (sequence, first row, rows) triples)
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn dflash_grouped_block_attention_autograd(
            q: *const c_void,
            ck: *const c_void,
            cv: *const c_void,
            kb: *const c_void,
            vb: *const c_void,
            anchors: *const c_void,
            biases: *const *const c_void,
            groups: *const i64,
            n: usize,
            bs: i64,
            pass: BlockAttentionPass,
            state: *const c_void,
            state_len: usize,
            out: *mut *mut c_void,
        ) -> *mut c_char;
    }
}

/// The shim's result: `Ok` for null, else the message (freed here).
///
/// # Safety
/// `err` is null or a message the shim returned and nobody freed yet.
pub(crate) unsafe fn check(err: *mut c_char) -> Result<()> {
    if err.is_null() {
        return Ok(());
    }
    let msg = std::ffi::CStr::from_ptr(err).to_string_lossy().into_owned();
    ffi::dflash_free_error(err);
    Err(anyhow!(msg))
}

/// The tensors of one fused AdamW step, updated in place: weights, gradient (written back
/// divided by `grad_scale` when one is given), moments; `state_step` holds the step count `t`
/// after this step and `grad_scale` divides the gradient (each one Float element on the
/// weights' device).
pub(crate) struct AdamWTensors<'a> {
    pub param: &'a Tensor,
    pub grad: &'a Tensor,
    pub exp_avg: &'a Tensor,
    pub exp_avg_sq: &'a Tensor,
    pub state_step: &'a Tensor,
    pub grad_scale: Option<&'a Tensor>,
}

/// Learning rate and hyper-parameters of one fused AdamW step.
pub(crate) struct AdamWRates {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

/// The fused AdamW step as libtorch runs it (`_fused_adamw_`; decoupled weight decay, no
/// amsgrad): `g = grad / grad_scale`, `param *= 1 - lr * weight_decay`,
/// `m = lerp(m, g, 1 - beta1)`, `v = beta2 v + (1 - beta2) g^2`,
/// `param -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)`. Every tensor is
/// checked first (defined, fp32, contiguous, one device, matching sizes; `state_step` and
/// `grad_scale` one element), so a mismatch is an error, never an out-of-bounds access.
pub(crate) fn fused_adamw(t: &AdamWTensors, rates: &AdamWRates) -> Result<()> {
    let device = t.param.device();
    let size = t.param.size();
    let named = [
        ("weights", t.param),
        ("gradient", t.grad),
        ("first moment", t.exp_avg),
        ("second moment", t.exp_avg_sq),
    ];
    for (what, x) in named {
        if !x.defined() {
            bail!("fused AdamW: the {what} tensor is undefined");
        }
        if x.kind() != Kind::Float || x.device() != device || x.size() != size {
            bail!(
                "fused AdamW: the {what} tensor is {:?} {:?} on {:?}; expected Float {size:?} on {device:?}",
                x.kind(),
                x.size(),
                x.device()
            );
        }
        if !x.is_contiguous() {
            bail!("fused AdamW: the {what} tensor is not contiguous");
        }
    }
    for (what, x) in [
        ("step count", Some(t.state_step)),
        ("gradient scale", t.grad_scale),
    ] {
        let Some(x) = x else { continue };
        if !x.defined() || x.kind() != Kind::Float || x.device() != device || x.numel() != 1 {
            bail!(
                "fused AdamW: the {what} must be one Float element on {device:?}, not {:?}",
                if x.defined() {
                    format!("{:?} {:?} on {:?}", x.kind(), x.size(), x.device())
                } else {
                    "undefined".to_string()
                }
            );
        }
    }
    // SAFETY: all tensors checked above: one device, one dtype, same sizes, dense.
    unsafe { fused_adamw_unchecked(t, rates) }
}

/// [`fused_adamw`] without the checks.
///
/// # Safety
/// The tensors must be defined, and the weights, gradient and moments contiguous with one
/// number of elements (the kernel indexes them all by the weights'); libtorch itself rejects
/// (with an error) mixed devices or dtypes.
pub(crate) unsafe fn fused_adamw_unchecked(t: &AdamWTensors, r: &AdamWRates) -> Result<()> {
    let err = ffi::dflash_fused_adamw(
        t.param.as_ptr().cast(),
        t.grad.as_ptr().cast(),
        t.exp_avg.as_ptr().cast(),
        t.exp_avg_sq.as_ptr().cast(),
        t.state_step.as_ptr().cast(),
        t.grad_scale.map_or(std::ptr::null(), |g| g.as_ptr().cast()),
        r.lr,
        r.beta1,
        r.beta2,
        r.weight_decay,
        r.eps,
    );
    check(err).map_err(|e| anyhow!("fused AdamW (at::_fused_adamw_): {e}"))
}

/// Drops the gradient of `t` (`t.grad()` becomes undefined), as PyTorch's
/// `zero_grad(set_to_none=True)`: the next backward pass stores its gradient instead of
/// adding it to zeros that something had to write first. Should the shim refuse, the gradient
/// is zeroed instead (the same for the next backward pass, one pass more).
pub(crate) fn clear_grad(t: &Tensor) {
    // SAFETY: a live tensor.
    if unsafe { check(ffi::dflash_clear_grad(t.as_ptr().cast())) }.is_err() {
        let mut g = t.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
}

/// Whether [`flash_attention`] can take these inputs: GPU tensors of bf16 or f16, a head size
/// that is a multiple of 8 up to 256, key/value heads dividing the query heads.
pub(crate) fn flash_eligible(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let on_gpu = |t: &Tensor| matches!(t.device(), Device::Cuda(_));
    let half = |t: &Tensor| matches!(t.kind(), Kind::BFloat16 | Kind::Half);
    let (Ok((_, heads, _, d)), Ok((_, kv_heads, _, _))) = (q.size4(), k.size4()) else {
        return false;
    };
    on_gpu(q)
        && [q, k, v].iter().all(|t| half(t) && t.kind() == q.kind())
        && d % 8 == 0
        && d <= 256
        && kv_heads > 0
        && heads % kv_heads == 0
}

/// Flash attention (libtorch's `_scaled_dot_product_flash_attention`) of `q` [B, heads, L, D]
/// over `k`, `v` [B, kv_heads, S, D], no mask, scale 1/sqrt(D); grouped-query heads natively.
/// `scaled_dot_product_attention` would pick cuDNN's kernel on Hopper GPUs, which builds a
/// plan per shape (tens of milliseconds of host time for every new sequence length); this one
/// plans nothing. Differentiable. An error where the kernel refuses the inputs.
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: three live tensors; the shim writes a new tensor into `out` on success only.
    unsafe {
        check(ffi::dflash_flash_attention(
            q.as_ptr().cast(),
            k.as_ptr().cast(),
            v.as_ptr().cast(),
            causal,
            &mut out,
        ))?;
        if out.is_null() {
            return Err(anyhow!("flash attention returned no tensor"));
        }
        Ok(Tensor::from_ptr(out.cast()))
    }
}

/// The lengths of a variable-length flash attention call (see [`flash_varlen`]): int32 tensors
/// on the device, so that a captured CUDA graph can be replayed with new values.
pub(crate) struct VarlenLengths<'a> {
    /// [batch + 1]: sequence b's queries are rows `cu_q[b] .. cu_q[b + 1]` of the query.
    pub cu_q: &'a Tensor,
    /// [batch + 1]: sequence b's keys start at row `cu_k[b]` of the key and value (the start of
    /// its cache slot; need not increase with b).
    pub cu_k: &'a Tensor,
    /// [batch]: how many keys sequence b has.
    pub seqused_k: &'a Tensor,
    /// Bounds: the most queries and the most keys of a sequence.
    pub max_q: i64,
    pub max_k: i64,
}

/// Flash attention in its variable-length form (libtorch's `_flash_attention_forward`):
/// `q` [total_q, heads, D] holds the queries of all sequences back to back; `k`, `v`
/// [rows, kv_heads, D] are a key/value cache from which each sequence reads its own rows.
/// With `causal` the mask aligns bottom-right: query i of a sequence with n queries and s keys
/// sees keys up to s - n + i (new tokens see the cache and each other causally); with
/// `window_left` L (and `causal`) only from s - n + i - L on (a sliding window of L + 1). Scale
/// 1/sqrt(D); grouped-query heads natively; bf16 or f16 on a GPU. Nothing is planned per shape,
/// and with the lengths in device tensors the call can be captured in a CUDA graph.
pub(crate) fn flash_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lengths: &VarlenLengths<'_>,
    causal: bool,
    window_left: Option<i64>,
) -> Result<Tensor> {
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: live tensors; the shim writes a new tensor into `out` on success only.
    unsafe {
        check(ffi::dflash_flash_varlen(
            q.as_ptr().cast(),
            k.as_ptr().cast(),
            v.as_ptr().cast(),
            lengths.cu_q.as_ptr().cast(),
            lengths.cu_k.as_ptr().cast(),
            lengths.seqused_k.as_ptr().cast(),
            lengths.max_q,
            lengths.max_k,
            causal,
            window_left.unwrap_or(-1),
            &mut out,
        ))
        .map_err(|e| anyhow!("flash attention (at::_flash_attention_forward): {e}"))?;
        if out.is_null() {
            return Err(anyhow!("flash attention returned no tensor"));
        }
        Ok(Tensor::from_ptr(out.cast()))
    }
}

/// libtorch's profiler (Kineto, what torch.profiler runs on) recording on the calling thread:
/// the operators it runs, with their input shapes, and with `cuda` the CUDA kernels and copies
/// on the device. [`ProfilerTrace::save`] writes the trace
/// as Chrome trace JSON, the file torch.profiler's `export_chrome_trace` writes (Perfetto and
/// chrome://tracing open it; `tools/trace_summary.py` totals it by kernel or operator).
/// Dropped unsaved, it stops and the trace is discarded. One at a time per process.
#[derive(Debug)]
pub struct ProfilerTrace {
    running: bool,
}

impl ProfilerTrace {
    /// Refuses a `--trace` file whose folder does not exist, before any work is done (libtorch
    /// would only log that it cannot write there, once the trace is recorded).
    pub(crate) fn check_path(path: &std::path::Path) -> Result<()> {
        let folder = path.parent().filter(|p| !p.as_os_str().is_empty());
        if folder.is_some_and(|f| !f.is_dir()) {
            bail!("--trace {}: the folder does not exist", path.display());
        }
        Ok(())
    }

    pub fn start(cuda: bool) -> Result<Self> {
        // SAFETY: no pointers; errors come back as messages.
        unsafe { check(ffi::dflash_profiler_start(cuda as i32))? };
        Ok(ProfilerTrace { running: true })
    }

    /// Stops recording and writes the trace to `path`.
    pub fn save(mut self, path: &std::path::Path) -> Result<()> {
        self.running = false;
        let text = path
            .to_str()
            .ok_or_else(|| anyhow!("{}: not a UTF-8 path", path.display()))?;
        let c_path = std::ffi::CString::new(text)
            .map_err(|_| anyhow!("{}: a path with a NUL byte", path.display()))?;
        // (a stale file must not pass for this trace below)
        let _ = std::fs::remove_file(path);
        // SAFETY: `c_path` is a valid NUL-terminated string for the call.
        unsafe { check(ffi::dflash_profiler_stop(c_path.as_ptr())) }
            .map_err(|e| anyhow!("{}: cannot write the profiler trace: {e}", path.display()))?;
        // libtorch reports a file it cannot open only in its log: check that the file is there.
        if !path.is_file() {
            bail!("{}: the profiler trace was not written", path.display());
        }
        Ok(())
    }
}

/// A named range of a profiler trace, open until dropped: what `torch.profiler.record_function`
/// opens (a "user_annotation" enclosing the operators and kernel launches made inside it, so
/// that `tools/trace_summary.py` can total the kernels of each part of a step). Near free
/// while no profiler runs.
pub struct ProfilerRange {
    handle: *mut c_void,
}

impl ProfilerRange {
    pub fn new(name: &'static std::ffi::CStr) -> Self {
        // SAFETY: `name` is NUL-terminated and outlives the range (it is static).
        ProfilerRange {
            handle: unsafe { ffi::dflash_profiler_range_begin(name.as_ptr()) },
        }
    }
}

impl Drop for ProfilerRange {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            // SAFETY: the handle came from `dflash_profiler_range_begin` and is closed once.
            unsafe { ffi::dflash_profiler_range_end(self.handle) };
        }
    }
}

impl Drop for ProfilerTrace {
    fn drop(&mut self) {
        if self.running {
            // SAFETY: a null path drops the trace.
            let _ = unsafe { check(ffi::dflash_profiler_stop(std::ptr::null())) };
        }
    }
}
