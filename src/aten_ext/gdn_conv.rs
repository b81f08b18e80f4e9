//! The causal convolution and SiLU of a Gated DeltaNet layer as one CUDA kernel
//! (`gdn_causal_conv` in gdn_conv.cuh): its sizes, argument and launch.

use std::ffi::c_void;

use anyhow::{bail, ensure, Result};
use tch::Tensor;

use super::super::nvrtc::{arg, kind_index};
use super::GdnKernels;

/// The causal convolution's width, tokens per thread and threads per block
/// (`GDN_CONV_WIDTH`, `GDN_CONV_TOKENS`, `GDN_CONV_THREADS` in the source).
pub const CONV_WIDTH: i64 = 4;
const CONV_TOKENS: i64 = 16;
const CONV_THREADS: u32 = 128;

/// The causal convolution kernel's argument: the kernel's `GdnConvParams`.
#[repr(C)]
pub(super) struct GdnConvParams {
    x: *const c_void,
    weight: *const c_void,
    prev: *const c_void,
    out: *mut c_void,
    next_state: *mut c_void,
    x_stride: [i64; 2],
    steps: i64,
    channels: i64,
}

impl GdnKernels {
    /// A Gated DeltaNet layer's causal convolution of width [`CONV_WIDTH`] and SiLU over `x`
    /// [B, T, C] (the projection's q, k, v columns where they lie: channels dense, other strides
    /// free) with `weight` [C, 1, W] and the conv state `prev` [B, C, W - 1] (the inputs before
    /// token 0; zeros when `None`), all of one storage type. Returns SiLU(conv) [B, T, C] dense
    /// and the next conv state [B, C, W - 1] (the last W - 1 inputs). What libtorch's conv1d
    /// over the concatenated history, then silu, computes, in one pass without the transposed
    /// copies.
    pub fn causal_conv_silu(
        &self,
        x: &Tensor,
        weight: &Tensor,
        prev: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let (Ok((b, t, c)), kind) = (x.size3(), x.kind()) else {
            bail!(
                "causal conv: x {:?} is not [batch, tokens, channels]",
                x.size()
            );
        };
        let window = CONV_WIDTH - 1;
        ensure!(
            weight.size() == [c, 1, CONV_WIDTH],
            "causal conv: the weight is {:?}, not [{c}, 1, {CONV_WIDTH}]",
            weight.size()
        );
        if let Some(s) = prev {
            ensure!(
                s.size() == [b, c, window],
                "causal conv: the conv state is {:?}, not [{b}, {c}, {window}]",
                s.size()
            );
        }
        let Some(which) = kind_index(kind) else {
            bail!("causal conv: no kernel for {kind:?}");
        };
        let device = self.device();
        for (what, t) in [
            ("x", Some(x)),
            ("the weight", Some(weight)),
            ("the conv state", prev),
        ] {
            if let Some(t) = t {
                ensure!(
                    t.kind() == kind && t.device() == device,
                    "causal conv: {what} is {:?} on {:?}, expected {kind:?} on {device:?}",
                    t.kind(),
                    t.device()
                );
            }
        }
        let out = Tensor::empty([b, t, c], (kind, device));
        let next_state = Tensor::empty([b, c, window], (kind, device));
        if b == 0 || c == 0 {
            return Ok((out, next_state));
        }
        let x = if x.stride()[2] == 1 {
            x.shallow_clone()
        } else {
            x.contiguous()
        };
        let (weight, prev) = (weight.contiguous(), prev.map(Tensor::contiguous));
        let mut params = GdnConvParams {
            x: x.data_ptr().cast_const(),
            weight: weight.data_ptr().cast_const(),
            prev: prev
                .as_ref()
                .map_or(std::ptr::null_mut(), Tensor::data_ptr)
                .cast_const(),
            out: out.data_ptr(),
            next_state: next_state.data_ptr(),
            x_stride: [x.stride()[0], x.stride()[1]],
            steps: t,
            channels: c,
        };
        // no tokens: the next state is the last inputs, all from the old state (one tile)
        let tiles = ((t + CONV_TOKENS - 1) / CONV_TOKENS).max(1);
        ensure!(
            b <= 65_535 && tiles <= 65_535,
            "causal conv: {b} batch rows of {t} tokens are more than one launch takes"
        );
        let grid = (
            ((c + CONV_THREADS as i64 - 1) / CONV_THREADS as i64) as u32,
            tiles as u32,
            b as u32,
        );
        self.module.launch_3d(
            self.conv[which],
            grid,
            CONV_THREADS,
            &mut [arg(&mut params)],
        )?;
        Ok((out, next_state))
    }
}
