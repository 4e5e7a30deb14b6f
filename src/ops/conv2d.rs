//! 2-D convolution, NHWC activations, HWIO weights, no bias, groups 1.
//!
//! The weight is a (K = kh·kw·cin, cout) row-major matrix, so one output row
//! (one pixel, all output channels) is a patch row times the weight:
//! * 1×1 stride-1 convolutions are a single GEMM on the activation itself;
//! * every other shape goes through im2col in tiles of `tile_rows` output
//!   pixels, so the workspace stays bounded (and is allocated by the caller
//!   from the pool, where it is counted).

use rayon::prelude::*;

use crate::device::cpu::{Accumulate, MatRef, gemm_f32};
use crate::error::{Error, Result};
use crate::profile::{Family, timed};

/// Target floats per im2col tile (4 MiB): large enough for GEMM efficiency,
/// small enough to stay in cache-friendly territory and cheap to hold.
const TILE_FLOATS: usize = 1 << 20;

/// Everything that determines a convolution's shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvGeom {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub cin: usize,
    pub cout: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: usize,
    pub pad: usize,
}

impl ConvGeom {
    pub fn validate(&self) -> Result<()> {
        if self.stride == 0 || self.kh == 0 || self.kw == 0 {
            return Err(Error::invalid(
                "conv2d",
                format!("degenerate geometry {self:?}"),
            ));
        }
        if self.h + 2 * self.pad < self.kh || self.w + 2 * self.pad < self.kw {
            return Err(Error::invalid(
                "conv2d",
                format!(
                    "input {}x{} (padding {}) is smaller than the {}x{} kernel",
                    self.h, self.w, self.pad, self.kh, self.kw
                ),
            ));
        }
        Ok(())
    }

    pub fn oh(&self) -> usize {
        (self.h + 2 * self.pad - self.kh) / self.stride + 1
    }

    pub fn ow(&self) -> usize {
        (self.w + 2 * self.pad - self.kw) / self.stride + 1
    }

    /// GEMM rows: output pixels over the batch.
    pub fn rows(&self) -> usize {
        self.n * self.oh() * self.ow()
    }

    /// GEMM inner dimension: one patch.
    pub fn k(&self) -> usize {
        self.kh * self.kw * self.cin
    }

    pub fn input_len(&self) -> usize {
        self.n * self.h * self.w * self.cin
    }

    pub fn output_len(&self) -> usize {
        self.rows() * self.cout
    }

    pub fn weight_len(&self) -> usize {
        self.k() * self.cout
    }

    /// A 1×1 stride-1 unpadded convolution needs no im2col.
    pub fn is_pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.stride == 1 && self.pad == 0
    }

    /// Output pixels per im2col tile.
    pub fn tile_rows(&self) -> usize {
        (TILE_FLOATS / self.k()).max(64).min(self.rows().max(1))
    }

    /// f32 elements of workspace `conv2d_forward` needs.
    pub fn forward_workspace_len(&self) -> usize {
        if self.is_pointwise() {
            0
        } else {
            self.tile_rows() * self.k()
        }
    }

    /// f32 elements of workspace `conv2d_backward` needs (patches and their
    /// gradient, one tile each).
    pub fn backward_workspace_len(&self) -> usize {
        2 * self.forward_workspace_len()
    }

    /// Multiply-adds of the forward pass (the dgrad and wgrad are the same).
    pub fn macs(&self) -> usize {
        self.rows() * self.k() * self.cout
    }
}

/// Copy the patches of output rows `row0..row0+rows` into `col` (rows, K).
fn im2col_tile(col: &mut [f32], x: &[f32], g: &ConvGeom, row0: usize, rows: usize) {
    let (oh, ow, k, cin) = (g.oh(), g.ow(), g.k(), g.cin);
    col[..rows * k]
        .par_chunks_mut(k)
        .enumerate()
        .for_each(|(i, patch)| {
            let r = row0 + i;
            let (n, oy, ox) = (r / (oh * ow), (r / ow) % oh, r % ow);
            for ky in 0..g.kh {
                let iy = (oy * g.stride + ky) as isize - g.pad as isize;
                for kx in 0..g.kw {
                    let ix = (ox * g.stride + kx) as isize - g.pad as isize;
                    let dst = &mut patch[(ky * g.kw + kx) * cin..][..cin];
                    if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
                        dst.fill(0.0);
                    } else {
                        let src = ((n * g.h + iy as usize) * g.w + ix as usize) * cin;
                        dst.copy_from_slice(&x[src..src + cin]);
                    }
                }
            }
        });
}

/// Scatter-add patch gradients `dcol` (rows, K) back into `dx`. Patches
/// overlap, so this runs sequentially.
fn col2im_tile(dx: &mut [f32], dcol: &[f32], g: &ConvGeom, row0: usize, rows: usize) {
    let (oh, ow, k, cin) = (g.oh(), g.ow(), g.k(), g.cin);
    for (i, patch) in dcol[..rows * k].chunks_exact(k).enumerate() {
        let r = row0 + i;
        let (n, oy, ox) = (r / (oh * ow), (r / ow) % oh, r % ow);
        for ky in 0..g.kh {
            let iy = (oy * g.stride + ky) as isize - g.pad as isize;
            if iy < 0 || iy >= g.h as isize {
                continue;
            }
            for kx in 0..g.kw {
                let ix = (ox * g.stride + kx) as isize - g.pad as isize;
                if ix < 0 || ix >= g.w as isize {
                    continue;
                }
                let dst = ((n * g.h + iy as usize) * g.w + ix as usize) * cin;
                let src = &patch[(ky * g.kw + kx) * cin..][..cin];
                for (d, s) in dx[dst..dst + cin].iter_mut().zip(src) {
                    *d += s;
                }
            }
        }
    }
}

fn check_lens(g: &ConvGeom, y: usize, x: usize, w: usize) {
    assert_eq!(y, g.output_len(), "conv2d: output length for {g:?}");
    assert_eq!(x, g.input_len(), "conv2d: input length for {g:?}");
    assert_eq!(w, g.weight_len(), "conv2d: weight length for {g:?}");
}

/// y (n, oh, ow, cout) = conv(x (n, h, w, cin), w (kh, kw, cin, cout)).
/// `ws` holds at least `g.forward_workspace_len()` floats.
pub fn conv2d_forward(y: &mut [f32], x: &[f32], w: &[f32], g: &ConvGeom, ws: &mut [f32]) {
    timed(Family::ConvForward, 2 * g.macs() as u64, || {
        conv2d_forward_untimed(y, x, w, g, ws)
    })
}

fn conv2d_forward_untimed(y: &mut [f32], x: &[f32], w: &[f32], g: &ConvGeom, ws: &mut [f32]) {
    check_lens(g, y.len(), x.len(), w.len());
    let wm = MatRef::row_major(w, g.k(), g.cout);
    if g.is_pointwise() {
        gemm_f32(y, MatRef::row_major(x, g.rows(), g.cin), wm, Accumulate::No);
        return;
    }
    let (k, tile) = (g.k(), g.tile_rows());
    assert!(ws.len() >= tile * k, "conv2d_forward: workspace too small");
    for row0 in (0..g.rows()).step_by(tile) {
        let rows = tile.min(g.rows() - row0);
        im2col_tile(ws, x, g, row0, rows);
        let col = MatRef::row_major(&ws[..rows * k], rows, k);
        gemm_f32(
            &mut y[row0 * g.cout..(row0 + rows) * g.cout],
            col,
            wm,
            Accumulate::No,
        );
    }
}

/// Gradients of a convolution. `dw += xᵀ-patches · dy`; when `dx` is given,
/// `dx += dy · wᵀ` scattered back (it accumulates, for residual fan-in).
/// `ws` holds at least `g.backward_workspace_len()` floats.
pub fn conv2d_backward(
    dx: Option<&mut [f32]>,
    dw: &mut [f32],
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    g: &ConvGeom,
    ws: &mut [f32],
) {
    check_lens(g, dy.len(), x.len(), w.len());
    assert_eq!(dw.len(), w.len(), "conv2d_backward: dw length");
    let (k, cout) = (g.k(), g.cout);
    let w_t = MatRef::row_major(w, k, cout).t();
    if g.is_pointwise() {
        let rows = g.rows();
        let dym = MatRef::row_major(dy, rows, cout);
        let flops = 2 * g.macs() as u64;
        timed(Family::ConvWgrad, flops, || {
            gemm_f32(
                dw,
                MatRef::row_major(x, rows, g.cin).t(),
                dym,
                Accumulate::Yes,
            )
        });
        if let Some(dx) = dx {
            assert_eq!(dx.len(), x.len(), "conv2d_backward: dx length");
            timed(Family::ConvDgrad, flops, || {
                gemm_f32(dx, dym, w_t, Accumulate::Yes)
            });
        }
        return;
    }
    let tile = g.tile_rows();
    assert!(
        ws.len() >= 2 * tile * k,
        "conv2d_backward: workspace too small"
    );
    let (col, dcol) = ws.split_at_mut(tile * k);
    let mut dx = dx;
    for row0 in (0..g.rows()).step_by(tile) {
        let rows = tile.min(g.rows() - row0);
        let dy_tile = MatRef::row_major(&dy[row0 * cout..(row0 + rows) * cout], rows, cout);
        let flops = 2 * (rows * k * cout) as u64;
        timed(Family::ConvWgrad, flops, || {
            im2col_tile(col, x, g, row0, rows);
            let col_t = MatRef::row_major(&col[..rows * k], rows, k).t();
            gemm_f32(dw, col_t, dy_tile, Accumulate::Yes);
        });
        if let Some(dx) = dx.as_deref_mut() {
            timed(Family::ConvDgrad, flops, || {
                gemm_f32(&mut dcol[..rows * k], dy_tile, w_t, Accumulate::No);
                col2im_tile(dx, dcol, g, row0, rows);
            });
        }
    }
}

/// PyTorch's OIHW weight layout to ours (HWIO).
pub fn oihw_to_hwio(oihw: &[f32], cout: usize, cin: usize, kh: usize, kw: usize) -> Vec<f32> {
    let mut out = vec![0.0; oihw.len()];
    for co in 0..cout {
        for ci in 0..cin {
            for ky in 0..kh {
                for kx in 0..kw {
                    out[((ky * kw + kx) * cin + ci) * cout + co] =
                        oihw[((co * cin + ci) * kh + ky) * kw + kx];
                }
            }
        }
    }
    out
}

/// Ours (HWIO) to PyTorch's OIHW.
pub fn hwio_to_oihw(hwio: &[f32], cout: usize, cin: usize, kh: usize, kw: usize) -> Vec<f32> {
    let mut out = vec![0.0; hwio.len()];
    for co in 0..cout {
        for ci in 0..cin {
            for ky in 0..kh {
                for kx in 0..kw {
                    out[((co * cin + ci) * kh + ky) * kw + kx] =
                        hwio[((ky * kw + kx) * cin + ci) * cout + co];
                }
            }
        }
    }
    out
}

/// Naive f64 reference: the definition, loop by loop.
pub fn conv2d_ref(x: &[f64], w: &[f64], g: &ConvGeom) -> Vec<f64> {
    let (oh, ow) = (g.oh(), g.ow());
    let mut y = vec![0.0; g.output_len()];
    for n in 0..g.n {
        for oy in 0..oh {
            for ox in 0..ow {
                for co in 0..g.cout {
                    let mut s = 0.0;
                    for ky in 0..g.kh {
                        for kx in 0..g.kw {
                            let iy = (oy * g.stride + ky) as isize - g.pad as isize;
                            let ix = (ox * g.stride + kx) as isize - g.pad as isize;
                            if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
                                continue;
                            }
                            for ci in 0..g.cin {
                                s += x[((n * g.h + iy as usize) * g.w + ix as usize) * g.cin + ci]
                                    * w[((ky * g.kw + kx) * g.cin + ci) * g.cout + co];
                            }
                        }
                    }
                    y[((n * oh + oy) * ow + ox) * g.cout + co] = s;
                }
            }
        }
    }
    y
}

/// Naive f64 reference gradients: (dx, dw) of `sum(dy * conv(x, w))`.
pub fn conv2d_backward_ref(dy: &[f64], x: &[f64], w: &[f64], g: &ConvGeom) -> (Vec<f64>, Vec<f64>) {
    let (oh, ow) = (g.oh(), g.ow());
    let mut dx = vec![0.0; x.len()];
    let mut dw = vec![0.0; w.len()];
    for n in 0..g.n {
        for oy in 0..oh {
            for ox in 0..ow {
                for co in 0..g.cout {
                    let d = dy[((n * oh + oy) * ow + ox) * g.cout + co];
                    for ky in 0..g.kh {
                        for kx in 0..g.kw {
                            let iy = (oy * g.stride + ky) as isize - g.pad as isize;
                            let ix = (ox * g.stride + kx) as isize - g.pad as isize;
                            if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
                                continue;
                            }
                            for ci in 0..g.cin {
                                let xi = ((n * g.h + iy as usize) * g.w + ix as usize) * g.cin + ci;
                                let wi = ((ky * g.kw + kx) * g.cin + ci) * g.cout + co;
                                dx[xi] += d * w[wi];
                                dw[wi] += d * x[xi];
                            }
                        }
                    }
                }
            }
        }
    }
    (dx, dw)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    #[derive(Clone, Copy, Debug)]
    struct ConvCase {
        n: usize,
        h: usize,
        w: usize,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        pad: usize,
    }

    const CASES: &[ConvCase] = &[
        ConvCase {
            n: 2,
            h: 7,
            w: 5,
            cin: 3,
            cout: 4,
            k: 3,
            stride: 1,
            pad: 1,
        },
        ConvCase {
            n: 1,
            h: 9,
            w: 8,
            cin: 5,
            cout: 6,
            k: 3,
            stride: 2,
            pad: 1,
        },
        ConvCase {
            n: 2,
            h: 13,
            w: 11,
            cin: 3,
            cout: 4,
            k: 7,
            stride: 2,
            pad: 3,
        },
        ConvCase {
            n: 2,
            h: 6,
            w: 5,
            cin: 4,
            cout: 3,
            k: 1,
            stride: 1,
            pad: 0,
        },
        ConvCase {
            n: 3,
            h: 9,
            w: 7,
            cin: 5,
            cout: 6,
            k: 1,
            stride: 2,
            pad: 0,
        },
        ConvCase {
            n: 1,
            h: 4,
            w: 4,
            cin: 2,
            cout: 3,
            k: 3,
            stride: 1,
            pad: 0,
        },
        ConvCase {
            n: 1,
            h: 5,
            w: 6,
            cin: 3,
            cout: 2,
            k: 2,
            stride: 3,
            pad: 1,
        },
    ];

    fn geom(c: &ConvCase) -> ConvGeom {
        ConvGeom {
            n: c.n,
            h: c.h,
            w: c.w,
            cin: c.cin,
            cout: c.cout,
            kh: c.k,
            kw: c.k,
            stride: c.stride,
            pad: c.pad,
        }
    }

    #[test]
    fn forward_and_backward_match_f64_reference() {
        let mut r = rng(1);
        for c in CASES {
            let g = geom(c);
            let x = rand_vec(&mut r, g.input_len());
            let w = rand_vec(&mut r, g.weight_len());
            let dy = rand_vec(&mut r, g.output_len());
            let mut ws = vec![0.0; g.backward_workspace_len()];
            let mut y = vec![0.0; g.output_len()];
            conv2d_forward(&mut y, &x, &w, &g, &mut ws);
            let y_ref = conv2d_ref(&to_f64(&x), &to_f64(&w), &g);
            assert_close(&format!("{c:?} y"), &y, &y_ref, 1e-5, 1e-5);

            // Both gradients accumulate: start from ones and expect ref + 1.
            let mut dx = vec![1.0; x.len()];
            let mut dw = vec![1.0; w.len()];
            conv2d_backward(Some(&mut dx), &mut dw, &dy, &x, &w, &g, &mut ws);
            let (dx_ref, dw_ref) = conv2d_backward_ref(&to_f64(&dy), &to_f64(&x), &to_f64(&w), &g);
            let plus1 = |v: Vec<f64>| v.into_iter().map(|a| a + 1.0).collect::<Vec<_>>();
            assert_close(&format!("{c:?} dx"), &dx, &plus1(dx_ref), 1e-5, 1e-5);
            assert_close(&format!("{c:?} dw"), &dw, &plus1(dw_ref), 1e-4, 1e-5);
        }
    }

    #[test]
    fn tiles_cover_large_row_counts() {
        // K = 7*7*64 makes tile_rows 334, so 2*20*20 = 800 rows take 3 tiles.
        let g = ConvGeom {
            n: 2,
            h: 20,
            w: 20,
            cin: 64,
            cout: 3,
            kh: 7,
            kw: 7,
            stride: 1,
            pad: 3,
        };
        assert!(g.tile_rows() < g.rows());
        let mut r = rng(2);
        let x = rand_vec(&mut r, g.input_len());
        let w = rand_vec(&mut r, g.weight_len());
        let dy = rand_vec(&mut r, g.output_len());
        let mut ws = vec![0.0; g.backward_workspace_len()];
        let mut y = vec![0.0; g.output_len()];
        conv2d_forward(&mut y, &x, &w, &g, &mut ws);
        assert_close(
            "tiled y",
            &y,
            &conv2d_ref(&to_f64(&x), &to_f64(&w), &g),
            1e-4,
            1e-5,
        );
        let mut dx = vec![0.0; x.len()];
        let mut dw = vec![0.0; w.len()];
        conv2d_backward(Some(&mut dx), &mut dw, &dy, &x, &w, &g, &mut ws);
        let (dx_ref, dw_ref) = conv2d_backward_ref(&to_f64(&dy), &to_f64(&x), &to_f64(&w), &g);
        assert_close("tiled dx", &dx, &dx_ref, 1e-4, 1e-5);
        assert_close("tiled dw", &dw, &dw_ref, 1e-3, 1e-5);
    }

    #[test]
    fn reference_backward_matches_finite_differences() {
        let mut r = rng(3);
        for c in &CASES[..3] {
            let g = geom(c);
            let x = to_f64(&rand_vec(&mut r, g.input_len()));
            let w = to_f64(&rand_vec(&mut r, g.weight_len()));
            let dy = to_f64(&rand_vec(&mut r, g.output_len()));
            let (dx, dw) = conv2d_backward_ref(&dy, &x, &w, &g);
            let fd_x = finite_diff(&x, 1e-6, |xp| dot(&conv2d_ref(xp, &w, &g), &dy));
            let fd_w = finite_diff(&w, 1e-6, |wp| dot(&conv2d_ref(&x, wp, &g), &dy));
            assert_close64("fd dx", &dx, &fd_x, 1e-7, 1e-6);
            assert_close64("fd dw", &dw, &fd_w, 1e-7, 1e-6);
        }
    }

    #[test]
    fn weight_layout_round_trips() {
        let oihw: Vec<f32> = (0..4 * 3 * 2 * 5).map(|i| i as f32).collect();
        let hwio = oihw_to_hwio(&oihw, 4, 3, 2, 5);
        assert_ne!(hwio, oihw);
        // Spot check: o=1, i=2, kh=1, kw=3.
        assert_eq!(
            hwio[((5 + 3) * 3 + 2) * 4 + 1],
            oihw[((3 + 2) * 2 + 1) * 5 + 3]
        );
        assert_eq!(hwio_to_oihw(&hwio, 4, 3, 2, 5), oihw);
    }

    #[test]
    fn too_small_input_is_an_error() {
        let g = ConvGeom {
            n: 1,
            h: 2,
            w: 2,
            cin: 1,
            cout: 1,
            kh: 7,
            kw: 7,
            stride: 2,
            pad: 1,
        };
        assert!(
            g.validate()
                .unwrap_err()
                .to_string()
                .contains("smaller than the 7x7 kernel")
        );
    }
}
