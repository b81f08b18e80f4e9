//! Fused kernels (`fused_kernels.cu`): for the drafter's decoding steps the q/k norm, rotary
//! embedding and cache writes of one attention layer as one kernel, and SwiGLU's `silu(gate) *
//! up` as one; for training, the LM head's cross-entropy and its gradient over a chunk of
//! logits as one. A drafter step is ~110 kernels of 1-4 us and costs their number; the loss
//! over a chunk of logits costs the passes over them. libtorch has no
//! fused forms of these, and tch binds no way to add one, so they are compiled at run time with
//! NVRTC (the compiler libtorch's own jiterator uses, which PyTorch's wheels bring) and launched
//! through the CUDA driver on libtorch's current stream, so that they are ordered with its work
//! and captured with it into CUDA graphs.
//!
//! libnvrtc is loaded here rather than through cudarc's lazy loader, for the reason libnccl is
//! (see [`crate::pipeline::nccl`]): the wheel's `libnvrtc.so.13` sits in
//! `site-packages/nvidia/cu13/lib`, which only libtorch's own rpath names. The driver API and
//! its types come from `cudarc` (feature `driver`, loaded dynamically).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, ensure, Result};
use cudarc::driver::sys as cu;
use tch::{Device, Kind, Tensor};

use super::graph::GraphLibrary;
use crate::runtime::library_symbol;

/// The kernels' source, compiled for the device at run time.
const SOURCE: &str = include_str!("fused_kernels.cu");

/// Environment variable naming the libnvrtc file to load (tried before anything else).
pub(crate) const NVRTC_ENV: &str = "DFLASH_NVRTC_LIBRARY";

// NVRTC's entry points, `nvrtcResult` as a plain integer (0 = success).
type CreateProgram = unsafe extern "C" fn(
    *mut *mut c_void,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileProgram = unsafe extern "C" fn(*mut c_void, c_int, *const *const c_char) -> c_int;
type GetSize = unsafe extern "C" fn(*mut c_void, *mut usize) -> c_int;
type GetText = unsafe extern "C" fn(*mut c_void, *mut c_char) -> c_int;
type DestroyProgram = unsafe extern "C" fn(*mut *mut c_void) -> c_int;

/// Where libnvrtc is looked for: only `$DFLASH_NVRTC_LIBRARY` when set; otherwise a libnvrtc
/// this process already loaded, the wheels' files beside the loaded libtorch (CUDA 13's
/// `nvidia/cu13/lib`, CUDA 12's `nvidia/cuda_nvrtc/lib`), then the usual names through the
/// dynamic loader's search.
fn nvrtc_candidates(libtorch_dir: Option<&Path>) -> Vec<PathBuf> {
    if let Some(p) = std::env::var_os(NVRTC_ENV).filter(|p| !p.is_empty()) {
        return vec![PathBuf::from(p)];
    }
    let mut out: Vec<PathBuf> = crate::runtime::loaded_library(|name| {
        name.starts_with("libnvrtc.so") && !name.contains("builtins")
    })
    .into_iter()
    .collect();
    if let Some(site) = libtorch_dir.and_then(Path::parent).and_then(Path::parent) {
        for wheel in [
            "nvidia/cu13/lib/libnvrtc.so.13",
            "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
        ] {
            let path = site.join(wheel);
            if path.is_file() {
                out.push(path);
            }
        }
    }
    out.extend(
        ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
            .into_iter()
            .map(PathBuf::from),
    );
    out
}

/// A loaded libnvrtc (also used by [`super::gdn`]).
pub(super) struct Nvrtc {
    create: CreateProgram,
    compile: CompileProgram,
    log_size: GetSize,
    log: GetText,
    ptx_size: GetSize,
    ptx: GetText,
    destroy: DestroyProgram,
    _library: libloading::Library,
    /// libnvrtc-builtins from beside the file, loaded first: NVRTC opens it by name when it
    /// compiles, which the dynamic loader does not always find next to a wheel's libnvrtc.
    _builtins: Option<libloading::Library>,
}

impl Nvrtc {
    pub(super) fn load(libtorch_dir: Option<&Path>) -> Result<Self> {
        let mut failures = Vec::new();
        for path in nvrtc_candidates(libtorch_dir) {
            match Self::load_from(&path) {
                Ok(lib) => return Ok(lib),
                Err(e) => failures.push(format!("{}: {e}", path.display())),
            }
        }
        bail!(
            "libnvrtc could not be loaded (tried {}); set {NVRTC_ENV} to the file's path \
             (e.g. <site-packages>/nvidia/cu13/lib/libnvrtc.so.13)",
            failures.join("; ")
        )
    }

    pub(super) fn load_from(path: &Path) -> std::result::Result<Self, String> {
        let builtins = path
            .parent()
            .filter(|dir| !dir.as_os_str().is_empty())
            .and_then(|dir| std::fs::read_dir(dir).ok())
            .into_iter()
            .flatten()
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .find(|p| {
                p.file_name()
                    .and_then(|f| f.to_str())
                    .is_some_and(|f| f.starts_with("libnvrtc-builtins.so"))
            });
        // SAFETY: libnvrtc and its builtins are plain C libraries; each symbol is looked up
        // with the signature nvrtc.h declares for it.
        unsafe {
            let builtins = match builtins {
                Some(b) => Some(
                    libloading::Library::new(&b).map_err(|e| format!("{}: {e}", b.display()))?,
                ),
                None => None,
            };
            let library = libloading::Library::new(path).map_err(|e| e.to_string())?;
            Ok(Nvrtc {
                create: library_symbol(&library, "nvrtcCreateProgram")?,
                compile: library_symbol(&library, "nvrtcCompileProgram")?,
                log_size: library_symbol(&library, "nvrtcGetProgramLogSize")?,
                log: library_symbol(&library, "nvrtcGetProgramLog")?,
                ptx_size: library_symbol(&library, "nvrtcGetPTXSize")?,
                ptx: library_symbol(&library, "nvrtcGetPTX")?,
                destroy: library_symbol(&library, "nvrtcDestroyProgram")?,
                _library: library,
                _builtins: builtins,
            })
        }
    }

    /// PTX of `source` for compute capability `arch` (e.g. 90), or the compiler's log.
    fn compile_ptx(&self, source: &str, arch: i32) -> Result<CString> {
        self.compile_named(source, "fused_kernels.cu", arch)
    }

    /// PTX of `source`, named `file` in the compiler's messages, for compute capability `arch`.
    pub(super) fn compile_named(&self, source: &str, file: &str, arch: i32) -> Result<CString> {
        let src = CString::new(source)?;
        let name = CString::new(file)?;
        let options = [
            CString::new(format!("--gpu-architecture=compute_{arch}"))?,
            CString::new("--std=c++17")?,
        ];
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let mut prog: *mut c_void = std::ptr::null_mut();
        // SAFETY: NVRTC calls on live C strings and a program created here and destroyed below.
        unsafe {
            let code = (self.create)(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            ensure!(code == 0, "nvrtcCreateProgram failed (code {code})");
            let result = (|| {
                let code = (self.compile)(prog, option_ptrs.len() as c_int, option_ptrs.as_ptr());
                if code != 0 {
                    let log = self.text(prog, self.log_size, self.log).unwrap_or_default();
                    bail!(
                        "compiling {file} for compute_{arch} failed (code {code}): {}",
                        log.to_string_lossy().trim()
                    );
                }
                self.text(prog, self.ptx_size, self.ptx)
            })();
            (self.destroy)(&mut prog);
            result
        }
    }

    /// A text NVRTC returns (log or PTX), NUL-terminated.
    unsafe fn text(&self, prog: *mut c_void, size: GetSize, get: GetText) -> Result<CString> {
        let mut len = 0usize;
        ensure!(size(prog, &mut len) == 0, "NVRTC could not size its output");
        let mut buf = vec![0u8; len.max(1)];
        ensure!(
            get(prog, buf.as_mut_ptr().cast()) == 0,
            "NVRTC could not copy its output"
        );
        Ok(CStr::from_bytes_until_nul(&buf)
            .map(CStr::to_owned)
            .unwrap_or_default())
    }
}

pub(super) fn driver(call: &str, code: cu::CUresult) -> Result<()> {
    if code == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut msg: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string, or leaves it null.
    let text = unsafe {
        cu::cuGetErrorString(code, &mut msg);
        if msg.is_null() {
            format!("{code:?}")
        } else {
            CStr::from_ptr(msg).to_string_lossy().into_owned()
        }
    };
    Err(anyhow!("{call}: {text}"))
}

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

/// A pointer to one kernel argument, as `cuLaunchKernel` takes them (valid while `x` is).
pub(super) fn arg<T>(x: &mut T) -> *mut c_void {
    (x as *mut T).cast()
}

/// The storage types the kernels exist for, in the order of the function arrays.
pub(super) fn kind_index(kind: Kind) -> Option<usize> {
    match kind {
        Kind::BFloat16 => Some(0),
        Kind::Half => Some(1),
        Kind::Float => Some(2),
        _ => None,
    }
}

/// The fused kernels, loaded for one CUDA device.
#[derive(Clone, Copy)]
pub struct FusedKernels {
    device: usize,
    context: cu::CUcontext,
    rotate_write: [cu::CUfunction; 3],
    silu_mul: [cu::CUfunction; 3],
    cross_entropy_grad: [cu::CUfunction; 3],
    graphs: GraphLibrary,
}

// SAFETY: a CUDA context and the functions of a module loaded in it are process-wide driver
// objects, usable from any thread (each launch makes the context current first); the module is
// never unloaded.
unsafe impl Send for FusedKernels {}
unsafe impl Sync for FusedKernels {}

impl std::fmt::Debug for FusedKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FusedKernels(cuda:{})", self.device)
    }
}

impl FusedKernels {
    /// Compiles the kernels for CUDA device `device` and loads them into its primary context
    /// (the one libtorch runs in). `graphs`: the library that knows libtorch's current stream.
    pub fn load(graphs: GraphLibrary, libtorch_dir: Option<&Path>, device: Device) -> Result<Self> {
        let Device::Cuda(index) = device else {
            bail!("fused kernels need a CUDA device, not {device:?}");
        };
        let nvrtc = Nvrtc::load(libtorch_dir)?;
        // SAFETY: driver calls with out-pointers to locals; the context is retained for the
        // life of the process (as libtorch does).
        unsafe {
            driver("cuInit", cu::cuInit(0))?;
            let mut dev: cu::CUdevice = 0;
            driver("cuDeviceGet", cu::cuDeviceGet(&mut dev, index as c_int))?;
            let attribute = |a: cu::CUdevice_attribute| -> Result<i32> {
                let mut v: c_int = 0;
                driver(
                    "cuDeviceGetAttribute",
                    cu::cuDeviceGetAttribute(&mut v, a, dev),
                )?;
                Ok(v)
            };
            use cu::CUdevice_attribute::*;
            let arch = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? * 10
                + attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            let ptx = nvrtc.compile_ptx(SOURCE, arch)?;
            let mut context: cu::CUcontext = std::ptr::null_mut();
            driver(
                "cuDevicePrimaryCtxRetain",
                cu::cuDevicePrimaryCtxRetain(&mut context, dev),
            )?;
            driver("cuCtxPushCurrent", cu::cuCtxPushCurrent_v2(context))?;
            type Functions = [cu::CUfunction; 3];
            let loaded = (|| -> Result<(Functions, Functions, Functions)> {
                let mut module: cu::CUmodule = std::ptr::null_mut();
                driver(
                    "cuModuleLoadData",
                    cu::cuModuleLoadData(&mut module, ptx.as_ptr().cast()),
                )?;
                let function = |name: &str| -> Result<cu::CUfunction> {
                    let c_name = CString::new(name)?;
                    let mut f: cu::CUfunction = std::ptr::null_mut();
                    driver(
                        "cuModuleGetFunction",
                        cu::cuModuleGetFunction(&mut f, module, c_name.as_ptr()),
                    )?;
                    Ok(f)
                };
                let set = |stem: &str| -> Result<[cu::CUfunction; 3]> {
                    Ok([
                        function(&format!("{stem}_bf16"))?,
                        function(&format!("{stem}_f16"))?,
                        function(&format!("{stem}_f32"))?,
                    ])
                };
                Ok((
                    set("rotate_write")?,
                    set("silu_mul")?,
                    set("cross_entropy_grad")?,
                ))
            })();
            let mut popped: cu::CUcontext = std::ptr::null_mut();
            cu::cuCtxPopCurrent_v2(&mut popped);
            let (rotate_write, silu_mul, cross_entropy_grad) = loaded?;
            Ok(FusedKernels {
                device: index,
                context,
                rotate_write,
                silu_mul,
                cross_entropy_grad,
                graphs,
            })
        }
    }

    /// The CUDA device the kernels were loaded for.
    pub fn device(&self) -> Device {
        Device::Cuda(self.device)
    }

    /// One launch of `function` on libtorch's current stream of the device, with the device's
    /// context current (pushed only when another one is).
    fn launch(
        &self,
        function: cu::CUfunction,
        grid: (u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let stream = self.graphs.current_stream(self.device)? as cu::CUstream;
        // SAFETY: a function of a module loaded in `self.context`; `params` points at the
        // kernel's arguments, in its order and with its C types (checked by the callers).
        unsafe {
            let mut current: cu::CUcontext = std::ptr::null_mut();
            driver("cuCtxGetCurrent", cu::cuCtxGetCurrent(&mut current))?;
            let push = current != self.context;
            if push {
                driver("cuCtxPushCurrent", cu::cuCtxPushCurrent_v2(self.context))?;
            }
            let launched = cu::cuLaunchKernel(
                function,
                grid.0,
                grid.1,
                1,
                block,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            );
            if push {
                let mut popped: cu::CUcontext = std::ptr::null_mut();
                cu::cuCtxPopCurrent_v2(&mut popped);
            }
            driver("cuLaunchKernel", launched)
        }
    }

    /// Checks that `t` is a dense tensor of `kind` on this device.
    fn check(&self, what: &str, t: &Tensor, kind: Kind) -> Result<()> {
        ensure!(
            t.device() == self.device(),
            "fused kernels: {what} is on {:?}, the kernels on cuda:{}",
            t.device(),
            self.device
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
        let block = ((d / 2 + 31) / 32 * 32) as u32;
        let grid = (n as u32, (layers * (heads + 2 * kv)) as u32);
        self.launch(self.rotate_write[which], grid, block, &mut args.pointers())?;
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
        let threads = 256u32;
        let blocks = ((n * width + 255) / 256).clamp(1, 65_535) as u32;
        self.launch(self.silu_mul[which], (blocks, 1), threads, &mut params)?;
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
        self.launch(
            self.cross_entropy_grad[which],
            (rows as u32, 1),
            512,
            &mut params,
        )?;
        Ok((loss, correct))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// libnvrtc for the tests: the one `make setup` installs (NVRTC runs without a GPU), else
    /// one beside the loaded libtorch or on the library path.
    fn nvrtc() -> Nvrtc {
        let setup = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(".deps/python/cuda-nvrtc/nvidia/cu13/lib/libnvrtc.so.13");
        if setup.is_file() {
            return Nvrtc::load_from(&setup).unwrap_or_else(|e| panic!("{}: {e}", setup.display()));
        }
        let libtorch = crate::runtime::loaded_library(|name| name == "libtorch_cpu.so");
        Nvrtc::load(libtorch.as_deref().and_then(Path::parent))
            .unwrap_or_else(|e| panic!("{e:#} (make setup installs libnvrtc)"))
    }

    /// The kernels' source compiles for a Hopper GPU, every kernel the loader looks up is in the
    /// PTX, and a source that does not compile is reported with the compiler's log: what a GPU
    /// machine does first, checked where there is none.
    #[test]
    fn the_kernel_source_compiles_and_a_broken_one_is_reported() {
        let nvrtc = nvrtc();
        let ptx = nvrtc.compile_ptx(SOURCE, 90).unwrap();
        let text = ptx.to_str().unwrap();
        for stem in ["rotate_write", "silu_mul", "cross_entropy_grad"] {
            for kind in ["bf16", "f16", "f32"] {
                let entry = format!(".entry {stem}_{kind}(");
                assert!(text.contains(&entry), "no {entry} in the PTX");
            }
        }
        let err = nvrtc
            .compile_ptx("extern \"C\" __global__ void broken(int x) { y = x; }", 90)
            .unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("compute_90") && msg.contains("\"y\""), "{msg}");
    }
}
