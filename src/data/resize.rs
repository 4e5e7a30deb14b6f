//! Bilinear resampling of one interleaved 3-channel f32 image, shared by
//! [`super::InMemoryDataset::resized`] and the file transforms in
//! [`super::transform`]. Knows nothing of datasets or randomness.
//!
//! PyTorch's `interpolate(mode="bilinear", align_corners=False)` sampling
//! grid without antialiasing: output pixel `o` of `n_out` samples the source
//! at `(o + 0.5) · n_in / n_out − 0.5`, clamped to the window. Downscaling by
//! a large factor therefore aliases (PIL's bilinear, used by torchvision on
//! PIL images, widens its filter instead).

/// A rectangle of an image, in pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub top: usize,
    pub left: usize,
    pub h: usize,
    pub w: usize,
}

impl Window {
    /// The whole of an `h`×`w` image.
    pub fn full(h: usize, w: usize) -> Window {
        Window {
            top: 0,
            left: 0,
            h,
            w,
        }
    }
}

/// The two source indices (relative to the window) and the weight of the
/// second for output coordinate `o`.
fn coord(o: usize, n_in: usize, n_out: usize) -> (usize, usize, f32) {
    let x = ((o as f32 + 0.5) * n_in as f32 / n_out as f32 - 0.5).max(0.0);
    let i0 = (x.floor() as usize).min(n_in - 1);
    let i1 = (i0 + 1).min(n_in - 1);
    (i0, i1, x - i0 as f32)
}

/// Writes `dst` (out_h, out_w, 3) by bilinear sampling of the `win` part of
/// `src` (rows of `src_w` pixels, 3 channels interleaved), as if the window
/// had been cropped out first (samples never reach outside it).
///
/// `win` must lie inside `src` and be non-empty, and `dst` must hold
/// `out_h · out_w · 3` values; callers derive all three from the image, so
/// a violation is a bug and panics.
pub fn resize_bilinear(
    dst: &mut [f32],
    src: &[f32],
    src_w: usize,
    win: Window,
    out_h: usize,
    out_w: usize,
) {
    assert!((win.top + win.h) * src_w * 3 <= src.len());
    resample(
        dst,
        |i| src[i],
        src_w,
        win,
        (out_h, out_w),
        Window::full(out_h, out_w),
    );
}

/// The `crop` part of what [`resize_bilinear`] would make of the `win` part
/// of the bytes `src`, as f32 in 0..=255, without the rest: a crop of a
/// large resize costs only its own pixels. `dst` holds `crop.h · crop.w · 3`
/// values; `crop` must lie inside `out` (h, w).
pub fn resize_crop_u8(
    dst: &mut [f32],
    src: &[u8],
    src_w: usize,
    win: Window,
    out: (usize, usize),
    crop: Window,
) {
    assert!((win.top + win.h) * src_w * 3 <= src.len());
    resample(dst, |i| src[i] as f32, src_w, win, out, crop);
}

fn resample(
    dst: &mut [f32],
    px: impl Fn(usize) -> f32,
    src_w: usize,
    win: Window,
    (out_h, out_w): (usize, usize),
    crop: Window,
) {
    assert!(win.h > 0 && win.w > 0 && win.left + win.w <= src_w);
    assert!(crop.top + crop.h <= out_h && crop.left + crop.w <= out_w);
    assert_eq!(dst.len(), crop.h * crop.w * 3);
    let xs: Vec<(usize, usize, f32)> = (crop.left..crop.left + crop.w)
        .map(|o| coord(o, win.w, out_w))
        .collect();
    let at = |y: usize, x: usize, c: usize| px(((win.top + y) * src_w + win.left + x) * 3 + c);
    for (row, oy) in dst.chunks_exact_mut(crop.w * 3).zip(crop.top..) {
        let (y0, y1, fy) = coord(oy, win.h, out_h);
        for (out, &(x0, x1, fx)) in row.chunks_exact_mut(3).zip(&xs) {
            for (c, v) in out.iter_mut().enumerate() {
                let top = at(y0, x0, c) * (1.0 - fx) + at(y0, x1, c) * fx;
                let bottom = at(y1, x0, c) * (1.0 - fx) + at(y1, x1, c) * fx;
                *v = top * (1.0 - fy) + bottom * fy;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One channel of an image whose three channels are equal.
    fn gray(values: &[f32]) -> Vec<f32> {
        values.iter().flat_map(|&v| [v; 3]).collect()
    }

    #[test]
    fn window_samples_stay_inside_the_window() {
        // 3x4 image with values 10*y + x; window rows 1..3, cols 1..3.
        let src = gray(
            &(0..12)
                .map(|i| (10 * (i / 4) + i % 4) as f32)
                .collect::<Vec<_>>(),
        );
        let win = Window {
            top: 1,
            left: 1,
            h: 2,
            w: 2,
        };
        let mut dst = vec![0.0; 4 * 4 * 3];
        resize_bilinear(&mut dst, &src, 4, win, 4, 4);
        let row0: Vec<f32> = dst.chunks(3).take(4).map(|p| p[0]).collect();
        // Source columns 1, 1.25, 1.75, 2 (clamped at the window's edges).
        assert_eq!(row0, vec![11.0, 11.25, 11.75, 12.0]);
        let col0: Vec<f32> = dst.chunks(3).step_by(4).map(|p| p[0]).collect();
        assert_eq!(col0, vec![11.0, 13.5, 18.5, 21.0]);
    }

    #[test]
    fn same_size_is_an_exact_copy() {
        let src: Vec<f32> = (0..5 * 7 * 3).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut dst = vec![0.0; src.len()];
        resize_bilinear(&mut dst, &src, 7, Window::full(5, 7), 5, 7);
        assert_eq!(dst, src);
    }

    #[test]
    fn a_crop_of_the_resize_is_the_resize_cropped() {
        let src: Vec<u8> = (0..6 * 9 * 3).map(|i| (i * 37 % 251) as u8).collect();
        let as_f32: Vec<f32> = src.iter().map(|&v| v as f32).collect();
        let win = Window {
            top: 1,
            left: 2,
            h: 5,
            w: 6,
        };
        let mut full = vec![0.0; 11 * 13 * 3];
        resize_bilinear(&mut full, &as_f32, 9, win, 11, 13);
        let crop = Window {
            top: 3,
            left: 4,
            h: 7,
            w: 5,
        };
        let mut part = vec![0.0; 7 * 5 * 3];
        resize_crop_u8(&mut part, &src, 9, win, (11, 13), crop);
        for y in 0..7 {
            let start = ((crop.top + y) * 13 + crop.left) * 3;
            assert_eq!(&part[y * 15..(y + 1) * 15], &full[start..start + 15]);
        }
    }
}
