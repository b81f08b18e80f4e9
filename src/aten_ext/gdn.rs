//! The gated delta rule of Gated DeltaNet layers (the linear attention of Qwen3.5 / Qwen3.6 /
//! Qwen3-Next; Yang et al., "Gated Delta Networks", 2024; transformers'
//! `torch_recurrent_gated_delta_rule`, FLA's `chunk_gated_delta_rule`) as CUDA kernels compiled
//! at run time by NVRTC (`gdn_kernels.cu`, loaded as [`super::fused`] loads its kernels), and the
//! same rule as a plain libtorch loop over the tokens ([`reference`]), which runs anywhere and
//! which the kernels are tested against.
//!
//! Per value head, with q and k optionally l2-normalised and q scaled by 1/sqrt(K), the state
//! S [K, V] (float32) takes each token t as `S = exp(g_t) S; u = beta_t (v_t - S^T k_t);
//! S = S + k_t u^T; o_t = S^T q_t`. The recurrent kernel keeps each head's state in registers,
//! 8 threads per value column, and walks the tokens (see the .cu file for the layout and the
//! cost): decoding steps, draft verification with the state after every token. A long prefill
//! can take the chunked form instead (gdn_chunked.rs: chunks of 64 tokens, all prepared at
//! once, then one pass over them per block of value columns; in float32, or for bf16 / f16 on
//! tensor cores, gdn_chunked_tc.cuh, the default where it runs). The layer's causal
//! convolution before the rule has its kernel too (gdn_conv.rs). It is a forward pass only (the
//! target model it serves is frozen: no gradient).

use std::ffi::c_void;
use std::path::Path;

use anyhow::{bail, ensure, Result};
use cudarc::driver::sys as cu;
use tch::{Device, Kind, Tensor};

use super::fused::FusedKernelLoader;
use super::graph::GraphLibrary;
use super::nvrtc::{allow_dynamic_shared, arg, function, kind_index, KernelModule};

/// The kernels' source, compiled for the device at run time.
const SOURCE: &str = include_str!("gdn_kernels.cu");

/// The key head sizes there is a kernel for (the state rows each thread holds are a
/// compile-time count).
pub const KEY_DIMS: [i64; 4] = [32, 64, 128, 256];

/// Value columns per block and threads per block (`GDN_COLUMNS`, `GDN_THREADS` in the source).
const COLUMNS: i64 = 16;
const THREADS: u32 = 128;

/// The tensors of one call of the rule: q, k [B, T, Hk, K], v [B, T, Hv, V], g (log decay,
/// <= 0) and beta [B, T, Hv], and the state before the first token [B, Hv, K, V] float32
/// (zeros when `None`).
#[derive(Clone, Copy)]
pub struct GdnInputs<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub g: &'a Tensor,
    pub beta: &'a Tensor,
    pub initial_state: Option<&'a Tensor>,
}

/// The sizes of one call, read from its inputs and checked against each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnShape {
    pub batch: i64,
    pub steps: i64,
    pub key_heads: i64,
    pub value_heads: i64,
    pub key_dim: i64,
    pub value_dim: i64,
}

impl GdnShape {
    /// The shape of the inputs; an error naming the tensor whose shape, type or device
    /// disagrees (q, k, v one of bf16 / f16 / f32; g and beta float32 or v's type; the state
    /// float32).
    pub fn of(x: &GdnInputs<'_>) -> Result<Self> {
        let GdnInputs {
            q,
            k,
            v,
            g,
            beta,
            initial_state,
        } = *x;
        let (Ok((batch, steps, key_heads, key_dim)), Ok((vb, vt, value_heads, value_dim))) =
            (q.size4(), v.size4())
        else {
            bail!(
                "gated delta rule: q {:?} and v {:?} must be [batch, tokens, heads, head size]",
                q.size(),
                v.size()
            );
        };
        let shape = GdnShape {
            batch,
            steps,
            key_heads,
            value_heads,
            key_dim,
            value_dim,
        };
        ensure!(
            k.size() == q.size(),
            "gated delta rule: k {:?} is not the shape of q {:?}",
            k.size(),
            q.size()
        );
        ensure!(
            (vb, vt) == (batch, steps),
            "gated delta rule: v {:?} has not q's batch and tokens {:?}",
            v.size(),
            q.size()
        );
        ensure!(
            key_heads > 0 && value_heads % key_heads == 0 && key_dim > 0 && value_dim > 0,
            "gated delta rule: {value_heads} value heads of {value_dim} over {key_heads} key heads \
             of {key_dim} (the value heads must be a positive multiple of the key heads)"
        );
        for (what, t) in [("g", g), ("beta", beta)] {
            ensure!(
                t.size() == [batch, steps, value_heads],
                "gated delta rule: {what} {:?} is not [{batch}, {steps}, {value_heads}]",
                t.size()
            );
        }
        let kind = v.kind();
        ensure!(
            kind_index(kind).is_some(),
            "gated delta rule: v is {kind:?}, not BFloat16, Half or Float"
        );
        for (what, t) in [("q", q), ("k", k)] {
            ensure!(
                t.kind() == kind,
                "gated delta rule: {what} is {:?}, v {kind:?}",
                t.kind()
            );
        }
        for (what, t) in [("g", g), ("beta", beta)] {
            ensure!(
                t.kind() == Kind::Float || t.kind() == kind,
                "gated delta rule: {what} is {:?}, not Float or v's {kind:?}",
                t.kind()
            );
        }
        if let Some(s) = initial_state {
            // any strides: a view such as one token's slice of the states buffer is copied
            shape.check_state("the initial state", s, &shape.state_size(), false)?;
        }
        let device = q.device();
        for (what, t) in [("k", k), ("v", v), ("g", g), ("beta", beta)] {
            ensure!(
                t.device() == device,
                "gated delta rule: {what} is on {:?}, q on {device:?}",
                t.device()
            );
        }
        if let Some(s) = initial_state.filter(|s| s.device() != device) {
            bail!(
                "gated delta rule: the initial state is on {:?}, q on {device:?}",
                s.device()
            );
        }
        Ok(shape)
    }

    /// [B, Hv, K, V]: one state per batch row and value head.
    pub fn state_size(&self) -> [i64; 4] {
        [self.batch, self.value_heads, self.key_dim, self.value_dim]
    }

    /// [B, T, Hv, K, V]: the state after every token.
    pub fn states_size(&self) -> [i64; 5] {
        [
            self.batch,
            self.steps,
            self.value_heads,
            self.key_dim,
            self.value_dim,
        ]
    }

    /// Checks that `t` is a float32 tensor of `size`, and dense where `dense`.
    fn check_state(&self, what: &str, t: &Tensor, size: &[i64], dense: bool) -> Result<()> {
        ensure!(
            t.size() == size && t.kind() == Kind::Float,
            "gated delta rule: {what} is {:?} {:?}, expected Float {size:?}",
            t.kind(),
            t.size()
        );
        ensure!(
            !dense || t.is_contiguous(),
            "gated delta rule: {what} is not dense"
        );
        Ok(())
    }
}

/// The launch's arguments: the kernel's `GdnParams`, field for field (every field 8 bytes, so
/// there is no padding to disagree on; a test checks the size against the compiled PTX).
#[repr(C)]
struct GdnParams {
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    g: *const c_void,
    beta: *const c_void,
    initial: *const c_void,
    out: *mut c_void,
    final_state: *mut c_void,
    states: *mut c_void,
    q_stride: [i64; 3],
    k_stride: [i64; 3],
    v_stride: [i64; 3],
    steps: i64,
    key_heads: i64,
    value_heads: i64,
    value_dim: i64,
    g_is_f32: i64,
    beta_is_f32: i64,
    l2norm: i64,
}

/// The batch, token and head strides of a [B, T, H, D] tensor whose last dimension is dense,
/// and the tensor itself (a dense copy when its last dimension is not).
fn strided(t: &Tensor) -> (Tensor, [i64; 3]) {
    let t = if t.stride()[3] == 1 || t.size()[3] == 1 {
        t.shallow_clone()
    } else {
        t.contiguous()
    };
    let s = t.stride();
    (t, [s[0], s[1], s[2]])
}

/// The gated delta rule kernels, loaded for one CUDA device.
#[derive(Clone, Copy)]
pub struct GdnKernels {
    module: KernelModule,
    /// [storage type (bf16, f16, f32)][key head size, as in KEY_DIMS]
    recurrent: [[cu::CUfunction; 4]; 3],
    /// The chunked form's kernels, [storage type]
    chunk_prep: [cu::CUfunction; 3],
    chunk_scan: [cu::CUfunction; 3],
    /// The causal convolution and SiLU before the rule, [storage type]
    conv: [cu::CUfunction; 3],
    /// The chunked form on tensor cores (gdn_chunked_tc.cuh), [bf16, f16]
    tc_prep: [cu::CUfunction; 2],
    /// [64 value columns per block, 32][bf16, f16]
    tc_scan: [[cu::CUfunction; 2]; 2],
    /// Whether the device grants the chunked kernels their shared memory (about 103 KB per
    /// block: not every GPU has that).
    chunked: bool,
    /// Whether the device runs the tensor-core form (TF32 mma.sync: compute capability 8.0 or
    /// later) and grants its shared memory (157 KB per wide scan block, 125 KB per narrow one).
    tensor_cores: bool,
    /// Whether the chunked form of bf16 / f16 calls takes the tensor cores where it can (see
    /// [`GdnKernels::with_tensor_cores`]).
    prefer_tensor_cores: bool,
    /// The value columns per block of the tensor-core scan (see [`ScanColumns`]).
    scan_columns: ScanColumns,
    /// Whether [`GdnKernels::forward`] takes the chunked form for long calls, as
    /// [`GdnKernels::with_chunked_prefill`] says; `None`: the defaults
    /// ([`TENSOR_CORE_CHUNKED_BY_DEFAULT`] for calls the tensor-core form takes,
    /// [`CHUNKED_BY_DEFAULT`] for others).
    prefer_chunked: Option<bool>,
}

// SAFETY: as for `FusedKernels`: the functions of a module loaded in a CUDA context are
// process-wide driver objects, usable from any thread; the module is never unloaded.
unsafe impl Send for GdnKernels {}
unsafe impl Sync for GdnKernels {}

impl std::fmt::Debug for GdnKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GdnKernels(cuda:{})", self.module.index())
    }
}

impl FusedKernelLoader {
    /// Compiles and loads the gated delta rule kernels for `device` (see [`GdnKernels::load`]).
    pub fn load_gdn(&self, device: Device) -> Result<GdnKernels> {
        GdnKernels::load(self.graphs, self.libtorch_dir.as_deref(), device)
    }
}

impl GdnKernels {
    /// Compiles the kernels for CUDA device `device` and loads them into its primary context
    /// (the one libtorch runs in). `graphs`: the library that knows libtorch's current stream.
    pub fn load(graphs: GraphLibrary, libtorch_dir: Option<&Path>, device: Device) -> Result<Self> {
        let Device::Cuda(index) = device else {
            bail!("the gated delta rule kernels need a CUDA device, not {device:?}");
        };
        struct Functions {
            recurrent: [[cu::CUfunction; 4]; 3],
            prep: [cu::CUfunction; 3],
            scan: [cu::CUfunction; 3],
            conv: [cu::CUfunction; 3],
            tc_prep: [cu::CUfunction; 2],
            tc_scan: [[cu::CUfunction; 2]; 2],
            chunked: bool,
            tc_granted: bool,
        }
        let (module, f) = KernelModule::load(
            graphs,
            libtorch_dir,
            index,
            (SOURCE, "gdn_kernels.cu"),
            |module| -> Result<Functions> {
                let null = std::ptr::null_mut();
                let mut f = Functions {
                    recurrent: [[null; 4]; 3],
                    prep: [null; 3],
                    scan: [null; 3],
                    conv: [null; 3],
                    tc_prep: [null; 2],
                    tc_scan: [[null; 2]; 2],
                    chunked: true,
                    tc_granted: true,
                };
                for (i, kind) in ["bf16", "f16", "f32"].into_iter().enumerate() {
                    for (fun, dim) in f.recurrent[i].iter_mut().zip(KEY_DIMS) {
                        // SAFETY: the module was just loaded in the current context.
                        *fun = unsafe { function(module, &kernel_name(kind, dim))? };
                    }
                    // SAFETY: as above; the attributes are set in the same context.
                    unsafe {
                        f.conv[i] = function(module, &format!("gdn_causal_conv_{kind}"))?;
                        f.prep[i] = function(module, &format!("gdn_chunk_prep_{kind}"))?;
                        f.scan[i] = function(module, &format!("gdn_chunk_scan_{kind}"))?;
                        f.chunked &= allow_dynamic_shared(f.prep[i], PREP_SHARED_BYTES).is_ok()
                            && allow_dynamic_shared(f.scan[i], SCAN_SHARED_BYTES).is_ok();
                        if i < 2 {
                            f.tc_prep[i] = function(module, &format!("gdn_tc_prep_{kind}"))?;
                            f.tc_scan[0][i] = function(module, &format!("gdn_tc_scan_{kind}"))?;
                            f.tc_scan[1][i] =
                                function(module, &format!("gdn_tc_scan_narrow_{kind}"))?;
                            f.tc_granted &=
                                allow_dynamic_shared(f.tc_prep[i], TC_PREP_SHARED_BYTES).is_ok()
                                    && allow_dynamic_shared(f.tc_scan[0][i], TC_SCAN_SHARED_BYTES)
                                        .is_ok()
                                    && allow_dynamic_shared(
                                        f.tc_scan[1][i],
                                        TC_NARROW_SCAN_SHARED_BYTES,
                                    )
                                    .is_ok();
                        }
                    }
                }
                Ok(f)
            },
        )?;
        Ok(GdnKernels {
            module,
            recurrent: f.recurrent,
            chunk_prep: f.prep,
            chunk_scan: f.scan,
            conv: f.conv,
            tc_prep: f.tc_prep,
            tc_scan: f.tc_scan,
            chunked: f.chunked,
            tensor_cores: f.tc_granted && module.compute_capability() >= TENSOR_CORE_ARCH,
            prefer_tensor_cores: true,
            scan_columns: ScanColumns::Auto,
            prefer_chunked: None,
        })
    }

    /// The CUDA device the kernels were loaded for.
    pub fn device(&self) -> Device {
        self.module.device()
    }

    /// The gated delta rule over `x` (q, k and v bf16, f16 or f32, the last dimension dense,
    /// other strides free, so views split from one projection need no copy; g and beta float32
    /// or v's type). Value head h reads key head h / (Hv / Hk); with `l2norm` q and k are
    /// l2-normalised (in float32) first. Returns the output [B, T, Hv, V] in v's type and the
    /// final state [B, Hv, K, V] float32. Queued on libtorch's current stream (no host
    /// synchronisation; a CUDA graph may capture it). Where [`GdnKernels::takes_chunked`]
    /// (calls of [`CHUNKED_FROM_STEPS`] tokens or more with key heads of [`CHUNKED_KEY_DIM`],
    /// the chunked form preferred and granted its memory) the chunked form runs, otherwise
    /// the recurrent kernel.
    pub fn forward(&self, x: &GdnInputs<'_>, l2norm: bool) -> Result<(Tensor, Tensor)> {
        if self.takes_chunked(x)? {
            match self.forward_chunked(x, l2norm) {
                Ok(done) => return Ok(done),
                // e.g. a launch the GPU refuses: the recurrent kernel computes the same
                Err(e) => log::warn!(
                    "chunked gated delta rule failed, the recurrent kernel instead: {e:#}"
                ),
            }
        }
        self.forward_recurrent(x, l2norm)
    }

    /// Whether [`GdnKernels::forward`] takes the chunked form for the call `x`: one of
    /// [`CHUNKED_FROM_STEPS`] tokens or more with key heads of [`CHUNKED_KEY_DIM`], on a GPU
    /// that grants the form its memory, where [`GdnKernels::with_chunked_prefill`] asks for it
    /// or, by default, where it runs on tensor cores
    /// ([`GdnKernels::chunked_on_tensor_cores`], [`TENSOR_CORE_CHUNKED_BY_DEFAULT`]).
    pub fn takes_chunked(&self, x: &GdnInputs<'_>) -> Result<bool> {
        let shape = self.checked_shape(x)?;
        if !(self.chunked && shape.key_dim == CHUNKED_KEY_DIM && shape.steps >= CHUNKED_FROM_STEPS)
        {
            return Ok(false);
        }
        Ok(match self.prefer_chunked {
            Some(chunked) => chunked,
            None if self.chunked_on_tensor_cores(x)? => TENSOR_CORE_CHUNKED_BY_DEFAULT,
            None => CHUNKED_BY_DEFAULT,
        })
    }

    /// The same kernels with long calls of [`GdnKernels::forward`] taking the chunked form
    /// (`true`) or the recurrent kernel (`false`), whatever the defaults say.
    pub fn with_chunked_prefill(mut self, chunked: bool) -> Self {
        self.prefer_chunked = Some(chunked);
        self
    }

    /// [`GdnKernels::forward`] through the recurrent kernel, whatever the length.
    pub fn forward_recurrent(&self, x: &GdnInputs<'_>, l2norm: bool) -> Result<(Tensor, Tensor)> {
        let shape = self.checked_shape(x)?;
        let final_state = Tensor::empty(shape.state_size(), (Kind::Float, self.device()));
        if shape.steps == 0 {
            let mut copy = final_state.shallow_clone();
            match x.initial_state {
                Some(s) => copy.copy_(s),
                None => {
                    let _ = copy.zero_();
                }
            }
        }
        let out = self.launch(&shape, x, l2norm, Some(&final_state), None)?;
        Ok((out, final_state))
    }

    /// [`GdnKernels::forward`] that writes the state after every token into `states_out`
    /// [B, T, Hv, K, V] (float32, dense), so that a caller verifying a draft can keep the state
    /// at the accepted prefix (the final state is `states_out[:, T - 1]`). Returns the output.
    pub fn forward_with_states(
        &self,
        x: &GdnInputs<'_>,
        l2norm: bool,
        states_out: &Tensor,
    ) -> Result<Tensor> {
        let shape = self.checked_shape(x)?;
        shape.check_state("the states buffer", states_out, &shape.states_size(), true)?;
        ensure!(
            states_out.device() == self.device(),
            "gated delta rule: the states buffer is on {:?}, the kernels on cuda:{}",
            states_out.device(),
            self.module.index()
        );
        self.launch(&shape, x, l2norm, None, Some(states_out))
    }

    /// The inputs' shape, checked, and on this device with a kernel for their sizes.
    fn checked_shape(&self, x: &GdnInputs<'_>) -> Result<GdnShape> {
        let shape = GdnShape::of(x)?;
        ensure!(
            x.q.device() == self.device(),
            "gated delta rule: the inputs are on {:?}, the kernels on cuda:{}",
            x.q.device(),
            self.module.index()
        );
        ensure!(
            KEY_DIMS.contains(&shape.key_dim),
            "gated delta rule: no kernel for a key head size of {} (only {KEY_DIMS:?})",
            shape.key_dim
        );
        ensure!(
            shape.batch * shape.value_heads <= 65_535,
            "gated delta rule: {} batch rows x {} value heads is more than one launch takes \
             (65535)",
            shape.batch,
            shape.value_heads
        );
        Ok(shape)
    }

    /// One launch: the output, and the final state or the states of every token.
    fn launch(
        &self,
        shape: &GdnShape,
        x: &GdnInputs<'_>,
        l2norm: bool,
        final_state: Option<&Tensor>,
        states: Option<&Tensor>,
    ) -> Result<Tensor> {
        let kind = x.v.kind();
        let out = Tensor::empty(
            [shape.batch, shape.steps, shape.value_heads, shape.value_dim],
            (kind, self.device()),
        );
        if shape.steps == 0 || shape.batch == 0 {
            return Ok(out);
        }
        let (mut params, which, _inputs) =
            self.params(shape, x, l2norm, &out, final_state, states)?;
        let Some(dim) = KEY_DIMS.iter().position(|&d| d == shape.key_dim) else {
            bail!(
                "gated delta rule: no kernel for key heads of {}",
                shape.key_dim
            );
        };
        let grid = (
            ((shape.value_dim + COLUMNS - 1) / COLUMNS) as u32,
            (shape.batch * shape.value_heads) as u32,
        );
        self.module.launch(
            self.recurrent[which][dim],
            grid,
            THREADS,
            &mut [arg(&mut params)],
        )?;
        Ok(out)
    }

    /// The kernels' `GdnParams` for a call writing `out` (and the final state or the states of
    /// every token), the storage type's index, and the tensors the pointers point into (dense
    /// copies where the inputs were not: they must live until the launch is queued).
    fn params(
        &self,
        shape: &GdnShape,
        x: &GdnInputs<'_>,
        l2norm: bool,
        out: &Tensor,
        final_state: Option<&Tensor>,
        states: Option<&Tensor>,
    ) -> Result<(GdnParams, usize, Vec<Tensor>)> {
        let kind = x.v.kind();
        let Some(which) = kind_index(kind) else {
            bail!("gated delta rule: no kernel for {kind:?}");
        };
        let (q, q_stride) = strided(x.q);
        let (k, k_stride) = strided(x.k);
        let (v, v_stride) = strided(x.v);
        let (g, beta) = (x.g.contiguous(), x.beta.contiguous());
        let initial = x.initial_state.map(Tensor::contiguous);
        let null = std::ptr::null_mut();
        let params = GdnParams {
            q: q.data_ptr().cast_const(),
            k: k.data_ptr().cast_const(),
            v: v.data_ptr().cast_const(),
            g: g.data_ptr().cast_const(),
            beta: beta.data_ptr().cast_const(),
            initial: initial.as_ref().map_or(null, Tensor::data_ptr).cast_const(),
            out: out.data_ptr(),
            final_state: final_state.map_or(null, Tensor::data_ptr),
            states: states.map_or(null, Tensor::data_ptr),
            q_stride,
            k_stride,
            v_stride,
            steps: shape.steps,
            key_heads: shape.key_heads,
            value_heads: shape.value_heads,
            value_dim: shape.value_dim,
            g_is_f32: (g.kind() == Kind::Float) as i64,
            beta_is_f32: (beta.kind() == Kind::Float) as i64,
            l2norm: l2norm as i64,
        };
        let mut kept = vec![q, k, v, g, beta];
        kept.extend(initial);
        Ok((params, which, kept))
    }
}

/// The name of the kernel for storage type `kind` (bf16, f16, f32) and key heads of `dim`.
fn kernel_name(kind: &str, dim: i64) -> String {
    format!("gdn_recurrent_{kind}_k{dim}")
}

/// The gated delta rule as a loop over the tokens in libtorch float32 operations, the rule as
/// transformers' `torch_recurrent_gated_delta_rule` states it; on any device, same arguments as
/// [`GdnKernels::forward`]. Returns the output [B, T, Hv, V] in v's type and the final state.
pub fn reference(x: &GdnInputs<'_>, l2norm: bool) -> Result<(Tensor, Tensor)> {
    let (out, state, _) = reference_steps(x, l2norm, false)?;
    Ok((out, state))
}

/// [`reference`] that also returns the state after every token [B, T, Hv, K, V] (in place of
/// the final state).
pub fn reference_with_states(x: &GdnInputs<'_>, l2norm: bool) -> Result<(Tensor, Tensor)> {
    let (out, state, states) = reference_steps(x, l2norm, true)?;
    Ok((out, states.unwrap_or(state)))
}

// out-of-place updates on purpose: tch's `*=` and `+=` write in place, and the states kept
// per token and the caller's initial state must not change
#[allow(clippy::assign_op_pattern)]
fn reference_steps(
    x: &GdnInputs<'_>,
    l2norm: bool,
    keep_states: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let shape = GdnShape::of(x)?;
    let GdnInputs {
        q,
        k,
        v,
        g,
        beta,
        initial_state,
    } = *x;
    let kind = v.kind();
    let group = shape.value_heads / shape.key_heads;
    let float = |t: &Tensor| t.to_kind(Kind::Float);
    let l2 = |t: Tensor| {
        if l2norm {
            let norm = (&t * &t).sum_dim_intlist(-1, true, Kind::Float) + 1e-6;
            t * norm.rsqrt()
        } else {
            t
        }
    };
    // [B, T, Hv, K]: value head h reads key head h / group
    let q = l2(float(q).repeat_interleave_self_int(group, 2, None)) / (shape.key_dim as f64).sqrt();
    let k = l2(float(k).repeat_interleave_self_int(group, 2, None));
    let (v, decay, beta) = (float(v), float(g).exp(), float(beta));
    let mut state = match initial_state {
        Some(s) => float(s),
        None => Tensor::zeros(shape.state_size(), (Kind::Float, q.device())),
    };
    let (mut outs, mut states) = (Vec::new(), Vec::new());
    for t in 0..shape.steps {
        let (q_t, k_t, v_t) = (q.select(1, t), k.select(1, t), v.select(1, t));
        state = state * decay.select(1, t).unsqueeze(-1).unsqueeze(-1);
        // S^T k per value column: [B, Hv, V]
        let kv = (&state * k_t.unsqueeze(-1)).sum_dim_intlist(-2, false, Kind::Float);
        let u = (v_t - kv) * beta.select(1, t).unsqueeze(-1);
        state = state + k_t.unsqueeze(-1) * u.unsqueeze(-2);
        outs.push((&state * q_t.unsqueeze(-1)).sum_dim_intlist(-2, false, Kind::Float));
        if keep_states {
            states.push(state.shallow_clone());
        }
    }
    let out = if outs.is_empty() {
        Tensor::zeros(
            [shape.batch, 0, shape.value_heads, shape.value_dim],
            (Kind::Float, q.device()),
        )
    } else {
        Tensor::stack(&outs, 1)
    };
    let states = keep_states.then(|| {
        if states.is_empty() {
            Tensor::zeros(shape.states_size(), (Kind::Float, q.device()))
        } else {
            Tensor::stack(&states, 1)
        }
    });
    Ok((out.to_kind(kind), state, states))
}

#[path = "gdn_chunked.rs"]
mod chunked;
#[path = "gdn_conv.rs"]
mod conv;
#[cfg(test)]
#[path = "gdn_tests.rs"]
mod tests;

pub use chunked::{
    ScanColumns, CHUNKED_BY_DEFAULT, CHUNKED_FROM_STEPS, CHUNKED_KEY_DIM,
    TENSOR_CORE_CHUNKED_BY_DEFAULT,
};
use chunked::{
    PREP_SHARED_BYTES, SCAN_SHARED_BYTES, TC_NARROW_SCAN_SHARED_BYTES, TC_PREP_SHARED_BYTES,
    TC_SCAN_SHARED_BYTES, TENSOR_CORE_ARCH,
};
pub use conv::CONV_WIDTH;
