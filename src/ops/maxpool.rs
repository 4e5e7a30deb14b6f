//! Max pooling over NHWC. The gradient of each output goes to the *first*
//! maximum of its window in row-major scan order (strict `>`), and padding
//! counts as -inf: exactly PyTorch's choice, which matters for ties.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::ops::ReadF32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolGeom {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub k: usize,
    pub stride: usize,
    pub pad: usize,
}

impl PoolGeom {
    pub fn validate(&self) -> Result<()> {
        if self.h + 2 * self.pad < self.k || self.w + 2 * self.pad < self.k || self.pad * 2 > self.k
        {
            return Err(Error::invalid(
                "maxpool",
                format!("input too small for {self:?}"),
            ));
        }
        Ok(())
    }
    pub fn oh(&self) -> usize {
        (self.h + 2 * self.pad - self.k) / self.stride + 1
    }
    pub fn ow(&self) -> usize {
        (self.w + 2 * self.pad - self.k) / self.stride + 1
    }
    pub fn output_len(&self) -> usize {
        self.n * self.oh() * self.ow() * self.c
    }
    pub fn input_len(&self) -> usize {
        self.n * self.h * self.w * self.c
    }

    /// Valid input rows/cols of output (oy, ox)'s window.
    fn window(&self, oy: usize, ox: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let y0 = (oy * self.stride) as isize - self.pad as isize;
        let x0 = (ox * self.stride) as isize - self.pad as isize;
        let clip = |a: isize, lim: usize| a.clamp(0, lim as isize) as usize;
        (
            clip(y0, self.h)..clip(y0 + self.k as isize, self.h),
            clip(x0, self.w)..clip(x0 + self.k as isize, self.w),
        )
    }
}

/// y (n, oh, ow, c) = max over each window of x (n, h, w, c).
pub fn maxpool_forward(y: &mut [f32], x: &[f32], g: &PoolGeom) {
    let (oh, ow, c) = (g.oh(), g.ow(), g.c);
    y.par_chunks_mut(oh * ow * c)
        .zip(x.par_chunks(g.h * g.w * c))
        .for_each(|(y, x)| {
            for oy in 0..oh {
                for ox in 0..ow {
                    let out = &mut y[(oy * ow + ox) * c..][..c];
                    out.fill(f32::NEG_INFINITY);
                    let (rows, cols) = g.window(oy, ox);
                    for iy in rows {
                        for ix in cols.clone() {
                            let inp = &x[(iy * g.w + ix) * c..][..c];
                            for (o, &v) in out.iter_mut().zip(inp) {
                                if v > *o || v.is_nan() {
                                    *o = v;
                                }
                            }
                        }
                    }
                }
            }
        });
}

/// dx = scatter of dy to the first maximum of each window (overwrites dx).
///
/// The window is scanned in row-major order as in the forward, with the
/// running maximum and its position kept per channel in arrays, so the
/// scan runs along the contiguous channels (it vectorises); each gradient
/// is then added at its argmax, in output order.
pub fn maxpool_backward<D: ReadF32, X: ReadF32>(dx: &mut [f32], dy: &[D], x: &[X], g: &PoolGeom) {
    let (oh, ow, c) = (g.oh(), g.ow(), g.c);
    dx.par_chunks_mut(g.h * g.w * c)
        .zip(x.par_chunks(g.h * g.w * c).zip(dy.par_chunks(oh * ow * c)))
        .for_each(|(dx, (x, dy))| {
            dx.fill(0.0);
            let mut best = vec![f32::NEG_INFINITY; c];
            // Input pixel (iy·w + ix) of each channel's maximum so far;
            // NONE until the first element of the window.
            const NONE: u32 = u32::MAX;
            let mut arg = vec![NONE; c];
            for oy in 0..oh {
                for ox in 0..ow {
                    let (rows, cols) = g.window(oy, ox);
                    best.fill(f32::NEG_INFINITY);
                    arg.fill(NONE);
                    for iy in rows {
                        for ix in cols.clone() {
                            let pix = (iy * g.w + ix) as u32;
                            let inp = &x[pix as usize * c..][..c];
                            for ((b, a), &v) in best.iter_mut().zip(arg.iter_mut()).zip(inp) {
                                let v = v.f32();
                                let take = v > *b || v.is_nan() || *a == NONE;
                                *b = if take { v } else { *b };
                                *a = if take { pix } else { *a };
                            }
                        }
                    }
                    let d = &dy[(oy * ow + ox) * c..][..c];
                    for (ch, (&a, &v)) in arg.iter().zip(d).enumerate() {
                        if a != NONE {
                            dx[a as usize * c + ch] += v.f32();
                        }
                    }
                }
            }
        });
}

/// f64 reference: returns (y, argmax index into x) by the definition.
pub fn maxpool_ref(x: &[f64], g: &PoolGeom) -> (Vec<f64>, Vec<usize>) {
    let (oh, ow) = (g.oh(), g.ow());
    let mut y = vec![0.0; g.output_len()];
    let mut arg = vec![0; g.output_len()];
    for n in 0..g.n {
        for oy in 0..oh {
            for ox in 0..ow {
                for ch in 0..g.c {
                    let mut best = f64::NEG_INFINITY;
                    let mut best_i = usize::MAX;
                    for ky in 0..g.k {
                        for kx in 0..g.k {
                            let iy = (oy * g.stride + ky) as isize - g.pad as isize;
                            let ix = (ox * g.stride + kx) as isize - g.pad as isize;
                            if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
                                continue;
                            }
                            let i = ((n * g.h + iy as usize) * g.w + ix as usize) * g.c + ch;
                            if x[i] > best {
                                best = x[i];
                                best_i = i;
                            }
                        }
                    }
                    let o = ((n * oh + oy) * ow + ox) * g.c + ch;
                    y[o] = best;
                    arg[o] = best_i;
                }
            }
        }
    }
    (y, arg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    #[test]
    fn matches_reference_with_ties() {
        let mut r = rng(40);
        for g in [
            PoolGeom {
                n: 2,
                h: 9,
                w: 9,
                c: 3,
                k: 3,
                stride: 2,
                pad: 1,
            },
            PoolGeom {
                n: 1,
                h: 8,
                w: 7,
                c: 2,
                k: 3,
                stride: 2,
                pad: 1,
            },
            PoolGeom {
                n: 1,
                h: 5,
                w: 6,
                c: 4,
                k: 2,
                stride: 2,
                pad: 0,
            },
            // More channels than one vector, with a ragged tail.
            PoolGeom {
                n: 2,
                h: 7,
                w: 6,
                c: 37,
                k: 3,
                stride: 2,
                pad: 1,
            },
        ] {
            // Values from {0, 1, 2}: most windows hold ties.
            let x: Vec<f32> = rand_vec(&mut r, g.input_len())
                .iter()
                .map(|v| ((v + 1.0) * 1.5).floor())
                .collect();
            let dy = rand_vec(&mut r, g.output_len());
            let mut y = vec![0.0; g.output_len()];
            maxpool_forward(&mut y, &x, &g);
            let (y_ref, arg) = maxpool_ref(&to_f64(&x), &g);
            assert_close("y", &y, &y_ref, 0.0, 0.0);
            let mut dx = vec![7.0; g.input_len()];
            maxpool_backward(&mut dx, &dy, &x, &g);
            let mut dx_ref = vec![0.0; g.input_len()];
            for (o, &i) in arg.iter().enumerate() {
                dx_ref[i] += dy[o] as f64;
            }
            assert_close("dx", &dx, &dx_ref, 1e-6, 0.0);
        }
    }

    #[test]
    fn gradient_matches_finite_differences_without_ties() {
        let mut r = rng(41);
        let g = PoolGeom {
            n: 1,
            h: 5,
            w: 5,
            c: 2,
            k: 3,
            stride: 2,
            pad: 1,
        };
        // Distinct values, so the max is differentiable.
        let x: Vec<f64> = (0..g.input_len())
            .map(|i| (i * 37 % 50) as f64 / 10.0)
            .collect();
        let dy = to_f64(&rand_vec(&mut r, g.output_len()));
        let fd = finite_diff(&x, 1e-6, |p| dot(&maxpool_ref(p, &g).0, &dy));
        let mut dx = vec![0.0; g.input_len()];
        let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let dy32: Vec<f32> = dy.iter().map(|&v| v as f32).collect();
        maxpool_backward(&mut dx, &dy32, &x32, &g);
        assert_close("fd maxpool", &dx, &fd, 1e-5, 1e-5);
    }
}
