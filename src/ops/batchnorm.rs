//! Batch normalisation over NHWC rows: `x` is (rows = n·h·w, c) row-major.
//!
//! PyTorch semantics: training normalises with the batch mean and *biased*
//! variance; the running statistics move with momentum using the *unbiased*
//! variance; eval and frozen modes normalise with the running statistics.
//! An optional ReLU is fused into the forward, and its mask into the
//! backward (taken from the saved ReLU output, which is > 0 exactly where the
//! ReLU passed its input).

use rayon::prelude::*;

use crate::device::cpu::f32_to_bf16;
use crate::ops::{REDUCE_CHUNK_ROWS, ReadF32, RoundChunk};

/// Rows summed in f32 before being added to the f64 chunk totals: short
/// enough that f32 rounding stays far below the tests' tolerances, long
/// enough that the f64 flush costs little next to the vectorised f32 work.
const F32_RUN_ROWS: usize = 32;

/// Per-channel sums of two per-element quantities over fixed chunks of rows.
/// `row_fn(r, s0, s1)` adds row `r`'s contributions to the f32 accumulators
/// `s0`, `s1` (one entry per channel, so the loop vectorises across
/// channels); runs of [`F32_RUN_ROWS`] rows are flushed into f64 totals per
/// chunk, and chunks are combined in order: the result is the same whatever
/// the number of threads.
fn channel_sums2(
    rows: usize,
    c: usize,
    row_fn: impl Fn(usize, &mut [f32], &mut [f32]) + Sync,
) -> (Vec<f64>, Vec<f64>) {
    let chunks: Vec<(Vec<f64>, Vec<f64>)> = (0..rows.div_ceil(REDUCE_CHUNK_ROWS))
        .into_par_iter()
        .map(|i| {
            let (mut t0, mut t1) = (vec![0.0f64; c], vec![0.0f64; c]);
            let (mut s0, mut s1) = (vec![0.0f32; c], vec![0.0f32; c]);
            let r0 = i * REDUCE_CHUNK_ROWS;
            let r1 = (r0 + REDUCE_CHUNK_ROWS).min(rows);
            let mut run = r0;
            while run < r1 {
                let end = (run + F32_RUN_ROWS).min(r1);
                s0.fill(0.0);
                s1.fill(0.0);
                for r in run..end {
                    row_fn(r, &mut s0, &mut s1);
                }
                for (t, &v) in t0.iter_mut().zip(&s0) {
                    *t += v as f64;
                }
                for (t, &v) in t1.iter_mut().zip(&s1) {
                    *t += v as f64;
                }
                run = end;
            }
            (t0, t1)
        })
        .collect();
    let (mut total0, mut total1) = (vec![0.0; c], vec![0.0; c]);
    for (c0, c1) in chunks {
        for (t, v) in total0.iter_mut().zip(c0) {
            *t += v;
        }
        for (t, v) in total1.iter_mut().zip(c1) {
            *t += v;
        }
    }
    (total0, total1)
}

/// Batch mean and biased variance per channel of `x` (rows, c), read as
/// f32 (a bf16 `x` gives the bits of its f32 copy).
pub fn bn_batch_stats<X: ReadF32>(mean: &mut [f32], var: &mut [f32], x: &[X], c: usize) {
    let rows = x.len() / c;
    // Shifted sums (by the first row) keep the variance accurate when the
    // mean is large relative to the spread.
    let shift: Vec<f32> = x[..c].iter().map(|v| v.f32()).collect();
    let shift = &shift[..];
    let (sum, sum_sq) = channel_sums2(rows, c, |r, s0, s1| {
        let xr = &x[r * c..(r + 1) * c];
        for (((a, b), &v), &sh) in s0.iter_mut().zip(s1.iter_mut()).zip(xr).zip(shift) {
            let d = v.f32() - sh;
            *a += d;
            *b += d * d;
        }
    });
    for ch in 0..c {
        let m = sum[ch] / rows as f64;
        mean[ch] = (shift[ch] as f64 + m) as f32;
        var[ch] = (sum_sq[ch] / rows as f64 - m * m).max(0.0) as f32;
    }
}

/// `running = (1 - momentum)·running + momentum·batch`, with the batch
/// variance made unbiased (`rows / (rows - 1)`) as PyTorch does.
pub fn bn_update_running(
    running_mean: &mut [f32],
    running_var: &mut [f32],
    mean: &[f32],
    var: &[f32],
    rows: usize,
    momentum: f32,
) {
    let unbias = if rows > 1 {
        rows as f32 / (rows - 1) as f32
    } else {
        1.0
    };
    for ch in 0..mean.len() {
        running_mean[ch] = (1.0 - momentum) * running_mean[ch] + momentum * mean[ch];
        running_var[ch] = (1.0 - momentum) * running_var[ch] + momentum * var[ch] * unbias;
    }
}

/// `1 / sqrt(var + eps)` per channel.
pub fn bn_rstd(rstd: &mut [f32], var: &[f32], eps: f32) {
    for (r, &v) in rstd.iter_mut().zip(var) {
        *r = 1.0 / (v + eps).sqrt();
    }
}

/// BN's per-channel affine folded into one multiply-add: y = x·scale + shift.
fn fold_affine(
    mean: &[f32],
    rstd: &[f32],
    gamma: &[f32],
    beta: &[f32],
    c: usize,
) -> (Vec<f32>, Vec<f32>) {
    let scale: Vec<f32> = gamma.iter().zip(rstd).map(|(g, r)| g * r).collect();
    let shift: Vec<f32> = (0..c).map(|ch| beta[ch] - mean[ch] * scale[ch]).collect();
    (scale, shift)
}

/// One row of the normalisation (and the fused ReLU). Every BN forward
/// kernel uses this loop, so they give the same bits. The branch on `relu`
/// sits outside the element loop so each loop is a plain vectorised
/// multiply-add (and max).
#[inline(always)]
fn normalise_row<X: ReadF32>(o: &mut [f32], xr: &[X], scale: &[f32], shift: &[f32], relu: bool) {
    let lanes = o.iter_mut().zip(xr).zip(scale.iter().zip(shift));
    if relu {
        for ((o, &v), (&a, &b)) in lanes {
            *o = (v.f32() * a + b).max(0.0);
        }
    } else {
        for ((o, &v), (&a, &b)) in lanes {
            *o = v.f32() * a + b;
        }
    }
}

/// y = gamma·(x - mean)·rstd + beta, then ReLU when `relu`, then `round`
/// per chunk. Works for every mode: pass batch or running statistics. `x`
/// is read as f32 (it may be a stored bf16 activation).
#[allow(clippy::too_many_arguments)]
pub fn bn_forward<X: ReadF32>(
    y: &mut [f32],
    x: &[X],
    mean: &[f32],
    rstd: &[f32],
    gamma: &[f32],
    beta: &[f32],
    c: usize,
    relu: bool,
    round: RoundChunk,
) {
    let (scale, shift) = fold_affine(mean, rstd, gamma, beta, c);
    let rows_of = |yc: &mut [f32], xc: &[X]| {
        for (yr, xr) in yc.chunks_exact_mut(c).zip(xc.chunks_exact(c)) {
            normalise_row(yr, xr, &scale, &shift, relu);
        }
    };
    y.par_chunks_mut(REDUCE_CHUNK_ROWS * c)
        .zip(x.par_chunks(REDUCE_CHUNK_ROWS * c))
        .for_each(|(yc, xc)| {
            rows_of(yc, xc);
            if let Some(round) = round {
                round(yc);
            }
        });
}

/// [`bn_forward`] with bf16 output `y` (rows, c): each row is normalised in
/// f32 and rounded to bf16 (nearest even) as it is stored, the bits
/// [`bn_forward`] with bf16 rounding gives, converted. For a BN+ReLU whose
/// output is kept in bf16 and read in place by the next convolution: one
/// pass writing two bytes per element instead of an f32 output and a
/// second pass converting it.
#[allow(clippy::too_many_arguments)]
pub fn bn_forward_bf16<X: ReadF32>(
    y: &mut [half::bf16],
    x: &[X],
    mean: &[f32],
    rstd: &[f32],
    gamma: &[f32],
    beta: &[f32],
    c: usize,
    relu: bool,
) {
    let (scale, shift) = fold_affine(mean, rstd, gamma, beta, c);
    y.par_chunks_mut(REDUCE_CHUNK_ROWS * c)
        .zip(x.par_chunks(REDUCE_CHUNK_ROWS * c))
        .for_each(|(yc, xc)| {
            // One f32 row (c values) at a time, converted while in cache.
            let mut row = vec![0.0f32; c];
            for (yr, xr) in yc.chunks_exact_mut(c).zip(xc.chunks_exact(c)) {
                normalise_row(&mut row, xr, &scale, &shift, relu);
                f32_to_bf16(bytemuck::cast_slice_mut(yr), &row);
            }
        });
}

/// Where [`bn_forward_keep_x`] writes the normalised output.
pub enum BnOut<'a> {
    /// f32, each chunk finished with the rounding (as [`bn_forward`]).
    F32(&'a mut [f32], RoundChunk),
    /// bf16 (as [`bn_forward_bf16`]).
    Bf16(&'a mut [half::bf16]),
}

/// [`bn_forward`] or [`bn_forward_bf16`] of an f32 `x` (bf16-representable
/// values: a bf16 convolution's output) that also writes `x` in bf16 to
/// `x_low` (rows, c), exactly: the copy a backward keeps, made while each
/// chunk of `x` is in cache for the normalisation instead of in a second
/// pass over `x`. Same bits as the two kernels and a separate conversion.
#[allow(clippy::too_many_arguments)]
pub fn bn_forward_keep_x(
    y: BnOut<'_>,
    x_low: &mut [half::bf16],
    x: &[f32],
    mean: &[f32],
    rstd: &[f32],
    gamma: &[f32],
    beta: &[f32],
    c: usize,
    relu: bool,
) {
    assert_eq!(x_low.len(), x.len(), "bn_forward_keep_x: x_low length");
    let (scale, shift) = fold_affine(mean, rstd, gamma, beta, c);
    let norm_row = |o: &mut [f32], xr: &[f32]| normalise_row(o, xr, &scale, &shift, relu);
    let chunk = REDUCE_CHUNK_ROWS * c;
    let keep = |lc: &mut [half::bf16], xc: &[f32]| f32_to_bf16(bytemuck::cast_slice_mut(lc), xc);
    match y {
        BnOut::F32(y, round) => y
            .par_chunks_mut(chunk)
            .zip(x_low.par_chunks_mut(chunk))
            .zip(x.par_chunks(chunk))
            .for_each(|((yc, lc), xc)| {
                for (yr, xr) in yc.chunks_exact_mut(c).zip(xc.chunks_exact(c)) {
                    norm_row(yr, xr);
                }
                if let Some(round) = round {
                    round(yc);
                }
                keep(lc, xc);
            }),
        BnOut::Bf16(y) => y
            .par_chunks_mut(chunk)
            .zip(x_low.par_chunks_mut(chunk))
            .zip(x.par_chunks(chunk))
            .for_each(|((yc, lc), xc)| {
                let mut row = vec![0.0f32; c];
                for (yr, xr) in yc.chunks_exact_mut(c).zip(xc.chunks_exact(c)) {
                    norm_row(&mut row, xr);
                    f32_to_bf16(bytemuck::cast_slice_mut(yr), &row);
                }
                keep(lc, xc);
            }),
    }
}

/// Gradients of [`bn_forward`]. `dx` is overwritten (and finished with
/// `round` per chunk); `dgamma`, `dbeta` accumulate when given (frozen BN
/// passes `None`).
///
/// * `batch_stats`: the statistics came from this batch (training), so the
///   gradient flows through the mean and variance too; otherwise they are
///   constants (eval, frozen).
/// * `relu_out`: the fused ReLU's output; the upstream gradient passes
///   where it is > 0.
/// * `x` and `relu_out` are read as f32 (they may be stored bf16
///   activations).
///
/// Two passes over the data: one for the per-channel sums Σg and Σg·x̂,
/// one writing dx as a single multiply-add chain per element.
#[allow(clippy::too_many_arguments)]
pub fn bn_backward<D: ReadF32, X: ReadF32, O: ReadF32>(
    dx: &mut [f32],
    dgamma: Option<&mut [f32]>,
    dbeta: Option<&mut [f32]>,
    dy: &[D],
    x: &[X],
    mean: &[f32],
    rstd: &[f32],
    gamma: &[f32],
    relu_out: Option<&[O]>,
    c: usize,
    batch_stats: bool,
    round: RoundChunk,
) {
    let rows = x.len() / c;
    // g = dy where the fused ReLU passed (its output > 0), else 0. The
    // branch on `relu_out` sits outside the element loops so each one
    // vectorises.
    let gate = |d: f32, o: f32| if o > 0.0 { d } else { 0.0 };
    // Σ g and Σ g·(x - mean); x̂ = (x - mean)·rstd is applied per channel after.
    let (sum_g, sum_gxc) = channel_sums2(rows, c, |r, s0, s1| {
        let range = r * c..(r + 1) * c;
        let lanes = s0
            .iter_mut()
            .zip(s1.iter_mut())
            .zip(dy[range.clone()].iter().zip(&x[range.clone()]))
            .zip(mean);
        match relu_out {
            Some(o) => {
                for ((((a, b), (&d, &xv)), &m), &ov) in lanes.zip(&o[range]) {
                    let gv = gate(d.f32(), ov.f32());
                    *a += gv;
                    *b += gv * (xv.f32() - m);
                }
            }
            None => {
                for (((a, b), (&d, &xv)), &m) in lanes {
                    let d = d.f32();
                    *a += d;
                    *b += d * (xv.f32() - m);
                }
            }
        }
    });
    let sum_gx: Vec<f64> = sum_gxc
        .iter()
        .zip(rstd)
        .map(|(&s, &r)| s * r as f64)
        .collect();
    if let Some(db) = dbeta {
        for (d, &s) in db.iter_mut().zip(&sum_g) {
            *d += s as f32;
        }
    }
    if let Some(dg) = dgamma {
        for (d, &s) in dg.iter_mut().zip(&sum_gx) {
            *d += s as f32;
        }
    }
    // Training: dx = scale·(g - mean(g) - x̂·mean(g·x̂)), rewritten as
    // dx = scale·g + coef·(x - mean) + bias with per-channel constants.
    let mut scale = vec![0.0f32; c];
    let mut coef = vec![0.0f32; c];
    let mut bias = vec![0.0f32; c];
    for ch in 0..c {
        scale[ch] = gamma[ch] * rstd[ch];
        if batch_stats {
            let mean_g = (sum_g[ch] / rows as f64) as f32;
            let mean_gx = (sum_gx[ch] / rows as f64) as f32;
            coef[ch] = -scale[ch] * rstd[ch] * mean_gx;
            bias[ch] = -scale[ch] * mean_g;
        }
    }
    dx.par_chunks_mut(REDUCE_CHUNK_ROWS * c)
        .enumerate()
        .for_each(|(i, dxc)| {
            let r0 = i * REDUCE_CHUNK_ROWS;
            for (j, dxr) in dxc.chunks_exact_mut(c).enumerate() {
                let range = (r0 + j) * c..(r0 + j + 1) * c;
                let lanes = dxr
                    .iter_mut()
                    .zip(dy[range.clone()].iter().zip(&x[range.clone()]))
                    .zip(scale.iter().zip(&coef).zip(bias.iter().zip(mean)));
                match relu_out {
                    Some(o) => {
                        for (((out, (&d, &xv)), ((&s, &k), (&b, &m))), &ov) in lanes.zip(&o[range])
                        {
                            *out = s * gate(d.f32(), ov.f32()) + k * (xv.f32() - m) + b;
                        }
                    }
                    None => {
                        for ((out, (&d, &xv)), ((&s, &k), (&b, &m))) in lanes {
                            *out = s * d.f32() + k * (xv.f32() - m) + b;
                        }
                    }
                }
            }
            if let Some(round) = round {
                round(dxc);
            }
        });
}

/// f64 reference forward. With `batch_stats`, normalises with the batch's
/// biased variance; otherwise with the given `mean`/`var`. Returns y.
pub fn bn_forward_ref(
    x: &[f64],
    gamma: &[f64],
    beta: &[f64],
    stats: Option<(&[f64], &[f64])>,
    c: usize,
    eps: f64,
    relu: bool,
) -> Vec<f64> {
    let (mean, var) = match stats {
        Some((m, v)) => (m.to_vec(), v.to_vec()),
        None => bn_batch_stats_ref(x, c),
    };
    x.chunks(c)
        .flat_map(|row| {
            (0..c)
                .map(|ch| {
                    let v = gamma[ch] * (row[ch] - mean[ch]) / (var[ch] + eps).sqrt() + beta[ch];
                    if relu { v.max(0.0) } else { v }
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// f64 batch mean and biased variance, by the two-pass definition.
pub fn bn_batch_stats_ref(x: &[f64], c: usize) -> (Vec<f64>, Vec<f64>) {
    let rows = (x.len() / c) as f64;
    let mut mean = vec![0.0; c];
    for row in x.chunks(c) {
        for ch in 0..c {
            mean[ch] += row[ch] / rows;
        }
    }
    let mut var = vec![0.0; c];
    for row in x.chunks(c) {
        for ch in 0..c {
            var[ch] += (row[ch] - mean[ch]).powi(2) / rows;
        }
    }
    (mean, var)
}

/// f64 reference gradients of `sum(dy * bn(x))` in training mode (batch
/// statistics), derived independently of the fast kernel: through the chain
/// rule on mean and variance. Returns (dx, dgamma, dbeta).
pub fn bn_backward_train_ref(
    dy: &[f64],
    x: &[f64],
    gamma: &[f64],
    c: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = x.len() / c;
    let m = rows as f64;
    let (mean, var) = bn_batch_stats_ref(x, c);
    let mut dx = vec![0.0; x.len()];
    let mut dgamma = vec![0.0; c];
    let mut dbeta = vec![0.0; c];
    for ch in 0..c {
        let sd = (var[ch] + eps).sqrt();
        // y = gamma·(x - mu)/sd + beta
        let mut d_var = 0.0;
        let mut d_mu = 0.0;
        for r in 0..rows {
            let i = r * c + ch;
            let xc = x[i] - mean[ch];
            dgamma[ch] += dy[i] * xc / sd;
            dbeta[ch] += dy[i];
            let d_xhat = dy[i] * gamma[ch];
            d_var += d_xhat * xc * -0.5 * (var[ch] + eps).powf(-1.5);
            d_mu += -d_xhat / sd;
        }
        let sum_xc: f64 = (0..rows).map(|r| x[r * c + ch] - mean[ch]).sum();
        d_mu += d_var * -2.0 * sum_xc / m;
        for r in 0..rows {
            let i = r * c + ch;
            dx[i] = dy[i] * gamma[ch] / sd + d_var * 2.0 * (x[i] - mean[ch]) / m + d_mu / m;
        }
    }
    (dx, dgamma, dbeta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    fn shifted(r: &mut rand::rngs::ChaCha8Rng, n: usize, s: f32, o: f32) -> Vec<f32> {
        rand_vec(r, n).into_iter().map(|v| v * s + o).collect()
    }

    /// Statistics of a bf16 tensor are those of its f32 copy, bit for bit.
    #[test]
    fn bf16_statistics_are_those_of_the_f32_copy() {
        let mut r = rng(12);
        let (rows, c) = (3 * REDUCE_CHUNK_ROWS + 7, 6);
        let mut x = shifted(&mut r, rows * c, 2.0, 0.7);
        crate::device::cpu::round_to_bf16(&mut x);
        let low: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let (mut m0, mut v0, mut m1, mut v1) =
            (vec![0.0; c], vec![0.0; c], vec![0.0; c], vec![0.0; c]);
        bn_batch_stats(&mut m0, &mut v0, &x, c);
        bn_batch_stats(&mut m1, &mut v1, &low, c);
        assert_eq!(m0, m1);
        assert_eq!(v0, v1);
    }

    #[test]
    fn train_forward_backward_match_reference() {
        let mut r = rng(10);
        for &(rows, c) in &[(5 * 7, 3usize), (2 * 3 * 3, 5), (1300, 4)] {
            let x = shifted(&mut r, rows * c, 2.0, 0.7);
            let gamma = shifted(&mut r, c, 0.5, 1.0);
            let beta = rand_vec(&mut r, c);
            let dy = rand_vec(&mut r, rows * c);
            let (mut mean, mut var, mut rstd) = (vec![0.0; c], vec![0.0; c], vec![0.0; c]);
            bn_batch_stats(&mut mean, &mut var, &x, c);
            let (mean_ref, var_ref) = bn_batch_stats_ref(&to_f64(&x), c);
            assert_close("mean", &mean, &mean_ref, 1e-6, 1e-5);
            assert_close("var", &var, &var_ref, 1e-6, 1e-5);
            bn_rstd(&mut rstd, &var, 1e-5);
            for relu in [false, true] {
                let mut y = vec![0.0; rows * c];
                bn_forward(&mut y, &x, &mean, &rstd, &gamma, &beta, c, relu, None);
                let y_ref = bn_forward_ref(
                    &to_f64(&x),
                    &to_f64(&gamma),
                    &to_f64(&beta),
                    None,
                    c,
                    1e-5,
                    relu,
                );
                assert_close("y", &y, &y_ref, 1e-5, 1e-5);

                let (mut dx, mut dg, mut db) = (vec![0.0; rows * c], vec![0.5; c], vec![0.5; c]);
                let relu_out = relu.then_some(&y[..]);
                bn_backward(
                    &mut dx,
                    Some(&mut dg),
                    Some(&mut db),
                    &dy,
                    &x,
                    &mean,
                    &rstd,
                    &gamma,
                    relu_out,
                    c,
                    true,
                    None,
                );
                // Reference: the mask applied to dy, then plain BN backward.
                let dy_masked: Vec<f64> = dy
                    .iter()
                    .zip(&y_ref)
                    .map(|(&d, &o)| if relu && o <= 0.0 { 0.0 } else { d as f64 })
                    .collect();
                let (dx_ref, dg_ref, db_ref) =
                    bn_backward_train_ref(&dy_masked, &to_f64(&x), &to_f64(&gamma), c, 1e-5);
                let plus = |v: Vec<f64>| v.into_iter().map(|a| a + 0.5).collect::<Vec<_>>();
                assert_close("dx", &dx, &dx_ref, 1e-5, 1e-4);
                assert_close("dgamma", &dg, &plus(dg_ref), 1e-4, 1e-5);
                assert_close("dbeta", &db, &plus(db_ref), 1e-4, 1e-5);
            }
        }
    }

    #[test]
    fn bf16_inputs_read_as_their_f32_copies() {
        let mut r = rng(12);
        let (rows, c) = (700, 5);
        let to_bf16 = |v: &[f32]| {
            v.iter()
                .map(|&x| half::bf16::from_f32(x))
                .collect::<Vec<_>>()
        };
        let widen = |v: &[half::bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
        let x16 = to_bf16(&shifted(&mut r, rows * c, 2.0, 0.7));
        let x = widen(&x16);
        let gamma = shifted(&mut r, c, 0.5, 1.0);
        let beta = rand_vec(&mut r, c);
        let dy = rand_vec(&mut r, rows * c);
        let (mut mean, mut var, mut rstd) = (vec![0.0; c], vec![0.0; c], vec![0.0; c]);
        bn_batch_stats(&mut mean, &mut var, &x, c);
        bn_rstd(&mut rstd, &var, 1e-5);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let round = Some(crate::device::cpu::round_to_bf16 as fn(&mut [f32]));
        let (mut y, mut y16) = (vec![0.0; rows * c], vec![0.0; rows * c]);
        bn_forward(&mut y, &x, &mean, &rstd, &gamma, &beta, c, true, round);
        bn_forward(&mut y16, &x16, &mean, &rstd, &gamma, &beta, c, true, round);
        assert_eq!(bits(&y16), bits(&y), "forward");
        // The bf16-output forward stores the bits of the rounded f32 one.
        for relu in [true, false] {
            let mut yf = vec![0.0; rows * c];
            bn_forward(&mut yf, &x16, &mean, &rstd, &gamma, &beta, c, relu, round);
            let mut yb = vec![half::bf16::ZERO; rows * c];
            bn_forward_bf16(&mut yb, &x16, &mean, &rstd, &gamma, &beta, c, relu);
            assert_eq!(bits(&widen(&yb)), bits(&yf), "bf16 forward, relu {relu}");
            // Keeping x on the way: the same outputs, and x exactly.
            let mut xl = vec![half::bf16::ZERO; rows * c];
            let mut yk = vec![0.0; rows * c];
            let out = BnOut::F32(&mut yk, round);
            bn_forward_keep_x(out, &mut xl, &x, &mean, &rstd, &gamma, &beta, c, relu);
            assert_eq!(bits(&yk), bits(&yf), "keep_x f32 out, relu {relu}");
            assert_eq!(xl, x16, "keep_x copy");
            let mut xl = vec![half::bf16::ZERO; rows * c];
            let mut ykb = vec![half::bf16::ZERO; rows * c];
            let out = BnOut::Bf16(&mut ykb);
            bn_forward_keep_x(out, &mut xl, &x, &mean, &rstd, &gamma, &beta, c, relu);
            assert_eq!(
                bits(&widen(&ykb)),
                bits(&yf),
                "keep_x bf16 out, relu {relu}"
            );
            assert_eq!(xl, x16, "keep_x copy");
        }
        let o16 = to_bf16(&y);
        let (mut dx, mut dg, mut db) = (vec![0.0; rows * c], vec![0.5; c], vec![0.5; c]);
        let (dyr, yr) = (&dy[..], &y[..]);
        bn_backward(
            &mut dx,
            Some(&mut dg),
            Some(&mut db),
            dyr,
            &x,
            &mean,
            &rstd,
            &gamma,
            Some(yr),
            c,
            true,
            round,
        );
        let want = [bits(&dx), bits(&dg), bits(&db)];
        let (mut dx, mut dg, mut db) = (vec![0.0; rows * c], vec![0.5; c], vec![0.5; c]);
        bn_backward(
            &mut dx,
            Some(&mut dg),
            Some(&mut db),
            dyr,
            &x16,
            &mean,
            &rstd,
            &gamma,
            Some(&o16[..]),
            c,
            true,
            round,
        );
        let got = [bits(&dx), bits(&dg), bits(&db)];
        assert_eq!(got, want, "backward");
    }

    #[test]
    fn eval_mode_uses_given_statistics() {
        let mut r = rng(11);
        let (rows, c) = (30, 3);
        let x = rand_vec(&mut r, rows * c);
        let gamma = shifted(&mut r, c, 0.5, 1.0);
        let beta = rand_vec(&mut r, c);
        let rm = rand_vec(&mut r, c);
        let rv = shifted(&mut r, c, 0.3, 1.0);
        let dy = rand_vec(&mut r, rows * c);
        let mut rstd = vec![0.0; c];
        bn_rstd(&mut rstd, &rv, 1e-5);
        let mut y = vec![0.0; rows * c];
        bn_forward(&mut y, &x, &rm, &rstd, &gamma, &beta, c, false, None);
        let (rm64, rv64) = (to_f64(&rm), to_f64(&rv));
        let y_ref = bn_forward_ref(
            &to_f64(&x),
            &to_f64(&gamma),
            &to_f64(&beta),
            Some((&rm64, &rv64)),
            c,
            1e-5,
            false,
        );
        assert_close("y eval", &y, &y_ref, 1e-5, 1e-5);
        // Constant statistics: dx = dy·gamma·rstd; check against FD of the reference.
        let mut dx = vec![0.0; rows * c];
        bn_backward(
            &mut dx,
            None,
            None,
            &dy,
            &x,
            &rm,
            &rstd,
            &gamma,
            None::<&[f32]>,
            c,
            false,
            None,
        );
        let fd = finite_diff(&to_f64(&x), 1e-6, |xp| {
            dot(
                &bn_forward_ref(
                    xp,
                    &to_f64(&gamma),
                    &to_f64(&beta),
                    Some((&rm64, &rv64)),
                    c,
                    1e-5,
                    false,
                ),
                &to_f64(&dy),
            )
        });
        assert_close("dx eval", &dx, &fd, 1e-5, 1e-4);
    }

    #[test]
    fn reference_backward_matches_finite_differences() {
        let mut r = rng(12);
        let (rows, c) = (12, 3);
        let x = to_f64(&shifted(&mut r, rows * c, 1.5, 0.3));
        let gamma = to_f64(&shifted(&mut r, c, 0.5, 1.0));
        let beta = to_f64(&rand_vec(&mut r, c));
        let dy = to_f64(&rand_vec(&mut r, rows * c));
        let (dx, dg, db) = bn_backward_train_ref(&dy, &x, &gamma, c, 1e-5);
        let loss = |x: &[f64], g: &[f64], b: &[f64]| {
            dot(&bn_forward_ref(x, g, b, None, c, 1e-5, false), &dy)
        };
        assert_close64(
            "fd dx",
            &dx,
            &finite_diff(&x, 1e-6, |p| loss(p, &gamma, &beta)),
            1e-6,
            1e-5,
        );
        assert_close64(
            "fd dgamma",
            &dg,
            &finite_diff(&gamma, 1e-6, |p| loss(&x, p, &beta)),
            1e-6,
            1e-5,
        );
        assert_close64(
            "fd dbeta",
            &db,
            &finite_diff(&beta, 1e-6, |p| loss(&x, &gamma, p)),
            1e-6,
            1e-5,
        );
    }

    #[test]
    fn running_stats_use_unbiased_variance() {
        let (mut rm, mut rv) = (vec![1.0f32], vec![2.0f32]);
        // rows = 4, biased var 1.25 -> unbiased 5/3.
        bn_update_running(&mut rm, &mut rv, &[0.5], &[1.25], 4, 0.1);
        assert!((rm[0] - (0.9 + 0.05)).abs() < 1e-7);
        assert!((rv[0] - (1.8 + 0.1 * 1.25 * 4.0 / 3.0)).abs() < 1e-6);
    }

    #[test]
    fn statistics_do_not_depend_on_thread_count() {
        let mut r = rng(13);
        let c = 8;
        let x = shifted(&mut r, 5000 * c, 3.0, 1.0);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let (mut m, mut v) = (vec![0.0; c], vec![0.0; c]);
                bn_batch_stats(&mut m, &mut v, &x, c);
                (m, v)
            })
        };
        assert_eq!(run(1), run(3));
    }
}
