//! ReLU, plain and with a packed bit mask (one bit per element, so a block's
//! final ReLU costs 1/32 of its output to remember).

use rayon::prelude::*;

use crate::device::cpu::{bf16_to_f32, f32_to_bf16};
use crate::ops::{ReadF32, RoundChunk};

const CHUNK: usize = 1 << 14; // elements per parallel chunk, a multiple of 8

/// y = max(x, 0).
pub fn relu_forward(y: &mut [f32], x: &[f32]) {
    y.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(y, x)| {
            for (o, &i) in y.iter_mut().zip(x) {
                *o = i.max(0.0);
            }
        });
}

/// dx = dy where the forward output `y` is > 0, else 0 (overwrites dx).
pub fn relu_backward(dx: &mut [f32], dy: &[f32], y: &[f32]) {
    dx.par_chunks_mut(CHUNK)
        .zip(dy.par_chunks(CHUNK).zip(y.par_chunks(CHUNK)))
        .for_each(|(dx, (dy, y))| {
            for ((d, &g), &o) in dx.iter_mut().zip(dy).zip(y) {
                *d = if o > 0.0 { g } else { 0.0 };
            }
        });
}

/// In place: x = max(x + residual, 0), and bit i of `mask` = (x_i > 0),
/// then `round` per chunk. This is the residual add and final ReLU of a
/// block in one pass. The residual is read as f32 (it may be a stored bf16
/// block input).
pub fn add_relu_forward<R: ReadF32>(
    x: &mut [f32],
    residual: &[R],
    mask: &mut [u8],
    round: RoundChunk,
) {
    assert_eq!(x.len(), residual.len(), "add_relu_forward: lengths");
    assert_eq!(
        mask.len(),
        x.len().div_ceil(8),
        "add_relu_forward: mask length"
    );
    x.par_chunks_mut(CHUNK)
        .zip(residual.par_chunks(CHUNK))
        .zip(mask.par_chunks_mut(CHUNK / 8))
        .for_each(|((x, res), mask)| {
            add_relu_chunk(x, res, mask);
            if let Some(round) = round {
                round(x);
            }
        });
}

/// One chunk of [`add_relu_forward`], unrounded.
fn add_relu_chunk<R: ReadF32>(x: &mut [f32], res: &[R], mask: &mut [u8]) {
    // Eight elements per mask byte: the inner loop has a fixed trip
    // count and no data-dependent branch, so it vectorises.
    for ((xs, rs), m) in x.chunks_mut(8).zip(res.chunks(8)).zip(mask.iter_mut()) {
        let mut bits = 0u8;
        for (j, (v, &r)) in xs.iter_mut().zip(rs).enumerate() {
            let s = *v + r.f32();
            let pos = s > 0.0;
            bits |= (pos as u8) << j;
            *v = if pos { s } else { 0.0 };
        }
        *m = bits;
    }
}

/// [`add_relu_forward`] on a bf16 `x`: each chunk is widened, summed in
/// f32 by the same loop and rounded to bf16 as it is stored, the bits the
/// f32 kernel's bf16 rounding gives.
pub fn add_relu_forward_bf16<R: ReadF32>(x: &mut [half::bf16], residual: &[R], mask: &mut [u8]) {
    assert_eq!(x.len(), residual.len(), "add_relu_forward_bf16: lengths");
    assert_eq!(
        mask.len(),
        x.len().div_ceil(8),
        "add_relu_forward_bf16: mask length"
    );
    x.par_chunks_mut(CHUNK)
        .zip(residual.par_chunks(CHUNK))
        .zip(mask.par_chunks_mut(CHUNK / 8))
        .for_each(|((x, res), mask)| {
            let x: &mut [u16] = bytemuck::cast_slice_mut(x);
            let mut sum = vec![0.0f32; x.len()];
            bf16_to_f32(&mut sum, x);
            add_relu_chunk(&mut sum, res, mask);
            f32_to_bf16(x, &sum);
        });
}

/// In place: x = max(x, 0), and bit i of `mask` = (x_i > 0). A ReLU whose
/// output is kept by the next stage remembers only this mask.
pub fn relu_mask_forward(x: &mut [f32], mask: &mut [u8]) {
    assert_eq!(
        mask.len(),
        x.len().div_ceil(8),
        "relu_mask_forward: mask length"
    );
    x.par_chunks_mut(CHUNK)
        .zip(mask.par_chunks_mut(CHUNK / 8))
        .for_each(|(x, mask)| {
            for (xs, m) in x.chunks_mut(8).zip(mask.iter_mut()) {
                let mut bits = 0u8;
                for (j, v) in xs.iter_mut().enumerate() {
                    let pos = *v > 0.0;
                    bits |= (pos as u8) << j;
                    *v = if pos { *v } else { 0.0 };
                }
                *m = bits;
            }
        });
}

/// dx = dy where the mask bit is set, else 0 (overwrites dx).
pub fn relu_mask_backward(dx: &mut [f32], dy: &[f32], mask: &[u8]) {
    dx.par_chunks_mut(CHUNK)
        .zip(dy.par_chunks(CHUNK))
        .zip(mask.par_chunks(CHUNK / 8))
        .for_each(|((dx, dy), mask)| {
            for ((ds, gs), &m) in dx.chunks_mut(8).zip(dy.chunks(8)).zip(mask) {
                for (j, (d, &g)) in ds.iter_mut().zip(gs).enumerate() {
                    *d = if (m >> j) & 1 == 1 { g } else { 0.0 };
                }
            }
        });
}

/// In place: d = 0 where the mask bit is clear.
pub fn relu_mask_backward_inplace<T: Copy + Default + Send + Sync>(d: &mut [T], mask: &[u8]) {
    d.par_chunks_mut(CHUNK)
        .zip(mask.par_chunks(CHUNK / 8))
        .for_each(|(d, mask)| {
            for (ds, &m) in d.chunks_mut(8).zip(mask) {
                for (j, v) in ds.iter_mut().enumerate() {
                    *v = if (m >> j) & 1 == 1 { *v } else { T::default() };
                }
            }
        });
}

pub fn relu_ref(x: &[f64]) -> Vec<f64> {
    x.iter().map(|&v| if v > 0.0 { v } else { 0.0 }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cpu::round_to_bf16;
    use crate::ops::testutil::*;

    /// The bf16 residual add gives the bits of the f32 kernel with bf16
    /// rounding, and the same mask, over several chunks and a ragged tail.
    #[test]
    fn bf16_add_relu_is_the_rounded_f32_one() {
        let mut r = rng(21);
        let n = 2 * CHUNK + 11;
        let mut x = rand_vec(&mut r, n);
        round_to_bf16(&mut x);
        let mut res = rand_vec(&mut r, n);
        round_to_bf16(&mut res);
        let res_low: Vec<half::bf16> = res.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let mut want = x.clone();
        let mut want_mask = vec![0u8; n.div_ceil(8)];
        let round: RoundChunk = Some(round_to_bf16);
        add_relu_forward(&mut want, &res, &mut want_mask, round);
        let mut got: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let mut mask = vec![0u8; n.div_ceil(8)];
        add_relu_forward_bf16(&mut got, &res_low, &mut mask);
        let got: Vec<u32> = got.iter().map(|v| v.to_f32().to_bits()).collect();
        let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want);
        assert_eq!(mask, want_mask);
    }

    #[test]
    fn relu_and_masked_relu_match_reference() {
        let mut r = rng(20);
        let n = 3 * CHUNK + 13; // several chunks and a ragged tail
        let x = rand_vec(&mut r, n);
        let res = rand_vec(&mut r, n);
        let dy = rand_vec(&mut r, n);
        let mut y = vec![0.0; n];
        relu_forward(&mut y, &x);
        assert_close("relu", &y, &relu_ref(&to_f64(&x)), 0.0, 0.0);
        let mut dx = vec![9.0; n];
        relu_backward(&mut dx, &dy, &y);
        let want: Vec<f64> = x
            .iter()
            .zip(&dy)
            .map(|(&a, &g)| if a > 0.0 { g as f64 } else { 0.0 })
            .collect();
        assert_close("relu dx", &dx, &want, 0.0, 0.0);

        let mut s = x.clone();
        let mut mask = vec![0xff; n.div_ceil(8)];
        add_relu_forward(&mut s, &res, &mut mask, None);
        let sum: Vec<f64> = x.iter().zip(&res).map(|(&a, &b)| (a + b) as f64).collect();
        assert_close("add_relu", &s, &relu_ref(&sum), 0.0, 0.0);
        let mut dx = vec![9.0; n];
        relu_mask_backward(&mut dx, &dy, &mask);
        let want: Vec<f64> = sum
            .iter()
            .zip(&dy)
            .map(|(&a, &g)| if a > 0.0 { g as f64 } else { 0.0 })
            .collect();
        assert_close("add_relu dx", &dx, &want, 0.0, 0.0);
        let mut inplace = dy.clone();
        relu_mask_backward_inplace(&mut inplace, &mask);
        assert_close("add_relu dx in place", &inplace, &want, 0.0, 0.0);

        // A bf16 residual reads as its exact f32 widening.
        let res_bf16: Vec<half::bf16> = res.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let res_wide: Vec<f32> = res_bf16.iter().map(|v| v.to_f32()).collect();
        let (mut a, mut b) = (x.clone(), x.clone());
        let (mut mask_a, mut mask_b) = (vec![0; n.div_ceil(8)], vec![0; n.div_ceil(8)]);
        add_relu_forward(&mut a, &res_bf16, &mut mask_a, None);
        add_relu_forward(&mut b, &res_wide, &mut mask_b, None);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b), "bf16 residual");
        assert_eq!(mask_a, mask_b);

        let mut r = x.clone();
        let mut mask = vec![0xff; n.div_ceil(8)];
        relu_mask_forward(&mut r, &mut mask);
        assert_close("relu_mask", &r, &relu_ref(&to_f64(&x)), 0.0, 0.0);
        let mut dx = vec![9.0; n];
        relu_mask_backward(&mut dx, &dy, &mask);
        let want: Vec<f64> = x
            .iter()
            .zip(&dy)
            .map(|(&a, &g)| if a > 0.0 { g as f64 } else { 0.0 })
            .collect();
        assert_close("relu_mask dx", &dx, &want, 0.0, 0.0);
    }

    #[test]
    fn relu_gradient_matches_finite_differences() {
        // Away from the kink, the derivative is 0 or 1.
        let x: Vec<f64> = vec![-1.5, -0.2, 0.3, 2.0];
        let dy = vec![0.7, -1.1, 0.4, 1.3];
        let fd = finite_diff(&x, 1e-6, |p| dot(&relu_ref(p), &dy));
        let y: Vec<f32> = relu_ref(&x).iter().map(|&v| v as f32).collect();
        let mut dx = vec![0.0; 4];
        relu_backward(
            &mut dx,
            &dy.iter().map(|&v| v as f32).collect::<Vec<_>>(),
            &y,
        );
        assert_close("fd relu", &dx, &fd, 1e-6, 1e-6);
    }
}
