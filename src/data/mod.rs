//! Datasets. The built-in ones are loaded whole into an [`InMemoryDataset`]
//! (NHWC f32, 3 channels, already normalised):
//!
//! - [`SyntheticGratings`]: built-in, deterministic, needs no files; small
//!   images of oriented sine gratings whose class is the orientation. It is
//!   learnable (a ResNet reaches high accuracy in a few epochs) and serves as
//!   the zero-setup default and for benchmarks.
//! - [`load_digits`]: scikit-learn's 8×8 handwritten digits (1,797 images,
//!   CC BY 4.0), embedded in the binary (`assets/digits.csv.gz`).
//! - [`load_fashion_mnist`]: Fashion-MNIST from the IDX files installed by
//!   Debian's `dataset-fashion-mnist` package ([`FASHION_MNIST_DEBIAN_DIR`])
//!   or `$MEMFIT_FASHION_MNIST_DIR`, read by the IDX reader in [`idx`].
//!
//! Image folders are read lazily: [`ImageFolder`] scans torchvision's
//! layout ([`folder`]), [`decode`] turns JPEG/PNG files into RGB bytes and
//! [`transform`] into augmented, normalised inputs. Training and evaluation
//! see both kinds through the [`Dataset`] trait, batched by a [`Loader`]
//! ([`loader`]) on background threads. [`load_data`] ([`registry`]) turns
//! a dataset's name or folder into the (train, validation) pair a command
//! uses.

pub mod decode;
pub mod digits;
pub mod fashion;
pub mod folder;
pub mod idx;
pub mod loader;
pub mod registry;
pub mod resize;
pub mod transform;

pub use decode::{RgbImage, decode_rgb, load_rgb, max_decoded_bytes};
pub use digits::{DIGITS_CLASSES, DIGITS_LEN, DIGITS_SIZE, load_digits};
pub use fashion::{
    FASHION_MNIST_CLASSES, FASHION_MNIST_DEBIAN_DIR, FASHION_MNIST_ENV, FASHION_MNIST_MEAN,
    FASHION_MNIST_STD, FashionMnistFiles, fashion_mnist_files, fashion_mnist_files_in,
    load_fashion_mnist,
};
pub use folder::{IMAGE_EXTENSIONS, ImageFolder, Sample, skip_warning};
pub use idx::{
    IdxImages, idx_to_dataset, parse_idx_images, parse_idx_labels, read_idx_images, read_idx_labels,
};
pub use loader::{Batch, Batches, Dataset, ImageFolderDataset, Loader, Part};
pub use registry::{Data, DataOptions, EvalData, FolderReading, load_data, load_eval_data};
pub use resize::{Window, resize_bilinear, resize_crop_u8};
pub use transform::{
    Augment, IMAGENET_MEAN, IMAGENET_STD, Transform, center_crop_window, eval_resize,
    random_resized_crop_window, resize_shorter, sample_rng,
};

use rand::{RngExt, SeedableRng, rngs::ChaCha8Rng, seq::SliceRandom};

use crate::error::{Error, Result};

/// The (train, val) indices of a seeded split of `0..n`: a ChaCha8 shuffle
/// seeded by `seed`, the first `round(n · val_fraction)` of which are the
/// validation set; both in shuffled order. `op` names the caller in the
/// error for a fraction outside [0, 1).
pub fn seeded_split(
    n: usize,
    val_fraction: f32,
    seed: u64,
    op: &'static str,
) -> Result<(Vec<usize>, Vec<usize>)> {
    if !(val_fraction.is_finite() && (0.0..1.0).contains(&val_fraction)) {
        return Err(Error::invalid(
            op,
            format!("val_fraction must be in [0, 1), got {val_fraction}"),
        ));
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let n_val = ((n as f64 * val_fraction as f64).round() as usize).min(n);
    let train = order.split_off(n_val);
    Ok((train, order))
}

/// An in-memory labelled image set, NHWC f32, already normalised.
#[derive(Clone)]
pub struct InMemoryDataset {
    pub images: Vec<f32>, // (len, h, w, 3)
    pub labels: Vec<usize>,
    pub h: usize,
    pub w: usize,
    pub classes: usize,
}

impl InMemoryDataset {
    /// The same images resized to `size`×`size` by bilinear interpolation
    /// (PyTorch's `align_corners=False` sampling grid, no antialiasing);
    /// a set already at that size is returned unchanged.
    pub fn resized(self, size: usize) -> InMemoryDataset {
        if self.h == size && self.w == size {
            return self;
        }
        let (h, w) = (self.h, self.w);
        let dst_px = size * size * 3;
        let mut images = vec![0.0; self.len() * dst_px];
        for (dst, src) in images
            .chunks_exact_mut(dst_px)
            .zip(self.images.chunks_exact(h * w * 3))
        {
            resize_bilinear(dst, src, w, Window::full(h, w), size, size);
        }
        InMemoryDataset {
            images,
            h: size,
            w: size,
            ..self
        }
    }
}

/// Shapes only: the pixels would flood a test failure message.
impl std::fmt::Debug for InMemoryDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InMemoryDataset")
            .field("len", &self.len())
            .field("h", &self.h)
            .field("w", &self.w)
            .field("classes", &self.classes)
            .field("image_floats", &self.images.len())
            .finish()
    }
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

/// What draws the random numbers of one grating besides its pixel noise.
#[derive(Clone, Copy, Debug)]
struct GratingHeader {
    class: usize,
    freq: f32,
    phase: f32,
    contrast: f32,
    colour: [f32; 3],
}

impl GratingHeader {
    fn draw(r: &mut ChaCha8Rng, size: usize, classes: usize) -> Self {
        let class = r.random_range(0..classes);
        let freq = 2.0 * std::f32::consts::PI * r.random_range(2.0f32..4.0) / size as f32;
        let phase = r.random::<f32>() * 2.0 * std::f32::consts::PI;
        let contrast = r.random_range(0.5f32..1.0);
        let colour: [f32; 3] = [
            r.random_range(0.3f32..1.0),
            r.random_range(0.3f32..1.0),
            r.random_range(0.3f32..1.0),
        ];
        GratingHeader {
            class,
            freq,
            phase,
            contrast,
            colour,
        }
    }

    /// Writes the (size, size, 3) image, drawing its noise from `r`.
    fn render(&self, r: &mut ChaCha8Rng, size: usize, classes: usize, out: &mut [f32]) {
        let angle = std::f32::consts::PI * self.class as f32 / classes as f32;
        let (s, c) = angle.sin_cos();
        let mut px = out.iter_mut();
        for y in 0..size {
            for x in 0..size {
                let v =
                    self.contrast * ((x as f32 * c + y as f32 * s) * self.freq + self.phase).sin();
                for ch in self.colour {
                    if let Some(p) = px.next() {
                        *p = v * ch + 0.3 * (r.random::<f32>() * 2.0 - 1.0);
                    }
                }
            }
        }
    }
}

impl SyntheticGratings {
    /// `len` gratings of `size`², all in memory.
    pub fn generate(len: usize, size: usize, classes: usize, seed: u64) -> InMemoryDataset {
        let mut r = ChaCha8Rng::seed_from_u64(seed);
        let mut images = vec![0.0; len * size * size * 3];
        let mut labels = Vec::with_capacity(len);
        for img in images.chunks_exact_mut(size * size * 3) {
            let h = GratingHeader::draw(&mut r, size, classes);
            h.render(&mut r, size, classes, img);
            labels.push(h.class);
        }
        InMemoryDataset {
            images,
            labels,
            h: size,
            w: size,
            classes,
        }
    }

    /// The same gratings as [`SyntheticGratings::generate`], bit for bit,
    /// made one by one when the loader asks: a synthetic set of any size
    /// holds a few dozen bytes per image instead of the images.
    pub fn on_demand(len: usize, size: usize, classes: usize, seed: u64) -> LazyGratings {
        let mut r = ChaCha8Rng::seed_from_u64(seed);
        // Each noise value is one 32-bit word of the stream, so a sample's
        // noise is skipped by moving the word position past it.
        let noise_words = (size * size * 3) as u128;
        let mut samples = Vec::with_capacity(len);
        for _ in 0..len {
            let h = GratingHeader::draw(&mut r, size, classes);
            let noise_at = r.get_word_pos();
            r.set_word_pos(noise_at + noise_words);
            samples.push((h, noise_at));
        }
        LazyGratings {
            samples,
            size,
            classes,
            seed,
        }
    }
}

/// Gratings rendered per index on demand ([`SyntheticGratings::on_demand`]).
pub struct LazyGratings {
    /// Per sample: its header and where its noise starts in the stream.
    samples: Vec<(GratingHeader, u128)>,
    size: usize,
    classes: usize,
    seed: u64,
}

impl Dataset for LazyGratings {
    fn len(&self) -> usize {
        self.samples.len()
    }

    fn classes(&self) -> usize {
        self.classes
    }

    fn image_hw(&self) -> (usize, usize) {
        (self.size, self.size)
    }

    fn label(&self, i: usize) -> usize {
        self.samples[i].0.class
    }

    fn load(&self, i: usize, _epoch: usize, _position: usize, out: &mut [f32]) -> Result<bool> {
        let px = self.size * self.size * 3;
        if i >= self.samples.len() || out.len() != px {
            return Err(Error::invalid(
                "LazyGratings::load",
                format!(
                    "sample {i} of {} into {} values (want {px})",
                    self.samples.len(),
                    out.len()
                ),
            ));
        }
        let (h, noise_at) = self.samples[i];
        let mut r = ChaCha8Rng::seed_from_u64(self.seed);
        r.set_word_pos(noise_at);
        h.render(&mut r, self.size, self.classes, out);
        Ok(true)
    }
}

#[cfg(test)]
mod synthetic_tests {
    use super::*;

    #[test]
    fn on_demand_gratings_are_the_generated_ones_bit_for_bit() {
        for (len, size, classes, seed) in [(7, 5, 3, 9), (4, 8, 10, 1), (3, 1, 2, 0)] {
            let all = SyntheticGratings::generate(len, size, classes, seed);
            let lazy = SyntheticGratings::on_demand(len, size, classes, seed);
            assert_eq!(lazy.len(), len);
            // Out of order, as a shuffled epoch asks.
            for i in (0..len).rev() {
                let mut out = vec![0.0; size * size * 3];
                assert!(lazy.load(i, 1, 0, &mut out).unwrap());
                let want = all.image(i);
                let same = out
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "sample {i} of ({len}, {size}, {classes}, {seed})");
                assert_eq!(lazy.label(i), all.labels[i]);
            }
        }
        let lazy = SyntheticGratings::on_demand(2, 4, 2, 0);
        assert!(lazy.load(2, 1, 0, &mut [0.0; 48]).is_err());
        assert!(lazy.load(0, 1, 0, &mut [0.0; 5]).is_err());
    }
}

#[cfg(test)]
mod resize_tests {
    use super::*;

    #[test]
    fn bilinear_upsampling_matches_hand_computed_values() {
        // One 2x2 image, all channels equal: [[0, 1], [2, 3]].
        let px = [0.0f32, 1.0, 2.0, 3.0];
        let images: Vec<f32> = px.iter().flat_map(|&v| [v; 3]).collect();
        let d = InMemoryDataset {
            images,
            labels: vec![0],
            h: 2,
            w: 2,
            classes: 1,
        };
        let r = d.clone().resized(4);
        let row0: Vec<f32> = (0..4).map(|x| r.images[x * 3]).collect();
        // Source x for outputs: -0.25 (clamped to 0), 0.25, 0.75, 1.25 (clamped to 1).
        assert_eq!(row0, vec![0.0, 0.25, 0.75, 1.0]);
        let col0: Vec<f32> = (0..4).map(|y| r.images[y * 4 * 3]).collect();
        assert_eq!(col0, vec![0.0, 0.5, 1.5, 2.0]);
        assert_eq!(
            d.clone().resized(2).images,
            d.images,
            "same size passes through"
        );
    }
}
