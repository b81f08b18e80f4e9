// 1. Compiles src/aten_ext/ops.cpp, the shim to libtorch's fused AdamW and flash attention
//    kernels (tch does not bind them), against the libtorch headers with the flags torch-sys
//    compiles its own C++ with: the same include folders and the same _GLIBCXX_USE_CXX11_ABI, found the same way
//    (LIBTORCH_USE_PYTORCH asks Python's torch; else LIBTORCH_INCLUDE or LIBTORCH, or a system
//    libtorch under /usr; the ABI from LIBTORCH_CXX11_ABI, 1 by default). The symbols resolve
//    from libtorch_cpu, which torch-sys links.
// 2. Embeds an rpath to the libtorch link folder so the binary and the test executables start
//    without LD_LIBRARY_PATH. DT_RPATH (not RUNPATH) is used because it also applies to the
//    dependencies of libtorch_cpu.so (libcudart, libcupti), which live in the same link
//    folder.
use std::path::{Path, PathBuf};

const SHIM: &str = "src/aten_ext/ops.cpp";

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

fn main() {
    println!("cargo:rerun-if-changed={SHIM}");
    let (includes, abi) = libtorch_headers();
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .std("c++17")
        .includes(&includes)
        .file(SHIM);
    build.define("GLOG_USE_GLOG_EXPORT", None);
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
