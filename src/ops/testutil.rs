//! Helpers shared by the kernel tests: seeded random data, tolerant
//! comparison, and central finite differences on f64 functions.

use rand::{RngExt, SeedableRng, rngs::ChaCha8Rng};

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Uniform values in [-1, 1).
pub fn rand_vec(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random::<f32>() * 2.0 - 1.0).collect()
}

pub fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Asserts |got - want| <= atol + rtol * |want| elementwise, and reports the
/// worst element.
#[track_caller]
pub fn assert_close(what: &str, got: &[f32], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0usize, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs() - (atol + rtol * w.abs());
        if err > worst.1 {
            worst = (i, err);
        }
    }
    assert!(
        worst.1 <= 0.0,
        "{what}: element {} is {} but reference is {} (atol {atol}, rtol {rtol})",
        worst.0,
        got[worst.0],
        want[worst.0]
    );
}

/// Same, for two f64 slices (finite differences against analytic grads).
#[track_caller]
pub fn assert_close64(what: &str, got: &[f64], want: &[f64], atol: f64, rtol: f64) {
    let got32: Vec<f32> = got.iter().map(|&g| g as f32).collect();
    // Compare in f64 to keep the precision of both sides.
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= atol + rtol * w.abs(),
            "{what}: element {i} is {g} but reference is {w} (got32 {})",
            got32[i]
        );
    }
}

/// Central differences of `f` at `x` for every coordinate.
pub fn finite_diff(x: &[f64], eps: f64, mut f: impl FnMut(&[f64]) -> f64) -> Vec<f64> {
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            xp[i] = x[i] + eps;
            let up = f(&xp);
            xp[i] = x[i] - eps;
            let down = f(&xp);
            xp[i] = x[i];
            (up - down) / (2.0 * eps)
        })
        .collect()
}

pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
