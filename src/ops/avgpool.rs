//! Global average pooling: (n, h·w, c) -> (n, c).

use rayon::prelude::*;

/// y[n, c] = mean over the h·w pixels of x[n, :, c].
pub fn avgpool_forward(y: &mut [f32], x: &[f32], hw: usize, c: usize) {
    y.par_chunks_mut(c)
        .zip(x.par_chunks(hw * c))
        .for_each(|(y, x)| {
            let mut acc = vec![0.0f64; c];
            for px in x.chunks_exact(c) {
                for (a, &v) in acc.iter_mut().zip(px) {
                    *a += v as f64;
                }
            }
            for (o, a) in y.iter_mut().zip(acc) {
                *o = (a / hw as f64) as f32;
            }
        });
}

/// dx[n, p, c] = dy[n, c] / hw (overwrites dx; x itself is not needed).
pub fn avgpool_backward(dx: &mut [f32], dy: &[f32], hw: usize, c: usize) {
    let inv = 1.0 / hw as f32;
    dx.par_chunks_mut(hw * c)
        .zip(dy.par_chunks(c))
        .for_each(|(dx, dy)| {
            for px in dx.chunks_exact_mut(c) {
                for (d, &g) in px.iter_mut().zip(dy) {
                    *d = g * inv;
                }
            }
        });
}

pub fn avgpool_ref(x: &[f64], hw: usize, c: usize) -> Vec<f64> {
    let n = x.len() / (hw * c);
    let mut y = vec![0.0; n * c];
    for i in 0..n {
        for p in 0..hw {
            for ch in 0..c {
                y[i * c + ch] += x[(i * hw + p) * c + ch] / hw as f64;
            }
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    #[test]
    fn matches_reference_and_finite_differences() {
        let mut r = rng(50);
        let (n, hw, c) = (3, 7 * 5, 4);
        let x = rand_vec(&mut r, n * hw * c);
        let dy = rand_vec(&mut r, n * c);
        let mut y = vec![0.0; n * c];
        avgpool_forward(&mut y, &x, hw, c);
        assert_close("y", &y, &avgpool_ref(&to_f64(&x), hw, c), 1e-6, 1e-6);
        let mut dx = vec![0.0; x.len()];
        avgpool_backward(&mut dx, &dy, hw, c);
        let fd = finite_diff(&to_f64(&x), 1e-6, |p| {
            dot(&avgpool_ref(p, hw, c), &to_f64(&dy))
        });
        assert_close("dx", &dx, &fd, 1e-6, 1e-5);
    }
}
