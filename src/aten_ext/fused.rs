//! Fused kernels (`fused_kernels.cu`): for the drafter's decoding steps the q/k norm, rotary
//! embedding and cache writes of one attention layer as one kernel, and SwiGLU's `silu(gate) *
//! up` as one; for training, the LM head's cross-entropy and its gradient over a chunk of
//! logits as one; for the target's forward its norms ([`norms`]) and SwiGLU's product. A drafter step is ~110 kernels of 1-4 us and costs their number; the loss
//! over a chunk of logits costs the passes over them. libtorch has no
//! fused forms of these, and tch binds no way to add one, so they are compiled at run time with
//! NVRTC (the compiler libtorch's own jiterator uses, which PyTorch's wheels bring) and launched
//! through the CUDA driver on libtorch's current stream, so that they are ordered with its work
//! and captured with it into CUDA graphs.
//!
//! The compiler, the module and the launches are [`super::nvrtc`]'s, shared with
//! [`super::gdn`].

use std::ffi::{c_int, c_void};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Result};
use cudarc::driver::sys as cu;
use tch::{Device, Kind, Tensor};

use super::graph::GraphLibrary;
use super::nvrtc::{arg, function, kind_index, KernelModule};

/// The kernels' source, compiled for the device at run time.
const SOURCE: &str = include_str!("fused_kernels.cu");

/// What loading the kernels for a device takes (see [`FusedKernels::load`]), for work spread over
/// several devices (one load each).
#[derive(Debug, Clone)]
pub struct FusedKernelLoader {
    pub(crate) graphs: GraphLibrary,
    pub(crate) libtorch_dir: Option<PathBuf>,
}

impl FusedKernelLoader {
    /// Compiles and loads the kernels for `device` (see [`FusedKernels::load`]).
    pub fn load(&self, device: Device) -> Result<FusedKernels> {
        FusedKernels::load(self.graphs, self.libtorch_dir.as_deref(), device)
    }

    /// The kernels for `device`; `None` (with a warning saying why) where they cannot load,
    /// libtorch's operations then doing the same work.
    pub fn load_or_warn(&self, device: Device) -> Option<FusedKernels> {
        if !device.is_cuda() {
            return None;
        }
        match self.load(device) {
            Ok(kernels) => Some(kernels),
            Err(e) => {
                log::warn!(
                    "fused kernels unavailable on {device:?}, libtorch's operations instead: {e:#}"
                );
                None
            }
        }
    }
}

/// The most choices per token [`FusedKernels::moe_combine`] takes (the source's
/// `MOE_MAX_TOP_K`).
pub const MOE_MAX_TOP_K: i64 = 32;

/// The fused kernels, loaded for one CUDA device.
#[derive(Clone, Copy)]
pub struct FusedKernels {
    module: KernelModule,
    rotate_write: [cu::CUfunction; 3],
    silu_mul: [cu::CUfunction; 3],
    cross_entropy_grad: [cu::CUfunction; 3],
    scaled_rms_norm: [cu::CUfunction; 3],
    gated_rms_norm: [cu::CUfunction; 3],
    gdn_gates: [cu::CUfunction; 3],
    moe_combine: [cu::CUfunction; 3],
    rotary: [cu::CUfunction; 3],
    swiglu: [cu::CUfunction; 3],
    gated_attention_prep: [cu::CUfunction; 3],
    sigmoid_gate_mul: [cu::CUfunction; 3],
    adamw_step: [cu::CUfunction; 3],
    rms_norm_backward: [cu::CUfunction; 3],
    add_rms_norm: [cu::CUfunction; 3],
    block_attention_fwd: [cu::CUfunction; 3],
    block_attention_bwd: [cu::CUfunction; 3],
    /// The router's top k and the grouping of pairs by expert (float32 and int64 only).
    moe_topk: [cu::CUfunction; 2],
    moe_group_count: cu::CUfunction,
    moe_group_offsets: cu::CUfunction,
    moe_group_place: cu::CUfunction,
}

// SAFETY: the functions of a module loaded in a CUDA context are process-wide driver objects,
// usable from any thread (each launch makes the context current first); the module is never
// unloaded.
unsafe impl Send for FusedKernels {}
unsafe impl Sync for FusedKernels {}

impl std::fmt::Debug for FusedKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FusedKernels(cuda:{})", self.module.index())
    }
}

impl FusedKernels {
    /// Compiles the kernels for CUDA device `device` and loads them into its primary context
    /// (the one libtorch runs in). `graphs`: the library that knows libtorch's current stream.
    pub fn load(graphs: GraphLibrary, libtorch_dir: Option<&Path>, device: Device) -> Result<Self> {
        let Device::Cuda(index) = device else {
            bail!("fused kernels need a CUDA device, not {device:?}");
        };
        type Functions = [cu::CUfunction; 3];
        let (
            module,
            (
                [rotate_write, silu_mul, cross_entropy_grad, scaled_rms_norm, gated_rms_norm, gdn_gates, moe_combine, rotary, swiglu, gated_attention_prep, sigmoid_gate_mul, adamw_step, rms_norm_backward, add_rms_norm, block_attention_fwd, block_attention_bwd],
                [moe_topk_256, moe_topk_1024, moe_group_count, moe_group_offsets, moe_group_place],
            ),
        ) = KernelModule::load(
            graphs,
            libtorch_dir,
            index,
            (SOURCE, "fused_kernels.cu"),
            |module| -> Result<([Functions; 16], [cu::CUfunction; 5])> {
                // SAFETY (both): the module was just loaded in the current context.
                let one = |name: &str| unsafe { function(module, name) };
                let set = |stem: &str| -> Result<Functions> {
                    Ok([
                        one(&format!("{stem}_bf16"))?,
                        one(&format!("{stem}_f16"))?,
                        one(&format!("{stem}_f32"))?,
                    ])
                };
                Ok((
                    [
                        set("rotate_write")?,
                        set("silu_mul")?,
                        set("cross_entropy_grad")?,
                        set("scaled_rms_norm")?,
                        set("gated_rms_norm")?,
                        set("gdn_gates")?,
                        set("moe_combine")?,
                        set("rotary")?,
                        set("swiglu")?,
                        set("gated_attention_prep")?,
                        set("sigmoid_gate_mul")?,
                        set("adamw_step")?,
                        set("rms_norm_backward")?,
                        set("add_rms_norm")?,
                        set("block_attention_fwd")?,
                        set("block_attention_bwd")?,
                    ],
                    [
                        one("moe_topk_256")?,
                        one("moe_topk_1024")?,
                        one("moe_group_count")?,
                        one("moe_group_offsets")?,
                        one("moe_group_place")?,
                    ],
                ))
            },
        )?;
        Ok(FusedKernels {
            module,
            rotate_write,
            silu_mul,
            cross_entropy_grad,
            scaled_rms_norm,
            gated_rms_norm,
            gdn_gates,
            moe_combine,
            rotary,
            swiglu,
            gated_attention_prep,
            sigmoid_gate_mul,
            adamw_step,
            rms_norm_backward,
            add_rms_norm,
            block_attention_fwd,
            block_attention_bwd,
            moe_topk: [moe_topk_256, moe_topk_1024],
            moe_group_count,
            moe_group_offsets,
            moe_group_place,
        })
    }

    /// The CUDA device the kernels were loaded for.
    pub fn device(&self) -> Device {
        self.module.device()
    }

    /// Checks that `t` is a dense tensor of `kind` on this device.
    fn check(&self, what: &str, t: &Tensor, kind: Kind) -> Result<()> {
        ensure!(
            t.device() == self.device(),
            "fused kernels: {what} is on {:?}, the kernels on cuda:{}",
            t.device(),
            self.module.index()
        );
        ensure!(
            t.kind() == kind,
            "fused kernels: {what} is {:?}, expected {kind:?}",
            t.kind()
        );
        ensure!(t.is_contiguous(), "fused kernels: {what} is not dense");
        Ok(())
    }

    /// The q/k norm, rotation and cache writes of an attention layer (or of `layers` layers at
    /// once), after the fused q/k/v projection:
    ///
    /// - `y` [n, layers * (heads + 2 * kv_heads) * d] (any shape of that many elements, dense):
    ///   per token and layer its queries, keys and values;
    /// - `q_norm`, `k_norm` [layers, d] (any shape of that many elements) or `None`: per-head
    ///   RMS norms of queries and keys (normalised, then times the weight, each rounded);
    /// - `cos`, `sin` [n, d]: the rotary angles of the tokens' positions (sin with its first
    ///   half negated, as [`crate::model::layers::Rope::cos_sin`] makes them);
    /// - `rows` [n] (int64): the cache row of each token; keys and values are written there, in
    ///   `k_cache`, `v_cache` [rows, kv_heads, d] (one layer) or [layers, rows, kv_heads, d].
    ///
    /// Returns the rotated queries [n, layers, heads, d] (`None` when `heads` is 0). The rows
    /// must lie inside the caches (the caller's batch guarantees it).
    #[allow(clippy::too_many_arguments)]
    pub fn rotate_write(
        &self,
        y: &Tensor,
        layers: i64,
        heads: i64,
        q_norm: Option<&Tensor>,
        k_norm: Option<&Tensor>,
        eps: f64,
        cos: &Tensor,
        sin: &Tensor,
        rows: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
    ) -> Result<Option<Tensor>> {
        let kind = y.kind();
        let Some(which) = kind_index(kind) else {
            bail!("fused kernels: no kernel for {kind:?}");
        };
        let (kv, d) = match k_cache.size()[..] {
            [.., kv, d] => (kv, d),
            _ => bail!("fused kernels: a key cache of shape {:?}", k_cache.size()),
        };
        let n = rows.numel() as i64;
        ensure!(
            d % 2 == 0 && d / 2 <= 1024 && kv > 0 && layers > 0 && heads >= 0,
            "fused kernels: head size {d}, {kv} kv heads, {layers} layers, {heads} heads"
        );
        self.check("y", y, kind)?;
        ensure!(
            y.numel() as i64 == n * layers * (heads + 2 * kv) * d,
            "fused kernels: y has {} elements, not {n} x {layers} x {} x {d}",
            y.numel(),
            heads + 2 * kv
        );
        for (what, t) in [("cos", cos), ("sin", sin)] {
            self.check(what, t, kind)?;
            ensure!(
                t.size() == [n, d],
                "fused kernels: {what} of shape {:?}, not [{n}, {d}]",
                t.size()
            );
        }
        for (what, t) in [("q_norm", q_norm), ("k_norm", k_norm)] {
            if let Some(t) = t {
                self.check(what, t, kind)?;
                ensure!(
                    t.numel() as i64 == layers * d,
                    "fused kernels: {what} has {} elements, not {layers} x {d}",
                    t.numel()
                );
            }
        }
        self.check("rows", rows, Kind::Int64)?;
        let layer_stride = match k_cache.size()[..] {
            [r, _, _] if layers == 1 => r * kv * d,
            [l, r, _, _] if l == layers => r * kv * d,
            _ => bail!(
                "fused kernels: a key cache of shape {:?} for {layers} layer(s)",
                k_cache.size()
            ),
        };
        for (what, t) in [("k_cache", k_cache), ("v_cache", v_cache)] {
            self.check(what, t, kind)?;
        }
        ensure!(
            v_cache.size() == k_cache.size(),
            "fused kernels: value cache {:?}, key cache {:?}",
            v_cache.size(),
            k_cache.size()
        );
        let q_out = (heads > 0).then(|| Tensor::empty([n, layers, heads, d], (kind, y.device())));
        if n == 0 {
            return Ok(q_out);
        }
        let ptr = |t: Option<&Tensor>| t.map_or(std::ptr::null_mut(), Tensor::data_ptr);
        let mut args = RotateWriteArgs {
            y: y.data_ptr(),
            layers: layers as c_int,
            heads: heads as c_int,
            kv: kv as c_int,
            d: d as c_int,
            q_norm: ptr(q_norm),
            k_norm: ptr(k_norm),
            eps: eps as f32,
            cos: cos.data_ptr(),
            sin: sin.data_ptr(),
            rows: rows.data_ptr(),
            q_out: ptr(q_out.as_ref()),
            k_cache: k_cache.data_ptr(),
            v_cache: v_cache.data_ptr(),
            layer_stride,
        };
        let (grid, block) = rotate_write_launch(n, layers * (heads + 2 * kv), d);
        self.module
            .launch(self.rotate_write[which], grid, block, &mut args.pointers())?;
        Ok(q_out)
    }

    /// SwiGLU's `silu(gate) * up` of `both` [..., 2 * width] ([gate | up] in the last
    /// dimension, dense): [..., width].
    pub fn silu_mul(&self, both: &Tensor) -> Result<Tensor> {
        let kind = both.kind();
        let Some(which) = kind_index(kind) else {
            bail!("fused kernels: no kernel for {kind:?}");
        };
        self.check("the gate and up product", both, kind)?;
        let mut shape = both.size();
        let last = shape.last_mut().filter(|w| **w % 2 == 0 && **w > 0);
        let Some(last) = last else {
            bail!(
                "fused kernels: a gate and up product of shape {:?}",
                both.size()
            );
        };
        *last /= 2;
        let width = *last;
        let out = Tensor::empty(shape.as_slice(), (kind, both.device()));
        let n = out.numel() as i64 / width;
        if n == 0 {
            return Ok(out);
        }
        let (mut both_ptr, mut out_ptr, mut rows, mut w) =
            (both.data_ptr(), out.data_ptr(), n, width);
        let mut params = [
            arg(&mut both_ptr),
            arg(&mut out_ptr),
            arg(&mut rows),
            arg(&mut w),
        ];
        // rows by the grid's y (a stride past 65,535), 256 threads a block over a row's columns
        // (16-byte vectors of them where the width allows)
        let vec = if width % (16 / kind.elt_size_in_bytes() as i64) == 0 {
            16 / kind.elt_size_in_bytes() as i64
        } else {
            1
        };
        let blocks = (width / vec + 255) / 256;
        let grid = (blocks.min(65_535) as u32, n.min(65_535) as u32);
        self.module
            .launch(self.silu_mul[which], grid, 256, &mut params)?;
        Ok(out)
    }

    /// The LM head's training loss over one chunk of `logits` [rows, vocab] (dense): per row the
    /// cross-entropy against `labels` [rows] (int64; a label outside the vocabulary is ignored:
    /// loss and gradient 0), as float32 [rows], and whether the first argmax is the label (1.0
    /// or 0.0) [rows]; `logits` is overwritten with the gradient of `sum(scale * loss)`
    /// (`scale` [rows] float32), rounded to its type. Computes what `log_softmax(dtype =
    /// float32)`, `nll_loss`, `argmax` and their backward pass compute, up to the order of the
    /// float sums, in two passes over each row instead of some seven kernels over the chunk.
    pub fn cross_entropy_grad(
        &self,
        logits: &Tensor,
        labels: &Tensor,
        scale: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let kind = logits.kind();
        let Some(which) = kind_index(kind) else {
            bail!("fused kernels: no kernel for {kind:?}");
        };
        self.check("the logits", logits, kind)?;
        let (rows, vocab) = match logits.size()[..] {
            [r, v] if v > 0 => (r, v),
            _ => bail!("fused kernels: logits of shape {:?}", logits.size()),
        };
        self.check("the labels", labels, Kind::Int64)?;
        self.check("the scales", scale, Kind::Float)?;
        ensure!(
            labels.size() == [rows] && scale.size() == [rows],
            "fused kernels: {rows} rows of logits, labels {:?}, scales {:?}",
            labels.size(),
            scale.size()
        );
        let loss = Tensor::empty([rows], (Kind::Float, logits.device()));
        let correct = Tensor::empty([rows], (Kind::Float, logits.device()));
        if rows == 0 {
            return Ok((loss, correct));
        }
        ensure!(
            rows <= i64::from(i32::MAX),
            "fused kernels: {rows} rows in one launch"
        );
        let (mut x, mut v, mut lab, mut sc, mut lo, mut co) = (
            logits.data_ptr(),
            vocab,
            labels.data_ptr(),
            scale.data_ptr(),
            loss.data_ptr(),
            correct.data_ptr(),
        );
        let mut params = [
            arg(&mut x),
            arg(&mut v),
            arg(&mut lab),
            arg(&mut sc),
            arg(&mut lo),
            arg(&mut co),
        ];
        self.module.launch(
            self.cross_entropy_grad[which],
            (rows as u32, 1),
            512,
            &mut params,
        )?;
        Ok((loss, correct))
    }
}

/// The launch of `rotate_write_*` over `n` tokens of `slots` (layer, head) pairs of head size
/// `d`, as the kernel reads it (its `rotate_write_warps`): where d / 2 is a multiple of 32 up to
/// 256, a warp per pair and four a block; else a block per pair of d / 2 threads rounded up to
/// a warp. Returns the grid and the threads per block.
fn rotate_write_launch(n: i64, slots: i64, d: i64) -> ((u32, u32), u32) {
    let half = d / 2;
    if half % 32 == 0 && half <= 256 {
        const WARPS: i64 = 4;
        (
            (n as u32, ((slots + WARPS - 1) / WARPS) as u32),
            (WARPS * 32) as u32,
        )
    } else {
        ((n as u32, slots as u32), ((half + 31) / 32 * 32) as u32)
    }
}

/// The arguments of `rotate_write_*`, in the kernel's order and C types.
struct RotateWriteArgs {
    y: *mut c_void,
    layers: c_int,
    heads: c_int,
    kv: c_int,
    d: c_int,
    q_norm: *mut c_void,
    k_norm: *mut c_void,
    eps: f32,
    cos: *mut c_void,
    sin: *mut c_void,
    rows: *mut c_void,
    q_out: *mut c_void,
    k_cache: *mut c_void,
    v_cache: *mut c_void,
    layer_stride: i64,
}

impl RotateWriteArgs {
    /// Pointers to each argument, for `cuLaunchKernel` (valid while `self` is).
    fn pointers(&mut self) -> [*mut c_void; 15] {
        [
            arg(&mut self.y),
            arg(&mut self.layers),
            arg(&mut self.heads),
            arg(&mut self.kv),
            arg(&mut self.d),
            arg(&mut self.q_norm),
            arg(&mut self.k_norm),
            arg(&mut self.eps),
            arg(&mut self.cos),
            arg(&mut self.sin),
            arg(&mut self.rows),
            arg(&mut self.q_out),
            arg(&mut self.k_cache),
            arg(&mut self.v_cache),
            arg(&mut self.layer_stride),
        ]
    }
}

#[path = "fused_norms.rs"]
mod norms;

#[path = "fused_moe.rs"]
mod moe;

#[path = "fused_attention.rs"]
mod attention;

#[path = "fused_adamw.rs"]
mod adamw;
#[path = "fused_autograd.rs"]
mod autograd;
#[path = "fused_block_attention.rs"]
mod block_attention;
#[path = "fused_rms_norm.rs"]
mod rms_norm;
pub use adamw::{AdamWSlices, AdamWStepRates};
pub use attention::GatedHeads;
pub use autograd::{rotary_autograd, rotate_half, swiglu_autograd};
pub use block_attention::{
    block_attention_takes, grouped_block_attention_autograd, BlockGroup, BLOCK_ATTENTION_MAX_BLOCK,
};
pub use moe::{MoeGroups, MOE_MAX_EXPERTS};
pub use rms_norm::{add_rms_norm_autograd, rms_norm_autograd};

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels' source compiles for a Hopper GPU, every kernel the loader looks up is in the
    /// PTX, and a source that does not compile is reported with the compiler's log: what a GPU
    /// machine does first, checked where there is none.
    #[test]
    fn the_kernel_source_compiles_and_a_broken_one_is_reported() {
        let Some(nvrtc) = super::super::nvrtc::nvrtc_for_tests() else {
            return;
        };
        let ptx = nvrtc.compile_named(SOURCE, "fused_kernels.cu", 90).unwrap();
        let text = ptx.to_str().unwrap();
        for stem in [
            "rotate_write",
            "silu_mul",
            "cross_entropy_grad",
            "scaled_rms_norm",
            "gated_rms_norm",
            "gdn_gates",
            "moe_combine",
            "rotary",
            "swiglu",
            "gated_attention_prep",
            "sigmoid_gate_mul",
            "adamw_step",
            "rms_norm_backward",
            "add_rms_norm",
            "block_attention_fwd",
            "block_attention_bwd",
        ] {
            for kind in ["bf16", "f16", "f32"] {
                let entry = format!(".entry {stem}_{kind}(");
                assert!(text.contains(&entry), "no {entry} in the PTX");
            }
        }
        for entry in [
            "moe_topk_256",
            "moe_topk_1024",
            "moe_group_count",
            "moe_group_offsets",
            "moe_group_place",
        ] {
            assert!(
                text.contains(&format!(".entry {entry}(")),
                "no {entry} in the PTX"
            );
        }
        // the block attention's tensor-core form: mma.sync m16n8k16 of bf16 and of f16 from
        // compute capability 8.0 on; for a Turing GPU the source compiles without it (the form
        // is not chosen there, fused_block_attention.rs)
        for ty in ["bf16.bf16", "f16.f16"] {
            let mma = format!("mma.sync.aligned.m16n8k16.row.col.f32.{ty}.f32");
            assert!(text.contains(&mma), "no {mma} in the PTX");
        }
        let turing = nvrtc.compile_named(SOURCE, "fused_kernels.cu", 75).unwrap();
        assert!(!turing.to_str().unwrap().contains("m16n8k16"));
        // what their launches pass (fused_moe.rs): moe_combine six pointers, the 64-bit width,
        // k, whether to read 16-byte vectors and whether to add into the output (32-bit each)
        let ptr = std::mem::size_of::<*mut std::ffi::c_void>();
        for kind in ["bf16", "f16", "f32"] {
            assert_eq!(
                super::norms::tests::param_sizes(text, &format!("moe_combine_{kind}")),
                [ptr, ptr, ptr, ptr, ptr, ptr, 8, 4, 4, 4]
            );
        }
        let sizes = |name: &str| super::norms::tests::param_sizes(text, name);
        // gdn_gates (fused_norms.rs): a, b, the 64-bit row stride, heads, the 64-bit rows, then
        // dt_bias, neg_a, g and beta
        for kind in ["bf16", "f16", "f32"] {
            assert_eq!(
                sizes(&format!("gdn_gates_{kind}")),
                [ptr, ptr, 8, 4, 8, ptr, ptr, ptr, ptr]
            );
        }
        // rotary (fused_autograd.rs): x, cos, sin, out, the 64-bit rows, heads, d, inverse, vec
        for kind in ["bf16", "f16", "f32"] {
            assert_eq!(
                sizes(&format!("rotary_{kind}")),
                [ptr, ptr, ptr, ptr, 8, 4, 4, 4, 4]
            );
        }
        // swiglu (fused_autograd.rs): gate, up, grad, out, d_up, the 64-bit count
        for kind in ["bf16", "f16", "f32"] {
            assert_eq!(
                sizes(&format!("swiglu_{kind}")),
                [ptr, ptr, ptr, ptr, ptr, 8]
            );
        }
        // adamw_step (fused_adamw.rs): grad, param, master, exp_avg, exp_avg_sq, the 64-bit
        // count, the gradient scale, then the rates by value (six float32)
        for kind in ["bf16", "f16", "f32"] {
            assert_eq!(
                sizes(&format!("adamw_step_{kind}")),
                [ptr, ptr, ptr, ptr, ptr, 8, ptr, 24]
            );
        }
        // rms_norm_backward (fused_rms_norm.rs): x, weight, grad, the residual's gradient, dx,
        // the partial sums, the 64-bit rows, width, eps, row_threads; add_rms_norm: h, a, the
        // scale, s, y, the 64-bit rows, width, eps, row_threads
        for kind in ["bf16", "f16", "f32"] {
            assert_eq!(
                sizes(&format!("rms_norm_backward_{kind}")),
                [ptr, ptr, ptr, ptr, ptr, ptr, 8, 4, 4, 4]
            );
            assert_eq!(
                sizes(&format!("add_rms_norm_{kind}")),
                [ptr, ptr, ptr, ptr, ptr, 8, 4, 4, 4]
            );
        }
        // block_attention_fwd / _bwd (fused_block_attention.rs): eight / ten pointers, then
        // heads, kv, d, bs, rows (32-bit each), the scale and the lanes a row
        for kind in ["bf16", "f16", "f32"] {
            let mut fwd = vec![ptr; 8];
            fwd.extend([4, 4, 4, 4, 4, 4, 4]);
            assert_eq!(sizes(&format!("block_attention_fwd_{kind}")), fwd);
            let mut bwd = vec![ptr; 10];
            bwd.extend([4, 4, 4, 4, 4, 4, 4]);
            assert_eq!(sizes(&format!("block_attention_bwd_{kind}")), bwd);
        }
        // moe_topk: then whether to normalise, the weights' kind (32-bit each) and the weights
        assert_eq!(sizes("moe_topk_256"), [ptr, 8, 4, 4, ptr, ptr, 4, 4, ptr]);
        assert_eq!(sizes("moe_topk_1024"), [ptr, 8, 4, 4, ptr, ptr, 4, 4, ptr]);
        assert_eq!(sizes("moe_group_count"), [ptr, 8, 4, 4, ptr]);
        assert_eq!(sizes("moe_group_offsets"), [ptr, 8, 4, ptr]);
        assert_eq!(sizes("moe_group_place"), [ptr, 8, 4, 4, ptr, ptr, ptr]);
        let err = nvrtc
            .compile_named(
                "extern \"C\" __global__ void broken(int x) { y = x; }",
                "fused_kernels.cu",
                90,
            )
            .unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("compute_90") && msg.contains("\"y\""), "{msg}");
    }
}
