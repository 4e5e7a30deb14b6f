//! Shared helpers for the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use memfit::memory::{Category, Pool, Tag};
use memfit::nn::{BlockKind, Precision, ResNetConfig, StemKind};
use memfit::tensor::Tensor;
use rand::{RngExt, SeedableRng, rngs::ChaCha8Rng};

pub fn tiny_config(
    block: BlockKind,
    layers: [usize; 4],
    base_width: usize,
    classes: usize,
) -> ResNetConfig {
    ResNetConfig {
        block,
        layers,
        base_width,
        num_classes: classes,
        stem: StemKind::ImageNet,
        zero_init_residual: false,
        seed: 7,
        precision: Precision::F32,
        recompute_bn_relu: false,
        target: memfit::device::Target::Cpu,
    }
}

/// Random images in [-1, 1) and labels, seeded.
pub fn batch(
    pool: &Pool,
    seed: u64,
    n: usize,
    h: usize,
    w: usize,
    classes: usize,
) -> (Tensor, Vec<usize>) {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let x: Vec<f32> = (0..n * h * w * 3)
        .map(|_| r.random::<f32>() * 2.0 - 1.0)
        .collect();
    let labels = (0..n).map(|_| r.random_range(0..classes)).collect();
    (
        pool.from_f32(&[n, h, w, 3], &x, Category::Data, Tag::fixed("images"))
            .unwrap(),
        labels,
    )
}

/// A fresh folder under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "memfit-test-{name}-{}-{}-{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    /// Writes `bytes` at `rel` (which may name sub-folders, created as
    /// needed).
    pub fn write(&self, rel: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The memfit binary the tests run: `MEMFIT_BIN` when set, else the one
/// cargo built beside this test. The GPU bundle (tools/gpu/bundle.sh)
/// runs the test binaries on a machine where the path cargo compiled in
/// does not exist, so tools/gpu/check.sh points `MEMFIT_BIN` at the
/// bundled binary.
pub fn memfit_bin() -> PathBuf {
    std::env::var_os("MEMFIT_BIN")
        .filter(|v| !v.is_empty())
        .map_or_else(
            || PathBuf::from(env!("CARGO_BIN_EXE_memfit")),
            PathBuf::from,
        )
}

/// Runs the memfit binary with `args` and extra environment variables;
/// returns (exit code, stdout, stderr).
pub fn memfit_env(args: &[&str], env: &[(&str, &Path)]) -> (i32, String, String) {
    let mut cmd = Command::new(memfit_bin());
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run memfit");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs the memfit binary with `args`; returns (exit code, stdout, stderr).
pub fn memfit(args: &[&str]) -> (i32, String, String) {
    memfit_env(args, &[])
}

/// The predicted and measured reserved figures of `train`'s line
/// "predicted peak A vs measured B (+x%), reserved C vs D".
#[track_caller]
pub fn reserved_figures(line: &str) -> (&str, &str) {
    line.split_once(", reserved ")
        .and_then(|(_, r)| r.split_once(" vs "))
        .unwrap_or_else(|| panic!("no reserved figures: {line}"))
}

/// No panic message or backtrace hint reached the user.
#[track_caller]
pub fn assert_no_panic(what: &str, err: &str) {
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{what} panicked:\n{err}"
    );
}

/// A w×h mid-grey RGB PNG.
pub fn png(w: u32, h: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut wr = enc.write_header().unwrap();
    wr.write_image_data(&vec![128; (w * h * 3) as usize])
        .unwrap();
    drop(wr);
    out
}

/// The binary fails with `args`, says `needle` on stderr, and does not panic.
#[track_caller]
pub fn assert_clean_error(args: &[&str], needle: &str) {
    let (code, _, err) = memfit(args);
    assert_ne!(code, 0, "{args:?} succeeded");
    assert!(
        err.contains(needle),
        "{args:?}: stderr lacks {needle:?}:\n{err}"
    );
    assert_no_panic(&format!("{args:?}"), &err);
}

/// The probe line of CUDA device 0, or None (and a skip line) without a
/// usable device; a panic instead under `MEMFIT_REQUIRE_GPU=1`, so a GPU
/// check whose libraries are not found cannot pass by skipping.
#[cfg(any(feature = "cuda", feature = "cuda-12"))]
pub fn cuda_device() -> Option<String> {
    match memfit::device::cuda::probe(0) {
        Ok(info) => Some(info.to_string()),
        Err(m) if std::env::var("MEMFIT_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("MEMFIT_REQUIRE_GPU=1 but no usable CUDA device: {m}")
        }
        Err(m) => {
            println!("skipped: no CUDA device ({m})");
            None
        }
    }
}
