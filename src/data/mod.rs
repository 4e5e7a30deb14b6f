//! Datasets. For now one built-in, deterministic dataset that needs no
//! files: [`SyntheticGratings`], small images of oriented sine gratings
//! whose class is the orientation. It is learnable (a ResNet reaches high
//! accuracy in a few epochs) and serves as the zero-setup default and for
//! benchmarks. Real datasets (ImageFolder, IDX) come with the training issue.

use rand::{RngExt, SeedableRng, rngs::ChaCha8Rng};

/// An in-memory labelled image set, NHWC f32, already normalised.
pub struct InMemoryDataset {
    pub images: Vec<f32>, // (len, h, w, 3)
    pub labels: Vec<usize>,
    pub h: usize,
    pub w: usize,
    pub classes: usize,
}

impl InMemoryDataset {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    pub fn image(&self, i: usize) -> &[f32] {
        let sz = self.h * self.w * 3;
        &self.images[i * sz..(i + 1) * sz]
    }
}

/// Oriented gratings: class k has orientation k·π/classes, with random
/// frequency, phase, colour, contrast and pixel noise.
pub struct SyntheticGratings;

impl SyntheticGratings {
    pub fn generate(len: usize, size: usize, classes: usize, seed: u64) -> InMemoryDataset {
        let mut r = ChaCha8Rng::seed_from_u64(seed);
        let mut images = Vec::with_capacity(len * size * size * 3);
        let mut labels = Vec::with_capacity(len);
        for _ in 0..len {
            let class = r.random_range(0..classes);
            let angle = std::f32::consts::PI * class as f32 / classes as f32;
            let freq = 2.0 * std::f32::consts::PI * r.random_range(2.0f32..4.0) / size as f32;
            let phase = r.random::<f32>() * 2.0 * std::f32::consts::PI;
            let contrast = r.random_range(0.5f32..1.0);
            let colour: [f32; 3] = [
                r.random_range(0.3f32..1.0),
                r.random_range(0.3f32..1.0),
                r.random_range(0.3f32..1.0),
            ];
            let (s, c) = angle.sin_cos();
            for y in 0..size {
                for x in 0..size {
                    let v = contrast * ((x as f32 * c + y as f32 * s) * freq + phase).sin();
                    for ch in colour {
                        images.push(v * ch + 0.3 * (r.random::<f32>() * 2.0 - 1.0));
                    }
                }
            }
            labels.push(class);
        }
        InMemoryDataset {
            images,
            labels,
            h: size,
            w: size,
            classes,
        }
    }
}
