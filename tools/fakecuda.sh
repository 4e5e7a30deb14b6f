#!/usr/bin/env bash
# Builds the test CUDA library (tests/support/fakecuda: a fake driver,
# cuBLAS/cuBLASLt and cuDNN in one cdylib, kernels run by the PTX
# interpreter) and prints a folder to put first on LD_LIBRARY_PATH, where
# cudarc's dlopen of libcuda.so / libcublas.so / libcublasLt.so / libcudnn.so
# finds it. Usage:
#   LD_LIBRARY_PATH="$(tools/fakecuda.sh):<NVRTC 13.0 lib dir>" MEMFIT_REQUIRE_GPU=1 \
#     cargo test --features cuda --test cuda_vs_cpu
# Never name it libcuda.so.1: NVRTC dlopens that itself, and must not get
# the fake.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-$PWD/target}"
case "$target" in /*) ;; *) target="$PWD/$target" ;; esac
cargo build --quiet -p memfit-fakecuda >&2
lib="$target/debug/libcuda.so"
[ -f "$lib" ] || { echo "fakecuda.sh: $lib was not built" >&2; exit 1; }
dir="$target/debug/fakecuda-lib"
mkdir -p "$dir"
for name in libcuda.so libcublas.so libcublasLt.so libcudnn.so; do
  ln -sf "$lib" "$dir/$name"
done
echo "$dir"
