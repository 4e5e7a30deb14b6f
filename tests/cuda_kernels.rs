//! Every CUDA kernel source compiles to PTX with NVRTC, for the oldest
//! architecture CUDA 13 supports (Turing, `compute_75`) and for Hopper
//! (`compute_90`), and exports every `extern "C"` kernel it declares. Runs on
//! machines without a GPU: NVRTC alone is enough (CI installs it from PyPI).
//!
//! Without NVRTC the tests print why and pass, unless
//! `MEMFIT_REQUIRE_NVRTC=1` (CI sets it), where they fail.

#![cfg(any(feature = "cuda", feature = "cuda-12"))]

use std::time::Instant;

use memfit::Error;
use memfit::backend::cuda::{CI_ARCHS, KERNEL_SOURCES, compile, kernel_names};
use memfit::device::cuda::Library;

#[cfg(not(feature = "cuda-12"))]
const SKIP: &str = "skipped: NVRTC not found (pip install \"nvidia-cuda-nvrtc>=13,<14\" and put \
                    site-packages/nvidia/cu13/lib on LD_LIBRARY_PATH)";
#[cfg(feature = "cuda-12")]
const SKIP: &str = "skipped: NVRTC not found (pip install \"nvidia-cuda-nvrtc-cu12>=12.8,<12.9\" \
                    and put site-packages/nvidia/cuda_nvrtc/lib on LD_LIBRARY_PATH)";

/// Whether NVRTC can be loaded; if not, says so and passes, or fails when
/// `MEMFIT_REQUIRE_NVRTC=1`.
fn nvrtc_or_skip() -> bool {
    if Library::Nvrtc.is_present() {
        return true;
    }
    if std::env::var("MEMFIT_REQUIRE_NVRTC").as_deref() == Ok("1") {
        panic!("MEMFIT_REQUIRE_NVRTC=1 but {}", Library::Nvrtc.missing());
    }
    println!("{SKIP}");
    false
}

#[test]
fn every_kernel_source_compiles_for_every_ci_arch() {
    if !nvrtc_or_skip() {
        return;
    }
    let mut failures = Vec::new();
    for &arch in CI_ARCHS {
        for &(name, source) in KERNEL_SOURCES {
            let t = Instant::now();
            match compile(name, source, arch) {
                Ok(ptx) => {
                    let text = ptx.to_src();
                    let kernels = kernel_names(source);
                    assert!(!kernels.is_empty(), "{name}: no extern \"C\" kernels found");
                    for k in &kernels {
                        // A PTX entry point is `.visible .entry name(`.
                        assert!(
                            text.contains(&format!(".entry {k}(")),
                            "{name} for {arch}: kernel {k} missing from the PTX"
                        );
                    }
                    println!(
                        "{name:>10} {arch}: {} kernels, {} bytes of PTX, {:.2} s",
                        kernels.len(),
                        text.len(),
                        t.elapsed().as_secs_f64()
                    );
                }
                Err(e) => failures.push(format!("{e}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn a_broken_kernel_fails_with_nvrtcs_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let broken = "#line 1 \"broken.cu\"\n\
                  extern \"C\" __global__ void broken(float* y) { y[0] = undeclared_name; }\n";
    match compile("broken", broken, "compute_75") {
        Err(Error::KernelCompile { kernel, arch, log }) => {
            assert_eq!(kernel, "broken");
            assert_eq!(arch, "compute_75");
            assert!(log.contains("undeclared_name"), "log: {log}");
            assert!(log.contains("broken.cu"), "log names the file: {log}");
        }
        Err(other) => panic!("wrong error: {other}"),
        Ok(_) => panic!("a broken kernel compiled"),
    }
}

#[test]
fn kernel_names_lists_the_extern_c_kernels() {
    let src = "extern \"C\" __global__ void a(float* x) {}\n\
               __device__ float helper(float v) { return v; }\n\
               extern \"C\" __global__ void b_2(int n) {}\n";
    assert_eq!(kernel_names(src), ["a", "b_2"]);
    for &(name, source) in KERNEL_SOURCES {
        let names = kernel_names(source);
        assert!(!names.is_empty(), "{name}");
        assert!(
            source.starts_with(&format!("#line 1 \"{name}.cu\"")),
            "{name}.cu must start with its #line directive"
        );
    }
}

#[test]
fn the_numerics_policy_reaches_the_ptx() {
    // Compiled with --fmad=false, no f32 `a * b + c` becomes one fused
    // multiply-add: each rounds twice, as in Rust, which is what lets the
    // elementwise kernels give the CPU's bits; and f32 subnormals are kept
    // (--ftz=false). (The f64 exp/log that the loss calls use fma.rn.f64 and
    // an rcp.approx.ftz.f64 seed inside: the math library's own code.)
    if !nvrtc_or_skip() {
        return;
    }
    for &(name, source) in KERNEL_SOURCES {
        let text = compile(name, source, "compute_90").unwrap().to_src();
        assert!(text.contains(".target sm_90"), "{name}: target");
        assert!(!text.contains("fma.rn.f32"), "{name}: contracted f32 fma");
        assert!(!text.contains(".ftz.f32"), "{name}: f32 flush to zero");
    }
}

/// Every kernel the CUDA arm launches by a literal `"module", "name"` pair
/// (in `src/backend/cuda/ops.rs`) is an `extern "C"` kernel of that module's
/// source, so a renamed or removed kernel fails here, on any machine,
/// instead of at its first launch on a GPU. Needs no NVRTC.
#[test]
fn every_launched_kernel_exists() {
    let ops = include_str!("../src/backend/cuda/ops.rs");
    let mut checked = 0;
    // Literal pairs as the launches write them: `"module",` then
    // (perhaps after a line break) `"name",`.
    let words: Vec<&str> = ops
        .split(|c: char| c.is_whitespace())
        .filter(|w| !w.is_empty())
        .collect();
    let literal = |w: &str| {
        w.strip_suffix(',')
            .and_then(|w| w.strip_prefix('"'))
            .and_then(|w| w.strip_suffix('"'))
            .filter(|w| w.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
            .map(str::to_owned)
    };
    for pair in words.windows(2) {
        let (Some(module), Some(name)) = (literal(pair[0]), literal(pair[1])) else {
            continue;
        };
        let Some(&(_, source)) = KERNEL_SOURCES.iter().find(|(m, _)| *m == module) else {
            continue;
        };
        assert!(
            kernel_names(source).iter().any(|k| *k == name),
            "ops.rs launches {module}::{name}, which {module}.cu does not define"
        );
        checked += 1;
    }
    assert!(checked >= 20, "found only {checked} literal launches");
}
