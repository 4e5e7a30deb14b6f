//! Shared helpers for the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
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
