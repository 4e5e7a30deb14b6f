//! Decoded RGB bytes to one normalised network input (size, size, 3) f32,
//! with torchvision's semantics:
//!
//! - [`Transform::train`]: `RandomResizedCrop(size)` (scale (0.08, 1), ratio
//!   (3/4, 4/3)) then `RandomHorizontalFlip(0.5)`;
//! - [`Transform::eval`]: `Resize(size · 256 / 224)` of the shorter side
//!   then `CenterCrop(size)`, the reference recipe's 256 → 224 for any size
//!   (integer division: 32 → 36, 224 → 256);
//! - [`Transform::no_augment`]: `Resize(size)` then `CenterCrop(size)`; an
//!   image already size×size passes through untouched;
//!
//! each followed by `ToTensor` (÷255) and `Normalize(mean, std)`, ImageNet's
//! by default. Resampling is bilinear without antialiasing
//! ([`super::resize`]), on unrounded values (torchvision on PIL images
//! rounds the resized image to bytes and antialiases when shrinking).
//!
//! Randomness comes from the caller's RNG: [`sample_rng`] derives one per
//! sample from (seed, epoch, position in the epoch), so a sample's crop does
//! not depend on which thread loaded it. Knows nothing of files or batches.

use rand::{RngExt, SeedableRng, rngs::ChaCha8Rng};

use super::decode::RgbImage;
use super::resize::{Window, resize_crop_u8};
use crate::error::{Error, Result};

pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// What happens between decoding and normalising.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Augment {
    /// `RandomResizedCrop(size, scale, ratio)` + `RandomHorizontalFlip(0.5)`.
    RandomResizedCrop {
        scale: (f64, f64),
        ratio: (f64, f64),
    },
    /// Shorter side to `resize`, then the centre `size`×`size`.
    CenterCrop { resize: usize },
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Transform {
    /// Side of the square output.
    pub size: usize,
    pub augment: Augment,
    /// Per channel, on values in [0, 1]: out = (v − mean) / std.
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

/// The eval transform's shorter side for a crop of `size`: 256/224 of it,
/// rounded down.
pub fn eval_resize(size: usize) -> usize {
    size * 256 / 224
}

impl Transform {
    pub fn train(size: usize) -> Transform {
        Transform {
            size,
            augment: Augment::RandomResizedCrop {
                scale: (0.08, 1.0),
                ratio: (3.0 / 4.0, 4.0 / 3.0),
            },
            mean: IMAGENET_MEAN,
            std: IMAGENET_STD,
        }
    }

    pub fn eval(size: usize) -> Transform {
        Transform {
            augment: Augment::CenterCrop {
                resize: eval_resize(size),
            },
            ..Transform::train(size)
        }
    }

    pub fn no_augment(size: usize) -> Transform {
        Transform {
            augment: Augment::CenterCrop { resize: size },
            ..Transform::train(size)
        }
    }

    /// Floats written by [`Transform::apply`].
    pub fn output_len(&self) -> usize {
        self.size * self.size * 3
    }

    /// Writes the transformed, normalised `img` to `out` (size, size, 3).
    /// Only [`Augment::RandomResizedCrop`] draws from `rng`.
    pub fn apply(&self, img: &RgbImage, rng: &mut ChaCha8Rng, out: &mut [f32]) -> Result<()> {
        let s = self.size;
        if out.len() != self.output_len() || s == 0 {
            return Err(Error::ShapeMismatch {
                op: "Transform::apply",
                expected: format!("{s}x{s}x3 floats, size > 0"),
                got: format!("{} floats", out.len()),
            });
        }
        if img.h == 0 || img.w == 0 || img.data.len() != img.h * img.w * 3 {
            return Err(Error::ShapeMismatch {
                op: "Transform::apply",
                expected: format!("{}x{}x3 bytes", img.h, img.w),
                got: format!("{} bytes", img.data.len()),
            });
        }
        // Resampling reads the bytes directly (as f32 in 0..=255) and keeps
        // only the output's pixels, so a large photo costs no f32 copy.
        match self.augment {
            Augment::RandomResizedCrop { scale, ratio } => {
                let win = random_resized_crop_window(img.h, img.w, scale, ratio, rng);
                resize_crop_u8(out, &img.data, img.w, win, (s, s), Window::full(s, s));
                if rng.random::<f32>() < 0.5 {
                    flip_horizontal(out, s);
                }
            }
            Augment::CenterCrop { resize } => {
                // Same-size "resampling" is exact (every weight is 0 or 1),
                // so an image already at the output size passes through.
                let (h, w) = resize_shorter(img.h, img.w, resize.max(s));
                let crop = center_crop_window(h, w, s, s);
                let win = Window::full(img.h, img.w);
                resize_crop_u8(out, &img.data, img.w, win, (h, w), crop);
            }
        }
        // ToTensor (÷255), then Normalize.
        for px in out.chunks_exact_mut(3) {
            for ((v, mean), std) in px.iter_mut().zip(self.mean).zip(self.std) {
                *v = (*v / 255.0 - mean) / std;
            }
        }
        Ok(())
    }
}

/// torchvision's `RandomResizedCrop.get_params`: up to 10 draws of an area
/// fraction in `scale` and a log-uniform aspect ratio (w/h) in `ratio`,
/// kept if the rounded box fits, at a uniform position; otherwise the
/// central crop of the whole image clamped to the ratio range. Draws are f32
/// as torch's; `round` is Python's (half to even).
pub fn random_resized_crop_window(
    h: usize,
    w: usize,
    scale: (f64, f64),
    ratio: (f64, f64),
    rng: &mut ChaCha8Rng,
) -> Window {
    let area = (h * w) as f64;
    let log_ratio = ((ratio.0 as f32).ln(), (ratio.1 as f32).ln());
    for _ in 0..10 {
        let target_area = area * uniform_f32(rng, scale.0 as f32, scale.1 as f32) as f64;
        let aspect = uniform_f32(rng, log_ratio.0, log_ratio.1).exp() as f64;
        let cw = (target_area * aspect).sqrt().round_ties_even() as usize;
        let ch = (target_area / aspect).sqrt().round_ties_even() as usize;
        if 0 < cw && cw <= w && 0 < ch && ch <= h {
            let top = rng.random_range(0..=h - ch);
            let left = rng.random_range(0..=w - cw);
            return Window {
                top,
                left,
                h: ch,
                w: cw,
            };
        }
    }
    let in_ratio = w as f64 / h as f64;
    let (lo, hi) = (ratio.0.min(ratio.1), ratio.0.max(ratio.1));
    let (ch, cw) = if in_ratio < lo {
        ((w as f64 / lo).round_ties_even() as usize, w)
    } else if in_ratio > hi {
        (h, (h as f64 * hi).round_ties_even() as usize)
    } else {
        (h, w)
    };
    // Rounding cannot grow the box past the image, but keep it non-empty.
    let (ch, cw) = (ch.clamp(1, h), cw.clamp(1, w));
    Window {
        top: (h - ch) / 2,
        left: (w - cw) / 2,
        h: ch,
        w: cw,
    }
}

/// `torch.empty(1).uniform_(lo, hi)`: uniform in [lo, hi) (a degenerate
/// range gives lo, as torch does).
fn uniform_f32(rng: &mut ChaCha8Rng, lo: f32, hi: f32) -> f32 {
    if hi > lo {
        rng.random_range(lo..hi)
    } else {
        lo
    }
}

/// torchvision's `Resize(short)` output (h, w): the shorter side becomes
/// `short`, the longer `⌊short · long / shorter⌋`.
pub fn resize_shorter(h: usize, w: usize, short: usize) -> (usize, usize) {
    if h <= w {
        (short, short * w / h)
    } else {
        (short * h / w, short)
    }
}

/// torchvision's `CenterCrop`: offsets `round((side − crop) / 2)`, Python
/// rounding (half to even), so a 9-wide image cropped to 4 starts at 2.
/// The crop must fit (both callers resize first so that it does).
pub fn center_crop_window(h: usize, w: usize, ch: usize, cw: usize) -> Window {
    let offset = |side: usize, crop: usize| ((side - crop) as f64 / 2.0).round_ties_even() as usize;
    Window {
        top: offset(h, ch),
        left: offset(w, cw),
        h: ch,
        w: cw,
    }
}

/// Mirrors each row of a (size, size, 3) image.
fn flip_horizontal(img: &mut [f32], size: usize) {
    for row in img.chunks_exact_mut(size * 3) {
        for x in 0..size / 2 {
            for c in 0..3 {
                row.swap(x * 3 + c, (size - 1 - x) * 3 + c);
            }
        }
    }
}

/// SplitMix64's output function: a bijective mix of 64 bits.
fn splitmix64(z: u64) -> u64 {
    let z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The RNG of the sample at `position` of `epoch`'s order: depends on
/// nothing else (not the worker, not the batch), so any number of loader
/// threads produce the same crops.
pub fn sample_rng(seed: u64, epoch: usize, position: usize) -> ChaCha8Rng {
    let key = splitmix64(splitmix64(splitmix64(seed) ^ epoch as u64) ^ position as u64);
    ChaCha8Rng::seed_from_u64(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resize_shorter_truncates_like_torchvision() {
        assert_eq!(resize_shorter(375, 500, 256), (256, 341)); // 341.33
        assert_eq!(resize_shorter(500, 375, 256), (341, 256));
        assert_eq!(resize_shorter(100, 100, 36), (36, 36));
        assert_eq!(eval_resize(224), 256);
        assert_eq!(eval_resize(32), 36);
        assert_eq!(eval_resize(128), 146);
    }

    #[test]
    fn center_crop_rounds_half_to_even() {
        assert_eq!(center_crop_window(4, 9, 4, 4).left, 2); // 2.5 -> 2
        assert_eq!(center_crop_window(4, 7, 4, 4).left, 2); // 1.5 -> 2
        assert_eq!(center_crop_window(8, 4, 4, 4).top, 2);
        assert_eq!(center_crop_window(4, 4, 4, 4), Window::full(4, 4));
    }

    #[test]
    fn flip_mirrors_rows() {
        let mut img: Vec<f32> = (0..3 * 3 * 3).map(|i| i as f32).collect();
        flip_horizontal(&mut img, 3);
        assert_eq!(&img[..9], &[6.0, 7.0, 8.0, 3.0, 4.0, 5.0, 0.0, 1.0, 2.0]);
    }

    #[test]
    fn sample_rngs_differ_by_every_coordinate() {
        let first = |s, e, p| sample_rng(s, e, p).random::<u64>();
        let base = first(1, 2, 3);
        assert_eq!(base, first(1, 2, 3));
        assert_ne!(base, first(0, 2, 3));
        assert_ne!(base, first(1, 3, 3));
        assert_ne!(base, first(1, 2, 4));
        assert_ne!(first(0, 1, 0), first(0, 0, 1));
    }

    fn image(h: usize, w: usize, f: impl Fn(usize, usize, usize) -> u8) -> RgbImage {
        let data = (0..h * w * 3)
            .map(|i| f(i / 3 / w, i / 3 % w, i % 3))
            .collect();
        RgbImage { h, w, data }
    }

    fn normalised(t: &Transform, v: u8, c: usize) -> f32 {
        (v as f32 / 255.0 - t.mean[c]) / t.std[c]
    }

    #[test]
    fn random_crops_respect_scale_and_ratio_over_many_seeds() {
        let (scale, ratio) = ((0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0));
        for (h, w) in [(224, 224), (375, 500), (64, 48), (17, 93), (5, 5)] {
            let area = (h * w) as f64;
            for seed in 0..500 {
                let mut rng = sample_rng(seed, 0, 0);
                let win = random_resized_crop_window(h, w, scale, ratio, &mut rng);
                assert!(win.h >= 1 && win.w >= 1, "{win:?}");
                assert!(
                    win.top + win.h <= h && win.left + win.w <= w,
                    "{h}x{w}: {win:?}"
                );
                if win == Window::full(h, w) || (win.h == h && w * 3 > h * 4) {
                    continue; // the fallback, checked below
                }
                // Rounding each side moves the area and ratio by at most
                // half a pixel per side.
                let (ch, cw) = (win.h as f64, win.w as f64);
                let slack = |x: f64| (x + 0.5) / (x - 0.5).max(0.5);
                let frac = ch * cw / area;
                assert!(frac <= scale.1 * slack(ch) * slack(cw), "{h}x{w} {win:?}");
                assert!(frac >= scale.0 / (slack(ch) * slack(cw)), "{h}x{w} {win:?}");
                let r = cw / ch;
                assert!(r <= ratio.1 * slack(cw) * slack(ch), "{h}x{w} {win:?}");
                assert!(r >= ratio.0 / (slack(cw) * slack(ch)), "{h}x{w} {win:?}");
            }
        }
    }

    #[test]
    fn random_crop_positions_cover_the_image() {
        // Over many seeds the crops start at many offsets and reach both edges.
        let (mut tops, mut rights) = (std::collections::HashSet::new(), 0);
        for seed in 0..300 {
            let win = random_resized_crop_window(
                40,
                40,
                (0.08, 1.0),
                (0.75, 4.0 / 3.0),
                &mut sample_rng(seed, 1, 2),
            );
            tops.insert(win.top);
            rights = rights.max(win.left + win.w);
        }
        assert!(tops.len() > 15 && tops.contains(&0), "{tops:?}");
        assert_eq!(rights, 40);
    }

    #[test]
    fn random_crop_fallback_is_the_clamped_central_crop() {
        let (scale, ratio) = ((0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0));
        // Too wide for any 3:4..4:3 box of 8% of the area: the fallback
        // keeps the full height and a 4:3 width, centred.
        for seed in 0..50 {
            let mut rng = sample_rng(seed, 0, 0);
            let win = random_resized_crop_window(3, 300, scale, ratio, &mut rng);
            assert_eq!(
                win,
                Window {
                    top: 0,
                    left: 148,
                    h: 3,
                    w: 4
                }
            );
            // Too tall: full width, height w / (3/4) rounded half to even.
            let win = random_resized_crop_window(300, 3, scale, ratio, &mut rng);
            assert_eq!(
                win,
                Window {
                    top: 148,
                    left: 0,
                    h: 4,
                    w: 3
                }
            );
        }
        // An area fraction above 1 never fits; the ratio is in range, so the
        // fallback is the whole image.
        let win = random_resized_crop_window(50, 60, (1.5, 2.0), ratio, &mut sample_rng(0, 0, 0));
        assert_eq!(win, Window::full(50, 60));
        // Fallback rounding: 10 / (3/4) = 13.33 -> 13 rows of a 100x10 image.
        let win = random_resized_crop_window(100, 10, (1.5, 2.0), ratio, &mut sample_rng(0, 0, 0));
        assert_eq!(
            win,
            Window {
                top: 43,
                left: 0,
                h: 13,
                w: 10
            }
        );
    }

    #[test]
    fn eval_transform_resizes_then_takes_the_centre() {
        // 4x9 image; eval(4) resizes the shorter side to 4*256/224 = 4, so
        // nothing is resampled, and crops columns 2..6 (offset 2.5 -> 2).
        let img = image(4, 9, |y, x, c| (10 * y + x + 100 * c) as u8);
        let t = Transform::eval(4);
        let mut out = vec![0.0; t.output_len()];
        t.apply(&img, &mut sample_rng(0, 0, 0), &mut out).unwrap();
        for y in 0..4 {
            for x in 0..4 {
                for c in 0..3 {
                    let want = normalised(&t, (10 * y + x + 2 + 100 * c) as u8, c);
                    assert_eq!(out[(y * 4 + x) * 3 + c], want, "({y},{x},{c})");
                }
            }
        }
        // Output size for a real resize: 50x80 -> shorter side 36 for 32.
        let t = Transform::eval(32);
        let mut out = vec![0.0; t.output_len()];
        let img = image(50, 80, |y, x, _| ((x + y) % 256) as u8);
        t.apply(&img, &mut sample_rng(0, 0, 0), &mut out).unwrap();
        assert!(out.iter().all(|v| v.is_finite()));
        assert!(
            t.apply(&img, &mut sample_rng(0, 0, 0), &mut out[1..])
                .is_err()
        );
    }

    #[test]
    fn eval_crop_of_a_resized_image_matches_resize_then_crop() {
        // 6x12 upscaled for eval(7): shorter side 8, so 8x16, centre 7x7 at
        // (round(0.5) = 0, round(4.5) = 4).
        let img = image(6, 12, |y, x, c| (7 * y + 3 * x + c) as u8);
        let t = Transform {
            mean: [0.0; 3],
            std: [1.0; 3],
            ..Transform::eval(7)
        };
        assert_eq!(eval_resize(7), 8);
        let mut out = vec![0.0; t.output_len()];
        t.apply(&img, &mut sample_rng(0, 0, 0), &mut out).unwrap();
        let src: Vec<f32> = img.data.iter().map(|&v| v as f32).collect();
        let mut full = vec![0.0; 8 * 16 * 3];
        super::super::resize_bilinear(&mut full, &src, 12, Window::full(6, 12), 8, 16);
        for y in 0..7 {
            for x in 0..7 {
                let start = (y * 16 + x + 4) * 3;
                let want: Vec<f32> = full[start..start + 3].iter().map(|v| v / 255.0).collect();
                assert_eq!(&out[(y * 7 + x) * 3..][..3], &want[..]);
            }
        }
    }

    #[test]
    fn no_augment_passes_a_square_image_through_bit_unchanged() {
        let img = image(5, 5, |y, x, c| (37 * y + 11 * x + 90 * c) as u8);
        let t = Transform::no_augment(5);
        let mut out = vec![0.0; t.output_len()];
        t.apply(&img, &mut sample_rng(3, 4, 5), &mut out).unwrap();
        let want: Vec<f32> = img
            .data
            .iter()
            .enumerate()
            .map(|(i, &v)| normalised(&t, v, i % 3))
            .collect();
        assert_eq!(out, want);
    }

    #[test]
    fn train_transform_is_a_function_of_the_rng_and_flips_half_the_time() {
        let img = image(30, 40, |y, x, c| (y * 5 + x * 3 + c * 50) as u8);
        let t = Transform::train(16);
        let run = |seed| {
            let mut out = vec![0.0; t.output_len()];
            t.apply(&img, &mut sample_rng(seed, 0, 0), &mut out)
                .unwrap();
            out
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        // A pixel value rises left to right unless the crop was flipped.
        let flipped = (0..200)
            .filter(|&s| {
                let o = run(s);
                o[0] > o[15 * 3]
            })
            .count();
        assert!((70..130).contains(&flipped), "{flipped} of 200 flipped");
    }
}
