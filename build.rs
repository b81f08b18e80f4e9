// 1. Compiles src/aten_ext/ops.cpp, the shim to libtorch's fused AdamW and flash attention
//    kernels, src/aten_ext/profiler.cpp, the one to its profiler, and src/aten_ext/c10d.cpp, the
//    one to torch.distributed's store and Gloo process group, and src/aten_ext/autograd.cpp,
//    autograd functions whose passes are the program's own kernels (tch binds none of them),
//    against the libtorch headers with the flags torch-sys
//    compiles its own C++ with: the same include folders and the same _GLIBCXX_USE_CXX11_ABI, found the same way
//    (LIBTORCH_USE_PYTORCH asks Python's torch; else LIBTORCH_INCLUDE or LIBTORCH, or a system
//    libtorch under /usr; the ABI from LIBTORCH_CXX11_ABI, 1 by default). The symbols resolve
//    from libtorch_cpu, which torch-sys links.
// 2. Compiles src/aten_ext/cuda_graph.cpp (libtorch's CUDA graphs behind a C interface) into a
//    shared library in OUT_DIR, which the binary embeds and loads at run time once CUDA is
//    there (src/aten_ext/graph.rs). It needs libtorch's CUDA headers and the CUDA runtime's
//    headers (DFLASH_CUDA_INCLUDE, a list of folders; $LIBTORCH/cuda-include and
//    cuda-crt-include as scripts/setup-libtorch.sh links them; $CUDA_HOME/include or
//    /usr/local/cuda/include) but links nothing: its symbols resolve
//    against the libtorch_cuda the program loads. Without those headers the binary is built
//    without it (cfg dflash_cuda_graphs unset) and decodes without graphs.
// 3. Embeds an rpath to the libtorch link folder so the binary and the test executables start
//    without LD_LIBRARY_PATH. DT_RPATH (not RUNPATH) is used because it also applies to the
//    dependencies of libtorch_cpu.so (libcudart, libcupti), which live in the same link
//    folder.
use std::path::{Path, PathBuf};

const SHIM: &str = "src/aten_ext/ops.cpp";
const GRAPH_SHIM: &str = "src/aten_ext/cuda_graph.cpp";
const PROFILER_SHIM: &str = "src/aten_ext/profiler.cpp";
const C10D_SHIM: &str = "src/aten_ext/c10d.cpp";
const AUTOGRAD_SHIM: &str = "src/aten_ext/autograd.cpp";
/// Declarations of the few Gloo names c10d's ProcessGroupGloo.hpp mentions (see its README).
const GLOO_DECLARATIONS: &str = "src/aten_ext/gloo_decl";

fn env_rerun(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    std::env::var(name).ok()
}

/// The libtorch include folders and the C++11 ABI flag value, as torch-sys decides them.
fn libtorch_headers() -> (Vec<PathBuf>, String) {
    if env_rerun("LIBTORCH_USE_PYTORCH").is_some() {
        let script = "import torch\nfrom torch.utils import cpp_extension\n\
                      print('LIBTORCH_CXX11:', torch._C._GLIBCXX_USE_CXX11_ABI)\n\
                      for p in cpp_extension.include_paths():\n    print('LIBTORCH_INCLUDE:', p)\n";
        let python = if std::env::var_os("VIRTUAL_ENV").is_some() {
            "python"
        } else {
            "python3"
        };
        let out = match std::process::Command::new(python)
            .arg("-c")
            .arg(script)
            .output()
        {
            Ok(out) => out,
            Err(e) => panic!("LIBTORCH_USE_PYTORCH is set but {python} cannot run: {e}"),
        };
        let (mut includes, mut abi) = (Vec::new(), None);
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(p) = line.strip_prefix("LIBTORCH_INCLUDE: ") {
                includes.push(PathBuf::from(p));
            }
            match line.strip_prefix("LIBTORCH_CXX11: ") {
                Some("True") => abi = Some("1".to_owned()),
                Some("False") => abi = Some("0".to_owned()),
                _ => {}
            }
        }
        let Some(abi) = abi else {
            panic!(
                "LIBTORCH_USE_PYTORCH is set but {python} printed no C++11 ABI: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        return (includes, abi);
    }
    let root = env_rerun("LIBTORCH_INCLUDE")
        .or_else(|| env_rerun("LIBTORCH"))
        .map(PathBuf::from)
        .or_else(|| {
            Path::new("/usr/lib/libtorch.so")
                .exists()
                .then(|| PathBuf::from("/usr"))
        });
    let Some(root) = root else {
        panic!("no libtorch found: set LIBTORCH (see scripts/setup-libtorch.sh)");
    };
    let abi = env_rerun("LIBTORCH_CXX11_ABI").unwrap_or_else(|| "1".to_owned());
    (
        vec![
            root.join("include"),
            root.join("include/torch/csrc/api/include"),
        ],
        abi,
    )
}

/// The folders holding the CUDA runtime's headers (`cuda_runtime_api.h` and the
/// `crt/host_config.h` it includes), if they can be found.
fn cuda_runtime_headers(torch_includes: &[PathBuf]) -> Option<Vec<PathBuf>> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(dirs) = env_rerun("DFLASH_CUDA_INCLUDE") {
        candidates.extend(std::env::split_paths(&dirs));
    }
    if let Some(root) = env_rerun("LIBTORCH") {
        let root = Path::new(&root);
        candidates.push(root.join("cuda-include"));
        candidates.push(root.join("cuda-crt-include"));
    }
    candidates.extend(torch_includes.iter().cloned());
    if let Some(home) = env_rerun("CUDA_HOME").or_else(|| env_rerun("CUDA_PATH")) {
        candidates.push(Path::new(&home).join("include"));
    }
    candidates.push("/usr/local/cuda/include".into());
    let find = |file: &str| candidates.iter().find(|d| d.join(file).is_file()).cloned();
    let runtime = find("cuda_runtime_api.h")?;
    let crt = find("crt/host_config.h")?;
    Some(if runtime == crt {
        vec![runtime]
    } else {
        vec![runtime, crt]
    })
}

/// Builds the CUDA graph library (see the top of this file); false when it cannot be built.
fn build_graph_library(includes: &[PathBuf], abi: &str) -> bool {
    println!("cargo:rerun-if-changed={GRAPH_SHIM}");
    println!("cargo::rustc-check-cfg=cfg(dflash_cuda_graphs)");
    let has_graph_header = includes
        .iter()
        .any(|d| d.join("ATen/cuda/CUDAGraph.h").is_file());
    let Some(cuda) = cuda_runtime_headers(includes).filter(|_| has_graph_header) else {
        println!(
            "cargo:warning=no CUDA runtime headers or no ATen/cuda headers found: built without CUDA graphs (decoding on a GPU works, launch-bound)"
        );
        return false;
    };
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let out = out_dir.join("libdflash_cuda_graph.so");
    let compiler = cc::Build::new()
        .cpp(true)
        .pic(true)
        .std("c++17")
        .opt_level(2)
        .get_compiler();
    let mut cmd = compiler.to_command();
    for dir in includes.iter().chain(&cuda) {
        cmd.arg("-I").arg(dir);
    }
    cmd.args(["-shared", "-fPIC", "-w", "-DGLOG_USE_GLOG_EXPORT"])
        .arg(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .arg(GRAPH_SHIM)
        .arg("-o")
        .arg(&out);
    match cmd.status() {
        Ok(s) if s.success() => true,
        Ok(s) => panic!("compiling {GRAPH_SHIM} failed ({s}): {cmd:?}"),
        Err(e) => panic!("cannot run the C++ compiler for {GRAPH_SHIM}: {e}"),
    }
}

fn main() {
    println!("cargo:rerun-if-changed={SHIM}");
    println!("cargo:rerun-if-changed={PROFILER_SHIM}");
    println!("cargo:rerun-if-changed=src/aten_ext/guard.h");
    println!("cargo:rerun-if-changed={C10D_SHIM}");
    println!("cargo:rerun-if-changed={AUTOGRAD_SHIM}");
    println!("cargo:rerun-if-changed={GLOO_DECLARATIONS}");
    let (includes, abi) = libtorch_headers();
    if build_graph_library(&includes, &abi) {
        println!("cargo:rustc-cfg=dflash_cuda_graphs");
    }
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .std("c++17")
        .includes(&includes)
        .file(SHIM)
        .file(PROFILER_SHIM)
        .file(C10D_SHIM)
        .file(AUTOGRAD_SHIM)
        .include(GLOO_DECLARATIONS);
    build.define("GLOG_USE_GLOG_EXPORT", None);
    // c10d's Gloo process group is declared only under this (libtorch_cpu is built with it)
    build.define("USE_C10D_GLOO", None);
    // (torch-sys sets the ABI for GCC and Clang only)
    if std::env::var("CARGO_CFG_TARGET_ENV").as_deref() != Ok("msvc") {
        build.define("_GLIBCXX_USE_CXX11_ABI", abi.as_str());
    }
    build.compile("dflash_aten_ext");

    if let Some(libtorch) = env_rerun("LIBTORCH") {
        let lib = Path::new(&libtorch).join("lib");
        let lib = lib.canonicalize().unwrap_or(lib);
        println!("cargo:rustc-link-arg=-Wl,--disable-new-dtags");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    }
}
