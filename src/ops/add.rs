//! Elementwise addition: the residual join, and gradient accumulation.
//! Its backward is the identity into both inputs, so it needs no kernel.

use rayon::prelude::*;

use crate::ops::{ReadF32, RoundChunk};

const CHUNK: usize = 1 << 14;

/// acc += x, then `round` per chunk.
pub fn add_assign<R: ReadF32>(acc: &mut [f32], x: &[R], round: RoundChunk) {
    assert_eq!(acc.len(), x.len(), "add_assign: lengths");
    acc.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(a, x)| {
            for (a, &v) in a.iter_mut().zip(x) {
                *a += v.f32();
            }
            if let Some(round) = round {
                round(a);
            }
        });
}

pub fn add_ref(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    #[test]
    fn add_matches_reference_and_its_gradient_is_identity() {
        let mut r = rng(30);
        let n = CHUNK + 7;
        let a = rand_vec(&mut r, n);
        let b = rand_vec(&mut r, n);
        let mut acc = a.clone();
        add_assign(&mut acc, &b, None);
        assert_close("add", &acc, &add_ref(&to_f64(&a), &to_f64(&b)), 1e-7, 0.0);
        let dy = to_f64(&rand_vec(&mut r, 5));
        let (a5, b5) = (to_f64(&a[..5]), to_f64(&b[..5]));
        let fd_a = finite_diff(&a5, 1e-6, |p| dot(&add_ref(p, &b5), &dy));
        let fd_b = finite_diff(&b5, 1e-6, |p| dot(&add_ref(&a5, p), &dy));
        assert_close64("fd da", &fd_a, &dy, 1e-8, 1e-8);
        assert_close64("fd db", &fd_b, &dy, 1e-8, 1e-8);
    }
}
