//! Fully connected layer with bias, PyTorch layout: weight (out, in).

use crate::device::cpu::{Accumulate, MatRef, gemm_f32};

/// y (n, out) = x (n, in) · wᵀ + b.
pub fn linear_forward(
    y: &mut [f32],
    x: &[f32],
    w: &[f32],
    b: &[f32],
    n: usize,
    fin: usize,
    fout: usize,
) {
    for row in y[..n * fout].chunks_exact_mut(fout) {
        row.copy_from_slice(b);
    }
    gemm_f32(
        y,
        MatRef::row_major(x, n, fin),
        MatRef::row_major(w, fout, fin).t(),
        Accumulate::Yes,
    );
}

/// `dw += dyᵀ·x`, `db += Σ dy`; `dx = dy·w` when given (overwritten).
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    dx: Option<&mut [f32]>,
    dw: &mut [f32],
    db: &mut [f32],
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    n: usize,
    fin: usize,
    fout: usize,
) {
    let dym = MatRef::row_major(dy, n, fout);
    gemm_f32(dw, dym.t(), MatRef::row_major(x, n, fin), Accumulate::Yes);
    for row in dy.chunks_exact(fout) {
        for (d, &g) in db.iter_mut().zip(row) {
            *d += g;
        }
    }
    if let Some(dx) = dx {
        gemm_f32(dx, dym, MatRef::row_major(w, fout, fin), Accumulate::No);
    }
}

pub fn linear_ref(x: &[f64], w: &[f64], b: &[f64], n: usize, fin: usize, fout: usize) -> Vec<f64> {
    let mut y = vec![0.0; n * fout];
    for i in 0..n {
        for o in 0..fout {
            y[i * fout + o] = b[o]
                + (0..fin)
                    .map(|k| x[i * fin + k] * w[o * fin + k])
                    .sum::<f64>();
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
        let mut r = rng(60);
        let (n, fin, fout) = (3, 7, 5);
        let x = rand_vec(&mut r, n * fin);
        let w = rand_vec(&mut r, fout * fin);
        let b = rand_vec(&mut r, fout);
        let dy = rand_vec(&mut r, n * fout);
        let mut y = vec![0.0; n * fout];
        linear_forward(&mut y, &x, &w, &b, n, fin, fout);
        let (x64, w64, b64, dy64) = (to_f64(&x), to_f64(&w), to_f64(&b), to_f64(&dy));
        assert_close(
            "y",
            &y,
            &linear_ref(&x64, &w64, &b64, n, fin, fout),
            1e-6,
            1e-6,
        );
        let (mut dx, mut dw, mut db) = (vec![3.0; x.len()], vec![0.0; w.len()], vec![0.0; fout]);
        linear_backward(Some(&mut dx), &mut dw, &mut db, &dy, &x, &w, n, fin, fout);
        let loss = |x: &[f64], w: &[f64], b: &[f64]| dot(&linear_ref(x, w, b, n, fin, fout), &dy64);
        assert_close(
            "dx",
            &dx,
            &finite_diff(&x64, 1e-6, |p| loss(p, &w64, &b64)),
            1e-6,
            1e-5,
        );
        assert_close(
            "dw",
            &dw,
            &finite_diff(&w64, 1e-6, |p| loss(&x64, p, &b64)),
            1e-6,
            1e-5,
        );
        assert_close(
            "db",
            &db,
            &finite_diff(&b64, 1e-6, |p| loss(&x64, &w64, p)),
            1e-6,
            1e-5,
        );
    }
}
