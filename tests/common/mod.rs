//! Shared helpers for the integration tests.
#![allow(dead_code)]

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
