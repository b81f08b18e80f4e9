//! What the run-time compiled kernels share ([`super::fused`], [`super::gdn`]): libnvrtc,
//! loaded here rather than through cudarc's lazy loader, for the reason libnccl is (see
//! [`crate::pipeline::nccl`]): the wheel's `libnvrtc.so.13` sits in
//! `site-packages/nvidia/cu13/lib`, which only libtorch's own rpath names; a module compiled
//! from CUDA source loaded into a device's primary context; and launches on libtorch's current
//! stream, so that the kernels are ordered with its work and captured with it into CUDA graphs.
//! The driver API and its types come from `cudarc` (feature `driver`, loaded dynamically).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, ensure, Result};
use cudarc::driver::sys as cu;
use tch::{Device, Kind};

use super::graph::GraphLibrary;
use crate::runtime::library_symbol;

/// The headers a kernel source may include by name: the storage types (bf16, f16, f32) the
/// kernels load and store, one copy for all of them; the gated delta rule's chunked forms and
/// causal convolution, which gdn_kernels.cu includes (files of their own for their size).
const HEADERS: [(&str, &str); 4] = [
    ("storage_types.cuh", include_str!("storage_types.cuh")),
    ("gdn_chunked.cuh", include_str!("gdn_chunked.cuh")),
    ("gdn_chunked_tc.cuh", include_str!("gdn_chunked_tc.cuh")),
    ("gdn_conv.cuh", include_str!("gdn_conv.cuh")),
];

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

/// A loaded libnvrtc.
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

    /// PTX of `source`, named `file` in the compiler's messages, for compute capability `arch`.
    pub(super) fn compile_named(&self, source: &str, file: &str, arch: i32) -> Result<CString> {
        let src = CString::new(source)?;
        let name = CString::new(file)?;
        let headers = HEADERS
            .iter()
            .map(|&(name, text)| Ok((CString::new(name)?, CString::new(text)?)))
            .collect::<Result<Vec<_>>>()?;
        let header_texts: Vec<*const c_char> = headers.iter().map(|h| h.1.as_ptr()).collect();
        let header_names: Vec<*const c_char> = headers.iter().map(|h| h.0.as_ptr()).collect();
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
                headers.len() as c_int,
                header_texts.as_ptr(),
                header_names.as_ptr(),
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

/// `Ok` for success, else an error naming the driver call and the driver's message.
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

/// A CUDA device's primary context (the one libtorch runs in) with a module of kernels
/// compiled for the device loaded in it, and libtorch's stream library to launch them on.
#[derive(Clone, Copy)]
pub(super) struct KernelModule {
    device: usize,
    /// The device's compute capability, major * 10 + minor (what the source was compiled for).
    arch: i32,
    /// The device's streaming multiprocessors (how many blocks of one per multiprocessor run
    /// at once).
    multiprocessors: i32,
    context: cu::CUcontext,
    graphs: GraphLibrary,
}

impl KernelModule {
    /// Compiles `source` (named `file` in the compiler's messages) for CUDA device `index`,
    /// loads it into the device's primary context and looks its functions up with `lookup`
    /// (given the loaded module, the context current). `graphs`: the library that knows
    /// libtorch's current stream.
    pub(super) fn load<T>(
        graphs: GraphLibrary,
        libtorch_dir: Option<&Path>,
        index: usize,
        (source, file): (&str, &str),
        lookup: impl FnOnce(cu::CUmodule) -> Result<T>,
    ) -> Result<(Self, T)> {
        let nvrtc = Nvrtc::load(libtorch_dir)?;
        // SAFETY: driver calls with out-pointers to locals; the context is retained for the
        // life of the process (as libtorch does), the module never unloaded.
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
            let multiprocessors = attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            let ptx = nvrtc.compile_named(source, file, arch)?;
            let mut context: cu::CUcontext = std::ptr::null_mut();
            driver(
                "cuDevicePrimaryCtxRetain",
                cu::cuDevicePrimaryCtxRetain(&mut context, dev),
            )?;
            driver("cuCtxPushCurrent", cu::cuCtxPushCurrent_v2(context))?;
            let loaded = (|| -> Result<T> {
                let mut module: cu::CUmodule = std::ptr::null_mut();
                driver(
                    "cuModuleLoadData",
                    cu::cuModuleLoadData(&mut module, ptx.as_ptr().cast()),
                )?;
                lookup(module)
            })();
            let mut popped: cu::CUcontext = std::ptr::null_mut();
            cu::cuCtxPopCurrent_v2(&mut popped);
            let module = KernelModule {
                device: index,
                arch,
                multiprocessors,
                context,
                graphs,
            };
            Ok((module, loaded?))
        }
    }

    /// The CUDA device the kernels were loaded for.
    pub(super) fn device(&self) -> Device {
        Device::Cuda(self.device)
    }

    /// The CUDA device's index.
    pub(super) fn index(&self) -> usize {
        self.device
    }

    /// The device's compute capability, major * 10 + minor (90 for an H100 / H200).
    pub(super) fn compute_capability(&self) -> i32 {
        self.arch
    }

    /// The device's streaming multiprocessors (132 on an H100 / H200 SXM).
    pub(super) fn multiprocessors(&self) -> i32 {
        self.multiprocessors
    }

    /// One launch of `function` (of this module) on libtorch's current stream of the device,
    /// with the device's context current (pushed only when another one is). `params` point at
    /// the kernel's arguments, in its order and with its C types (the callers check them).
    pub(super) fn launch(
        &self,
        function: cu::CUfunction,
        grid: (u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.launch_with_shared(function, (grid.0, grid.1, 1), block, 0, params)
    }

    /// [`KernelModule::launch`] over a three-dimensional grid.
    pub(super) fn launch_3d(
        &self,
        function: cu::CUfunction,
        grid: (u32, u32, u32),
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.launch_with_shared(function, grid, block, 0, params)
    }

    /// [`KernelModule::launch`] with `shared_bytes` of dynamic shared memory (more than 48 KB
    /// needs [`allow_dynamic_shared`] on the function first).
    pub(super) fn launch_with_shared(
        &self,
        function: cu::CUfunction,
        grid: (u32, u32, u32),
        block: u32,
        shared_bytes: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let stream = self.graphs.current_stream(self.device)? as cu::CUstream;
        // SAFETY: a function of a module loaded in `self.context`; `params` as documented.
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
                grid.2,
                block,
                1,
                1,
                shared_bytes,
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
}

/// Lets `function` take up to `bytes` of dynamic shared memory (the default cap is 48 KB).
///
/// # Safety
/// `function` is a function of a module loaded in the current context.
pub(super) unsafe fn allow_dynamic_shared(function: cu::CUfunction, bytes: usize) -> Result<()> {
    driver(
        "cuFuncSetAttribute",
        cu::cuFuncSetAttribute(
            function,
            cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as c_int,
        ),
    )
}

/// The function `name` of a loaded module.
///
/// # Safety
/// `module` is a module loaded in the current context and not unloaded.
pub(super) unsafe fn function(module: cu::CUmodule, name: &str) -> Result<cu::CUfunction> {
    let c_name = CString::new(name)?;
    let mut f: cu::CUfunction = std::ptr::null_mut();
    driver(
        "cuModuleGetFunction",
        cu::cuModuleGetFunction(&mut f, module, c_name.as_ptr()),
    )?;
    Ok(f)
}

// SAFETY: a CUDA context and the functions of a module loaded in it are process-wide driver
// objects, usable from any thread (each launch makes the context current first); the module is
// never unloaded.
unsafe impl Send for KernelModule {}
unsafe impl Sync for KernelModule {}

/// libnvrtc for the compile tests: the one `make setup` installs (NVRTC runs without a GPU),
/// else one beside the loaded libtorch or on the library path; `None` (with the reason
/// printed) where there is none, except under CI, whose set-up installs it.
#[cfg(test)]
pub(super) fn nvrtc_for_tests() -> Option<Nvrtc> {
    let setup = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".deps/python/cuda-nvrtc/nvidia/cu13/lib/libnvrtc.so.13");
    if setup.is_file() {
        return Some(
            Nvrtc::load_from(&setup).unwrap_or_else(|e| panic!("{}: {e}", setup.display())),
        );
    }
    let libtorch = crate::runtime::loaded_library(|name| name == "libtorch_cpu.so");
    match Nvrtc::load(libtorch.as_deref().and_then(Path::parent)) {
        Ok(nvrtc) => Some(nvrtc),
        Err(e) => {
            assert!(
                std::env::var_os("CI").is_none(),
                "{e:#} (make setup installs libnvrtc)"
            );
            eprintln!("not run: {e:#} (make setup installs libnvrtc)");
            None
        }
    }
}

/// Builds `tests/cuda_emulation/{program}.cpp` (kernels' sources run on the CPU, see its
/// cuda_emu.h) with the C++20 compiler `$CXX` (else `c++`, as the build's C++ shims), runs it
/// and returns its report after checking that it exited successfully and printed `cases`
/// lines starting "ok "; `None` (with the reason printed) where there is no compiler, except
/// under CI.
#[cfg(test)]
pub(super) fn run_cuda_emulation(program: &str, cases: usize) -> Option<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join(program);
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let built = std::process::Command::new(&compiler)
        .args(["-std=c++20", "-O1", "-pthread", "-w"])
        .arg(format!("-I{}", root.join("src/aten_ext").display()))
        .arg(root.join(format!("tests/cuda_emulation/{program}.cpp")))
        .arg("-o")
        .arg(&exe)
        .output();
    let built = match built {
        Ok(out) => out,
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "{compiler}: {e}");
            eprintln!("not run: no C++ compiler ({compiler}: {e})");
            return None;
        }
    };
    assert!(
        built.status.success(),
        "{compiler} failed: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = std::process::Command::new(&exe).output().unwrap();
    let report = String::from_utf8_lossy(&ran.stdout).into_owned();
    assert!(
        ran.status.success(),
        "{report}{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    assert_eq!(
        report.lines().filter(|l| l.starts_with("ok ")).count(),
        cases,
        "{report}"
    );
    Some(report)
}
