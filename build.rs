// Embeds an rpath to the libtorch link folder so the binary and the test executables start
// without LD_LIBRARY_PATH. DT_RPATH (not RUNPATH) is used because it also applies to the
// dependencies of libtorch_cpu.so (libcudart, libcupti), which live in the same link folder.
fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Ok(libtorch) = std::env::var("LIBTORCH") {
        let lib = std::path::Path::new(&libtorch).join("lib");
        let lib = lib.canonicalize().unwrap_or(lib);
        println!("cargo:rustc-link-arg=-Wl,--disable-new-dtags");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    }
}
