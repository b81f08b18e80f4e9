//! libtorch operations that tch 0.24 does not bind, through a small C++ shim (ops.cpp, compiled
//! by build.rs against the libtorch headers): the fused AdamW step (used by
//! [`crate::train::optim`]) and the flash attention kernel called directly.

use std::ffi::{c_char, c_void};

use anyhow::{anyhow, Result};
use tch::{Device, Kind, Tensor};

pub(crate) mod ffi {
    use std::ffi::{c_char, c_void};

    extern "C" {
        // The tensors are `at::Tensor *` (tch's `as_ptr`); `grad_scale` may be null. Each
        // returns null, or an error message to free with `dflash_free_error`.
        pub fn dflash_fused_adamw(
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
        pub fn dflash_flash_attention(
            query: *const c_void,
            key: *const c_void,
            value: *const c_void,
            is_causal: bool,
            out: *mut *mut c_void,
        ) -> *mut c_char;
        pub fn dflash_clear_grad(tensor: *const c_void) -> *mut c_char;
        pub fn dflash_free_error(err: *mut c_char);
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

/// Drops the gradient of `t` (`t.grad()` becomes undefined), as PyTorch's
/// `zero_grad(set_to_none=True)`: the next backward pass stores its gradient instead of
/// adding it to zeros that something had to write first.
pub fn clear_grad(t: &Tensor) -> Result<()> {
    // SAFETY: a live tensor.
    unsafe { check(ffi::dflash_clear_grad(t.as_ptr().cast())) }
}

/// Whether [`flash_attention`] can take these inputs: GPU tensors of bf16 or f16, a head size
/// that is a multiple of 8 up to 256, key/value heads dividing the query heads.
pub fn flash_eligible(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
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
