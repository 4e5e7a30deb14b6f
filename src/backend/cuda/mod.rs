//! The CUDA backend's own kernels, as NVRTC sources, and their compilation
//! to PTX. Built only with the `cuda` (CUDA 13) or `cuda-12` feature.
//!
//! Convolutions go to cuDNN and matmuls to cuBLAS(Lt); everything else the
//! boundary asks for is one of the small kernels under `kernels/`, one
//! `.cu` file per op family, each kernel mirroring a CPU kernel in
//! `crate::ops` (or the CPU backend's glue) and saying which, and where its
//! numerics differ. This module holds the sources and compiles them (a test
//! compiles every source for `compute_75` and `compute_90` in CI, on
//! machines without a GPU); `state` caches the compiled modules per device
//! and `ops` launches them (never run on a GPU yet: see `ops`).
//!
//! Numerics: the sources are compiled with `--fmad=false` (no contraction
//! of `a * b + c` into one fused multiply-add, which Rust does not do
//! either), IEEE division and square root, and no flush-to-zero, so the
//! elementwise kernels give the CPU's bits and the reductions differ only
//! where their comments say.

/// The choice of cuDNN algorithm per convolution geometry, without cuDNN.
pub mod conv_algo;
/// The regions of a convolution's workspace and its tiles of images.
pub mod conv_ws;
pub mod dnn;
/// NCCL: the gradient all-reduce of data-parallel training on GPUs.
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod ops;
pub mod state;

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};

use crate::device::cuda::Library;
use crate::error::{Error, Result};

/// Prepended to every source: 16-bit types, conversions, rounding modes.
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// Every kernel source by name (the name is its file under `kernels/`
/// without `.cu`). Compile one with [`compile`]; each becomes one module.
pub const KERNEL_SOURCES: &[(&str, &str)] = &[
    ("batchnorm", include_str!("kernels/batchnorm.cu")),
    ("relu", include_str!("kernels/relu.cu")),
    ("pool", include_str!("kernels/pool.cu")),
    ("loss", include_str!("kernels/loss.cu")),
    ("cast", include_str!("kernels/cast.cu")),
    ("optim", include_str!("kernels/optim.cu")),
    ("reduce", include_str!("kernels/reduce.cu")),
    ("conv", include_str!("kernels/conv.cu")),
    ("linear", include_str!("kernels/linear.cu")),
];

/// The virtual architectures CI compiles for: Turing (the oldest CUDA 13
/// supports) and Hopper (the H200 the GPU checks run on); the CUDA 12
/// build adds Pascal (`compute_61`, the GTX 1050 Ti). PTX for an older
/// architecture runs on every newer GPU (the driver JIT-compiles it).
#[cfg(not(feature = "cuda-12"))]
pub const CI_ARCHS: &[&str] = &["compute_75", "compute_90"];
#[cfg(feature = "cuda-12")]
pub const CI_ARCHS: &[&str] = &["compute_61", "compute_75", "compute_90"];

/// The names of the `extern "C" __global__` kernels in a source, in order:
/// what a module built from it exports.
pub fn kernel_names(source: &str) -> Vec<&str> {
    let mut names = Vec::new();
    for (i, _) in source.match_indices("extern \"C\" __global__ void ") {
        let rest = &source[i + "extern \"C\" __global__ void ".len()..];
        let end = rest.find('(').unwrap_or(rest.len());
        names.push(rest[..end].trim());
    }
    names
}

/// The virtual architecture to compile for on a device of compute
/// capability `cc`: `compute_XY` of the device, or, when this NVRTC is
/// older than the card (a Blackwell card with CUDA 12.6's NVRTC), the
/// newest architecture it knows below the card's, whose PTX the driver
/// compiles forward for the card. Without NVRTC's list (or NVRTC), the
/// card's own.
pub fn nvrtc_arch(cc: (u32, u32)) -> String {
    let want = (cc.0 * 10 + cc.1) as i32;
    let best = supported_archs()
        .into_iter()
        .filter(|&a| a <= want)
        .max()
        .unwrap_or(want);
    format!("compute_{best}")
}

/// The architectures NVRTC can compile for, as 75 for `compute_75`; empty
/// when NVRTC is missing or does not answer.
pub fn supported_archs() -> Vec<i32> {
    if !Library::Nvrtc.is_present() {
        return Vec::new();
    }
    use cudarc::nvrtc::sys::{nvrtcGetNumSupportedArchs, nvrtcGetSupportedArchs, nvrtcResult};
    let mut n: std::ffi::c_int = 0;
    // SAFETY: NVRTC is loadable (checked above); it writes one int.
    if unsafe { nvrtcGetNumSupportedArchs(&mut n) } != nvrtcResult::NVRTC_SUCCESS || n <= 0 {
        return Vec::new();
    }
    let mut archs = vec![0 as std::ffi::c_int; n as usize];
    // SAFETY: `archs` holds the `n` ints NVRTC writes.
    if unsafe { nvrtcGetSupportedArchs(archs.as_mut_ptr()) } != nvrtcResult::NVRTC_SUCCESS {
        return Vec::new();
    }
    archs
}

/// The options every kernel is compiled with (see the module doc).
fn options(name: &str, arch: &'static str) -> CompileOptions {
    CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        arch: Some(arch),
        name: Some(format!("{name}.cu")),
        ..Default::default()
    }
}

/// Compiles kernel source `name` (its body, without [`COMMON`], which is
/// prepended here) to PTX for the virtual architecture `arch`, e.g.
/// `"compute_75"`. NVRTC missing is `Error::CudaUnavailable` naming it; a
/// source NVRTC rejects is `Error::KernelCompile` with NVRTC's log.
pub fn compile(name: &str, source: &str, arch: &'static str) -> Result<Ptx> {
    if !Library::Nvrtc.is_present() {
        return Err(Library::Nvrtc.missing().into());
    }
    let full = format!("{COMMON}\n{source}");
    compile_ptx_with_opts(full, options(name, arch)).map_err(|e| {
        let log = match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        };
        Error::KernelCompile {
            kernel: name.to_string(),
            arch: arch.to_string(),
            log,
        }
    })
}
