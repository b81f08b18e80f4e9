//! libtorch at run time: where it was loaded from, whether CUDA is usable, device selection.
//!
//! The binary links only the CPU libraries of libtorch. CUDA support lives in
//! `libtorch_cuda.so`, which registers itself with libtorch when loaded; so at start-up we look
//! for it beside the loaded `libtorch_cpu.so` and on the library path and dlopen it with
//! RTLD_GLOBAL. Without it (or without a driver) everything runs on the CPU.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{bail, Result};

use crate::aten_ext::fused::{FusedKernelLoader, FusedKernels};
use crate::aten_ext::gdn::{self, GdnKernels};
use crate::aten_ext::graph::GraphLibrary;

const CUDA_LIBRARY: &str = "libtorch_cuda.so";

/// A device as the configuration and the command line name it: `auto` (the first GPU if any,
/// else the CPU), `cpu`, `cuda` (the first GPU, the same as `cuda:0`) or `cuda:N`. Parsed here
/// once for both (surrounding spaces ignored; serde reads and writes the same words);
/// [`TorchRuntime::resolve`] picks the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum DeviceSpec {
    #[default]
    Auto,
    Cpu,
    Cuda(usize),
}

/// A word that names no device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("device {0:?} is not one of auto, cpu, cuda, cuda:N")]
pub struct UnknownDevice(pub String);

impl FromStr for DeviceSpec {
    type Err = UnknownDevice;
    fn from_str(word: &str) -> std::result::Result<Self, UnknownDevice> {
        let index = |n: &str| {
            (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .then(|| n.parse::<usize>().ok())
                .flatten()
        };
        match word.trim() {
            "auto" => Ok(DeviceSpec::Auto),
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            other => match other.strip_prefix("cuda:").and_then(index) {
                Some(i) => Ok(DeviceSpec::Cuda(i)),
                None => Err(UnknownDevice(other.to_string())),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Auto => f.write_str("auto"),
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl serde::Serialize for DeviceSpec {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for DeviceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> std::result::Result<Self, D::Error> {
        let word = String::deserialize(deserializer)?;
        word.parse().map_err(serde::de::Error::custom)
    }
}

/// How messages and the control room name a device: "cpu" or "cuda:N", the words of
/// [`DeviceSpec`].
pub fn device_name(device: tch::Device) -> String {
    match device {
        tch::Device::Cpu => DeviceSpec::Cpu.to_string(),
        tch::Device::Cuda(i) => DeviceSpec::Cuda(i).to_string(),
        other => format!("{other:?}"),
    }
}

/// What start-up found out about CUDA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaSupport {
    /// `libtorch_cuda.so` loaded from this path; `devices` CUDA devices are usable.
    Loaded { library: PathBuf, devices: usize },
    /// No `libtorch_cuda.so` beside libtorch or on the library path.
    LibraryNotFound,
    /// Found but failed to load (for example its CUDA dependencies are missing).
    LoadFailed { library: PathBuf, error: String },
}

/// The libtorch this process runs on.
#[derive(Debug, Clone)]
pub struct TorchRuntime {
    /// The directory of the loaded `libtorch_cpu.so`.
    pub libtorch_dir: Option<PathBuf>,
    pub cuda: CudaSupport,
    /// CUDA graphs for the decoding engines: the library once CUDA is loaded, else why not.
    pub graphs: std::result::Result<GraphLibrary, String>,
}

impl TorchRuntime {
    /// Call once, before the first tensor operation.
    pub fn init() -> Self {
        let libtorch_dir = loaded_library_dir("libtorch_cpu.so");
        let cuda = load_cuda(libtorch_dir.as_deref());
        let graphs = match &cuda {
            CudaSupport::Loaded { devices, .. } if *devices > 0 => {
                GraphLibrary::load().map_err(|e| format!("{e:#}"))
            }
            _ => Err("no CUDA device".to_string()),
        };
        let runtime = TorchRuntime {
            libtorch_dir,
            cuda,
            graphs,
        };
        runtime.log();
        runtime
    }

    pub fn cuda_devices(&self) -> usize {
        match self.cuda {
            CudaSupport::Loaded { devices, .. } => devices,
            _ => 0,
        }
    }

    /// The fused decoding kernels compiled for `device`, when `wanted`, the device is
    /// a GPU and they compile and load (else `None`, with a warning saying why: libtorch's
    /// operations then do the same work).
    pub fn fused_kernels(&self, wanted: bool, device: tch::Device) -> Option<FusedKernels> {
        self.fused_kernel_loader(wanted)?.load_or_warn(device)
    }

    /// What loads the fused kernels per device, when `wanted` and the CUDA library loaded.
    pub fn fused_kernel_loader(&self, wanted: bool) -> Option<FusedKernelLoader> {
        self.loader().ok().filter(|_| wanted)
    }

    /// Compiles and loads the fused kernels for `device`, or says why they cannot be.
    pub fn load_fused_kernels(&self, device: tch::Device) -> Result<FusedKernels> {
        match self.loader() {
            Ok(loader) => loader.load(device),
            Err(e) => bail!("no CUDA library ({e})"),
        }
    }

    /// The fused kernels' loader, or why the CUDA library is missing.
    fn loader(&self) -> std::result::Result<FusedKernelLoader, &String> {
        self.graphs.as_ref().map(|graphs| FusedKernelLoader {
            graphs: *graphs,
            libtorch_dir: self.libtorch_dir.clone(),
        })
    }

    /// The CUDA graph library, when it loaded and `wanted`; `None` means eager decoding.
    pub fn graphs(&self, wanted: bool) -> Option<GraphLibrary> {
        match (&self.graphs, wanted) {
            (Ok(lib), true) => Some(*lib),
            _ => None,
        }
    }

    fn log(&self) {
        match &self.cuda {
            CudaSupport::Loaded { library, devices } => log::info!(
                "CUDA: {devices} device(s) available ({} loaded)",
                library.display()
            ),
            CudaSupport::LibraryNotFound => log::info!(
                "CUDA: {CUDA_LIBRARY} not found beside libtorch or on LD_LIBRARY_PATH; running on CPU"
            ),
            CudaSupport::LoadFailed { library, error } => log::info!(
                "CUDA: {} could not be loaded ({error}); running on CPU",
                library.display()
            ),
        }
    }

    /// The devices of `specs` (`--device`): one device, or distinct CUDA devices (one worker
    /// each).
    pub(crate) fn device_list(&self, specs: &[DeviceSpec]) -> Result<Vec<tch::Device>> {
        let spec = specs
            .iter()
            .map(DeviceSpec::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let mut devices = Vec::new();
        for &one in specs {
            let device = self.resolve(one)?;
            if devices.contains(&device) {
                bail!("--device {spec:?} names {device:?} twice");
            }
            devices.push(device);
        }
        if devices.len() > 1 && devices.iter().any(|d| !d.is_cuda()) {
            bail!("--device {spec:?}: a list of devices must all be CUDA devices (cuda:N,cuda:M)");
        }
        Ok(devices)
    }

    /// The device a [`DeviceSpec`] names, parsed from `name`.
    pub fn device(&self, name: &str) -> Result<tch::Device> {
        self.resolve(name.parse()?)
    }

    /// The device `spec` names here: `auto` is the first GPU if one is usable, else the CPU; a
    /// CUDA device that is not usable is refused, saying why.
    pub fn resolve(&self, spec: DeviceSpec) -> Result<tch::Device> {
        let gpus = self.cuda_devices();
        let index = match spec {
            DeviceSpec::Auto if gpus > 0 => 0,
            DeviceSpec::Auto | DeviceSpec::Cpu => return Ok(tch::Device::Cpu),
            DeviceSpec::Cuda(i) => i,
        };
        if index >= gpus {
            bail!(
                "device {:?} asked for, but {} CUDA device(s) are usable ({})",
                spec.to_string(),
                gpus,
                match &self.cuda {
                    CudaSupport::Loaded { .. } => "check CUDA_VISIBLE_DEVICES".to_string(),
                    CudaSupport::LibraryNotFound =>
                        format!("{CUDA_LIBRARY} was not found; see `dflash-tui doctor`"),
                    CudaSupport::LoadFailed { error, .. } =>
                        format!("{CUDA_LIBRARY} failed to load: {error}"),
                }
            );
        }
        Ok(tch::Device::Cuda(index))
    }
}

/// The directory of a shared library this process has loaded, from /proc/self/maps.
/// The gated delta rule's CUDA kernels for `device` (a GPU) and key heads of `key_dim`, compiled
/// and loaded; `None` on the CPU, and, with one warning saying why, where they cannot load (the
/// rule then runs as libtorch's operations).
pub(crate) fn gdn_kernels_or_warn(device: tch::Device, key_dim: i64) -> Option<GdnKernels> {
    if !device.is_cuda() {
        return None;
    }
    let loaded = if gdn::KEY_DIMS.contains(&key_dim) {
        GraphLibrary::load().and_then(|graphs| {
            let dir = loaded_library_dir("libtorch_cpu.so");
            GdnKernels::load(graphs, dir.as_deref(), device)
        })
    } else {
        Err(anyhow::anyhow!(
            "no kernel for key heads of {key_dim} (only {:?})",
            gdn::KEY_DIMS
        ))
    };
    match loaded {
        Ok(kernels) => Some(kernels),
        Err(e) => {
            log::warn!(
                "gated delta rule kernels unavailable on {device:?}, libtorch's operations instead: {e:#}"
            );
            None
        }
    }
}

/// The fused kernels for `device` (a GPU), compiled and loaded, for the target's forward (its
/// norms and SwiGLU's product); `None` on the CPU, and, with one warning saying why, where they
/// cannot load (libtorch's operations then do the same work).
pub(crate) fn fused_kernels_or_warn(device: tch::Device) -> Option<FusedKernels> {
    if !device.is_cuda() {
        return None;
    }
    let loaded = GraphLibrary::load().and_then(|graphs| {
        let dir = loaded_library_dir("libtorch_cpu.so");
        FusedKernels::load(graphs, dir.as_deref(), device)
    });
    match loaded {
        Ok(kernels) => Some(kernels),
        Err(e) => {
            log::warn!(
                "fused kernels unavailable on {device:?}, libtorch's operations instead: {e:#}"
            );
            None
        }
    }
}

fn loaded_library_dir(name: &str) -> Option<PathBuf> {
    loaded_library(|f| f == name).and_then(|p| p.parent().map(Path::to_path_buf))
}

/// The path of the first shared library this process has loaded whose file name `matches`,
/// from /proc/self/maps.
pub(crate) fn loaded_library(matches: impl Fn(&str) -> bool) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .map(Path::new)
        .find(|p| p.file_name().and_then(|f| f.to_str()).is_some_and(&matches))
        .map(Path::to_path_buf)
}

fn cuda_candidates(libtorch_dir: Option<&Path>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = libtorch_dir.into_iter().map(Path::to_path_buf).collect();
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&paths));
    }
    dirs.into_iter()
        .map(|d| d.join(CUDA_LIBRARY))
        .filter(|p| p.is_file())
        .collect()
}

fn load_cuda(libtorch_dir: Option<&Path>) -> CudaSupport {
    let candidates = cuda_candidates(libtorch_dir);
    let Some(first) = candidates.first().cloned() else {
        return CudaSupport::LibraryNotFound;
    };
    let mut last_error = String::new();
    for path in candidates {
        // SAFETY: loading libtorch_cuda runs its static initialisers, which register the CUDA
        // backend with the libtorch already in this process; nothing else runs yet.
        let flags = libc::RTLD_NOW | libc::RTLD_GLOBAL;
        match unsafe { libloading::os::unix::Library::open(Some(&path), flags) } {
            Ok(lib) => {
                // Kept loaded for the life of the process: unloading CUDA kernels is not safe.
                std::mem::forget(lib);
                let devices = if tch::Cuda::is_available() {
                    tch::Cuda::device_count().max(0) as usize
                } else {
                    0
                };
                return CudaSupport::Loaded {
                    library: path,
                    devices,
                };
            }
            Err(e) => last_error = e.to_string(),
        }
    }
    CudaSupport::LoadFailed {
        library: first,
        error: last_error,
    }
}

/// The libtorch version compiled into torch-sys' headers, from the link folder's marker or the
/// Python package's version file.
pub(crate) fn libtorch_version(libtorch_dir: Option<&Path>) -> Option<String> {
    let dir = libtorch_dir?;
    // torch/lib/../version.py holds `__version__ = '2.11.0+cu130'`.
    let version_py = dir.parent()?.join("version.py");
    let text = std::fs::read_to_string(version_py).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("__version__ = "))
        .map(|v| v.trim().trim_matches('\'').trim_matches('"').to_string())
}

/// The symbol `name` of a dynamically loaded C library, as the function-pointer type `T`; the
/// error names the symbol.
///
/// # Safety
/// `T` must be the symbol's true C signature (the library's header declares it).
pub(crate) unsafe fn library_symbol<T: Copy>(
    library: &libloading::Library,
    name: &str,
) -> std::result::Result<T, String> {
    let c_name = format!("{name}\0");
    library
        .get::<T>(c_name.as_bytes())
        .map(|symbol| *symbol)
        .map_err(|e| format!("{name}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse_and_print_one_way() {
        for (word, spec) in [
            ("auto", DeviceSpec::Auto),
            ("cpu", DeviceSpec::Cpu),
            (" cuda", DeviceSpec::Cuda(0)),
            ("cuda:0", DeviceSpec::Cuda(0)),
            ("cuda:12 ", DeviceSpec::Cuda(12)),
        ] {
            assert_eq!(word.parse::<DeviceSpec>(), Ok(spec), "{word:?}");
            assert_eq!(spec.to_string().parse::<DeviceSpec>(), Ok(spec));
        }
        assert_eq!(DeviceSpec::Cuda(3).to_string(), "cuda:3");
        for word in ["gpu", "cuda:", "cuda:+1", "cuda:x", "CPU", "", "cpu,cuda"] {
            assert_eq!(
                word.parse::<DeviceSpec>(),
                Err(UnknownDevice(word.trim().to_string())),
                "{word:?}"
            );
        }
        assert_eq!(
            "gpu".parse::<DeviceSpec>().unwrap_err().to_string(),
            "device \"gpu\" is not one of auto, cpu, cuda, cuda:N"
        );
    }

    #[test]
    fn device_names_are_the_spec_words() {
        assert_eq!(device_name(tch::Device::Cpu), "cpu");
        assert_eq!(device_name(tch::Device::Cuda(2)), "cuda:2");
        assert_eq!(device_name(tch::Device::Mps), "Mps");
    }
}
