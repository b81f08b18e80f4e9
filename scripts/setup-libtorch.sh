#!/usr/bin/env bash
# Installs the CPU part of libtorch 2.11.0 from PyPI into .deps/ (git-ignored) and builds the
# link folder .deps/libtorch/{include,lib} that tch's build (LIBTORCH) and the binary's rpath use.
#
# Why this shape: the torch wheel carries libtorch; we install it WITHOUT its CUDA dependency
# packages (gigabytes) and only add the two small CUDA runtime libraries libtorch_cpu.so needs at
# load time. libtorch_cuda.so is kept out of the link folder, because torch-sys links it whenever
# it finds it there; the program dlopens it at run time where it exists (see src/runtime.rs).
#
# Users with their own PyTorch 2.11: set DFLASH_TORCH_DIR=/path/to/site-packages/torch and run
# this script; it then only builds the link folder from that installation.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
deps="$root/.deps"
py=${PYTHON:-python3}
torch_version=2.11.0
cuda_toolkit_version=13.0.2

mkdir -p "$deps"

# install_cuda_part EXTRA DIR WHAT: pip-installs cuda-toolkit[EXTRA] into $site/DIR once (a stamp
# file says it is done).
install_cuda_part() {
  local stamp="$site/.installed-$2-$cuda_toolkit_version"
  [ -f "$stamp" ] && return 0
  echo "setup: installing $3 (cuda-toolkit==$cuda_toolkit_version $1)"
  rm -rf "${site:?}/$2"
  "$py" -m pip install --quiet --disable-pip-version-check --target "$site/$2" \
    "cuda-toolkit[$1]==$cuda_toolkit_version"
  touch "$stamp"
}
if [ -n "${DFLASH_TORCH_DIR:-}" ]; then
  torch_dir=$DFLASH_TORCH_DIR
  cuda_site=$(dirname "$torch_dir")
else
  site="$deps/python"
  torch_dir="$site/torch"
  stamp="$site/.installed-torch-$torch_version-cuda-$cuda_toolkit_version"
  if [ ! -f "$stamp" ]; then
    echo "setup: installing torch==$torch_version (CPU libraries only) into $site"
    rm -rf "$site"
    "$py" -m pip install --quiet --disable-pip-version-check --no-deps --target "$site" \
      "torch==$torch_version"
    echo "setup: installing CUDA runtime libraries (cuda-toolkit==$cuda_toolkit_version cudart, cupti)"
    # The extras resolve to the nvidia-cuda-runtime / nvidia-cuda-cupti wheels.
    "$py" -m pip install --quiet --disable-pip-version-check --target "$site/cuda" \
      "cuda-toolkit[cudart,cupti]==$cuda_toolkit_version"
    touch "$stamp"
  fi
  cuda_site="$site/cuda"
  # The CUDA runtime headers include crt/host_config.h, which ships apart (1 MB of headers):
  # the CUDA graph library build.rs compiles needs it.
  install_cuda_part crt cuda-crt "the CUDA crt headers"
  crt_site="$site/cuda-crt"
  # NVRTC, which compiles the fused decoding kernels at run time on a GPU (there the PyTorch
  # wheel brings it): here it lets a test compile their source without a GPU.
  install_cuda_part nvrtc cuda-nvrtc "NVRTC"
fi

[ -f "$torch_dir/lib/libtorch_cpu.so" ] || { echo "setup: no libtorch_cpu.so under $torch_dir/lib" >&2; exit 1; }

find_one() { # first file named $1 below $2
  find "$2" -name "$1" \( -type f -o -type l \) 2>/dev/null | sort | head -n 1
}

link="$deps/libtorch"
rm -rf "$link"
mkdir -p "$link/lib"
ln -s "$torch_dir/include" "$link/include"
ln -s "$torch_dir/share" "$link/share" 2>/dev/null || true
for lib in libtorch_cpu.so libtorch.so libc10.so; do
  ln -s "$torch_dir/lib/$lib" "$link/lib/$lib"
done
# libgomp ships inside the wheel (lib/ or torch.libs with a hashed name).
gomp=$(find_one 'libgomp*.so*' "$torch_dir/lib")
[ -n "$gomp" ] || gomp=$(find_one 'libgomp*.so*' "$(dirname "$torch_dir")/torch.libs")
[ -n "$gomp" ] && ln -s "$gomp" "$link/lib/$(basename "$gomp")"
for lib in libcudart.so.13 libcupti.so.13; do
  found=$(find_one "$lib" "$cuda_site")
  if [ -z "$found" ]; then
    found=$(find_one "$lib" "$torch_dir/lib")
  fi
  [ -n "$found" ] || { echo "setup: $lib not found under $cuda_site" >&2; exit 1; }
  ln -s "$found" "$link/lib/$lib"
done
# The CUDA runtime's headers (from the same wheel as libcudart), for the CUDA graph library
# build.rs compiles against libtorch's CUDA headers; nothing is linked against them.
cuda_api=$(find_one cuda_runtime_api.h "$cuda_site")
host_config=$(find_one host_config.h "${crt_site:-$cuda_site}")
if [ -n "$cuda_api" ] && [ -n "$host_config" ]; then
  ln -s "$(dirname "$cuda_api")" "$link/cuda-include"
  ln -s "$(dirname "$(dirname "$host_config")")" "$link/cuda-crt-include"
else
  echo "setup: no CUDA runtime or crt headers under $cuda_site: the binary is built without CUDA graphs" >&2
fi
echo "$torch_version" > "$link/version.txt"
echo "setup: libtorch $torch_version link folder ready at $link"
ls -l "$link/lib"
