//! The CPU arm of the backend boundary: host slices of pool tensors handed
//! to the kernels in `crate::ops` (the gemm crate, rayon and our bf16
//! kernels under `crate::device::cpu`). Element types are dispatched here,
//! so the layers above never see a slice.

use rayon::prelude::*;

use super::LossOutput;
use crate::device::cpu::{
    GemmMath, bf16_to_f32_par, f16_to_f32_par, f32_to_bf16_par, f32_to_f16_par, round_to_bf16,
    round_to_f16,
};
use crate::error::Result;
use crate::ops::batchnorm::{self as bn, BnOut};
use crate::ops::conv2d::{self, ConvGeom, ConvInput};
use crate::ops::maxpool::{self, PoolGeom};
use crate::ops::optim_update;
use crate::ops::{ReadF32, RoundChunk, add, avgpool, cross_entropy, linear, relu};
use crate::profile::{Family, timed};
use crate::tensor::{DType, Precision, Tensor};

/// Elements per rayon task in the conversions: big enough to amortise the
/// task, small enough to spread a layer over both cores.
const CHUNK: usize = 1 << 14;

impl Precision {
    /// The CPU GEMM arithmetic for operands rounded to this type: bf16 has
    /// a native kernel; f16 products are exact in f32, so it uses the f32
    /// GEMM.
    pub fn gemm_math(self) -> GemmMath {
        match self {
            Precision::BF16 => GemmMath::Bf16,
            Precision::F32 | Precision::F16 => GemmMath::F32,
        }
    }

    /// Rounds every host value to the nearest value of this type (ties to
    /// even; f16 overflows to ±inf as a real f16 op would). No-op for fp32.
    pub fn round(self, v: &mut [f32]) {
        if let Some(round) = self.chunk_round() {
            v.par_chunks_mut(CHUNK).for_each(round);
        }
    }

    /// [`Precision::round`] on one chunk, on the calling thread: what a
    /// CPU kernel applies to each chunk of its output as it finishes it
    /// ([`RoundChunk`]). `None` for fp32.
    pub fn chunk_round(self) -> RoundChunk {
        match self {
            Precision::F32 => None,
            Precision::BF16 => Some(round_to_bf16),
            Precision::F16 => Some(round_to_f16),
        }
    }
}

/// The convolution kernels' view of `x`: f32, or bf16 words read in place.
fn conv_input(x: &Tensor) -> ConvInput<'_> {
    match x.dtype() {
        // Blocks from the pool are 64-byte aligned and `cin` is even (the
        // layer checks), so the bf16 storage is whole aligned words.
        DType::BF16 => ConvInput::Bf16Words(bytemuck::cast_slice(x.bf16())),
        _ => ConvInput::F32(x.f32()),
    }
}

pub(super) fn conv2d_forward(
    y: &mut Tensor,
    x: &Tensor,
    w: &Tensor,
    g: &ConvGeom,
    ws: &mut Tensor,
    p: Precision,
) {
    if y.dtype() == DType::BF16 {
        return conv2d::conv2d_forward_bf16_out(
            y.bf16_mut(),
            conv_input(x),
            w.f32(),
            g,
            ws.f32_mut(),
            p.gemm_math(),
        );
    }
    conv2d::conv2d_forward(
        y.f32_mut(),
        conv_input(x),
        w.f32(),
        g,
        ws.f32_mut(),
        p.gemm_math(),
    );
}

#[allow(clippy::too_many_arguments)]
pub(super) fn conv2d_backward(
    dx: Option<&mut Tensor>,
    dw: &mut Tensor,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    g: &ConvGeom,
    ws: &mut Tensor,
    p: Precision,
) {
    conv2d::conv2d_backward(
        dx.map(|t| t.f32_mut()),
        dw.f32_mut(),
        dy.f32(),
        conv_input(x),
        w.f32(),
        g,
        ws.f32_mut(),
        p.gemm_math(),
    );
}

pub(super) fn bn_batch_stats(
    mean: &mut Tensor,
    var: &mut Tensor,
    rstd: &mut Tensor,
    x: &Tensor,
    eps: f32,
) {
    let c = mean.numel();
    timed(Family::BatchNorm, 0, || {
        match x.dtype() {
            DType::BF16 => bn::bn_batch_stats(mean.f32_mut(), var.f32_mut(), x.bf16(), c),
            _ => bn::bn_batch_stats(mean.f32_mut(), var.f32_mut(), x.f32(), c),
        }
        bn::bn_rstd(rstd.f32_mut(), var.f32(), eps);
    });
}

pub(super) fn bn_update_running(
    running_mean: &mut Tensor,
    running_var: &mut Tensor,
    mean: &Tensor,
    var: &Tensor,
    rows: usize,
    momentum: f32,
) {
    bn::bn_update_running(
        running_mean.f32_mut(),
        running_var.f32_mut(),
        mean.f32(),
        var.f32(),
        rows,
        momentum,
    );
}

pub(super) fn bn_running_stats(
    mean: &mut Tensor,
    rstd: &mut Tensor,
    running_mean: &Tensor,
    running_var: &Tensor,
    eps: f32,
) {
    mean.f32_mut().copy_from_slice(running_mean.f32());
    bn::bn_rstd(rstd.f32_mut(), running_var.f32(), eps);
}

#[allow(clippy::too_many_arguments)]
pub(super) fn bn_forward(
    y: &mut Tensor,
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    relu: bool,
    p: Precision,
) {
    let (mean, rstd) = (mean.f32(), rstd.f32());
    let (gamma, beta) = (gamma.f32(), beta.f32());
    let c = mean.len();
    if y.dtype() == DType::BF16 {
        let y = y.bf16_mut();
        timed(Family::BatchNorm, 0, || match x.dtype() {
            DType::BF16 => bn::bn_forward_bf16(y, x.bf16(), mean, rstd, gamma, beta, c, relu),
            _ => bn::bn_forward_bf16(y, x.f32(), mean, rstd, gamma, beta, c, relu),
        });
    } else {
        let round = p.chunk_round();
        let y = y.f32_mut();
        timed(Family::BatchNorm, 0, || match x.dtype() {
            DType::BF16 => bn::bn_forward(y, x.bf16(), mean, rstd, gamma, beta, c, relu, round),
            _ => bn::bn_forward(y, x.f32(), mean, rstd, gamma, beta, c, relu, round),
        });
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn bn_forward_keep_x(
    y: &mut Tensor,
    x_low: &mut Tensor,
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    relu: bool,
    p: Precision,
) {
    let (mean, rstd) = (mean.f32(), rstd.f32());
    let (gamma, beta) = (gamma.f32(), beta.f32());
    let c = mean.len();
    let out = if y.dtype() == DType::BF16 {
        BnOut::Bf16(y.bf16_mut())
    } else {
        BnOut::F32(y.f32_mut(), p.chunk_round())
    };
    let xl = x_low.bf16_mut();
    timed(Family::BatchNorm, 0, || {
        bn::bn_forward_keep_x(out, xl, x.f32(), mean, rstd, gamma, beta, c, relu)
    });
}

#[allow(clippy::too_many_arguments)]
pub(super) fn bn_backward(
    dx: &mut Tensor,
    dgamma: Option<&mut Tensor>,
    dbeta: Option<&mut Tensor>,
    dy: &Tensor,
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    gamma: &Tensor,
    relu_out: Option<&Tensor>,
    batch_stats: bool,
    p: Precision,
) {
    let args = BnBackwardArgs {
        dx: dx.f32_mut(),
        dgamma: dgamma.map(|t| t.f32_mut()),
        dbeta: dbeta.map(|t| t.f32_mut()),
        dy,
        mean: mean.f32(),
        rstd: rstd.f32(),
        gamma: gamma.f32(),
        c: mean.numel(),
        batch_stats,
        round: p.chunk_round(),
    };
    timed(Family::BatchNorm, 0, || match x.dtype() {
        DType::BF16 => args.run(x.bf16(), relu_out),
        _ => args.run(x.f32(), relu_out),
    });
}

/// The arguments of one `bn_backward`; `run` dispatches on the element
/// types of the three that may be stored in bf16 (`x`, `relu_out`, `dy`).
struct BnBackwardArgs<'a> {
    dx: &'a mut [f32],
    dgamma: Option<&'a mut [f32]>,
    dbeta: Option<&'a mut [f32]>,
    dy: &'a Tensor,
    mean: &'a [f32],
    rstd: &'a [f32],
    gamma: &'a [f32],
    c: usize,
    batch_stats: bool,
    round: RoundChunk,
}

impl BnBackwardArgs<'_> {
    fn run<X: ReadF32>(self, x: &[X], relu_out: Option<&Tensor>) {
        match relu_out {
            Some(o) if o.dtype() == DType::BF16 => self.run2(x, Some(o.bf16())),
            Some(o) => self.run2(x, Some(o.f32())),
            None => self.run2(x, None::<&[f32]>),
        }
    }

    fn run2<X: ReadF32, O: ReadF32>(self, x: &[X], relu_out: Option<&[O]>) {
        let dy = self.dy;
        match dy.dtype() {
            DType::BF16 => self.run3(dy.bf16(), x, relu_out),
            _ => self.run3(dy.f32(), x, relu_out),
        }
    }

    fn run3<D: ReadF32, X: ReadF32, O: ReadF32>(self, dy: &[D], x: &[X], relu_out: Option<&[O]>) {
        bn::bn_backward(
            self.dx,
            self.dgamma,
            self.dbeta,
            dy,
            x,
            self.mean,
            self.rstd,
            self.gamma,
            relu_out,
            self.c,
            self.batch_stats,
            self.round,
        )
    }
}

pub(super) fn add_relu_forward(z: &mut Tensor, residual: &Tensor, mask: &mut Tensor, p: Precision) {
    let (mask, round) = (mask.bits_mut(), p.chunk_round());
    if z.dtype() == DType::BF16 {
        let z = z.bf16_mut();
        return match residual.dtype() {
            DType::BF16 => relu::add_relu_forward_bf16(z, residual.bf16(), mask),
            _ => relu::add_relu_forward_bf16(z, residual.f32(), mask),
        };
    }
    let z = z.f32_mut();
    match residual.dtype() {
        DType::BF16 => relu::add_relu_forward(z, residual.bf16(), mask, round),
        _ => relu::add_relu_forward(z, residual.f32(), mask, round),
    }
}

pub(super) fn add_assign(acc: &mut Tensor, x: &Tensor, p: Precision) {
    match x.dtype() {
        DType::BF16 => add::add_assign(acc.f32_mut(), x.bf16(), p.chunk_round()),
        _ => add::add_assign(acc.f32_mut(), x.f32(), p.chunk_round()),
    }
}

pub(super) fn relu_mask_forward(x: &mut Tensor, mask: &mut Tensor) {
    relu::relu_mask_forward(x.f32_mut(), mask.bits_mut());
}

pub(super) fn relu_mask_backward_inplace(d: &mut Tensor, mask: &Tensor) {
    match d.dtype() {
        DType::BF16 => relu::relu_mask_backward_inplace(d.bf16_mut(), mask.bits()),
        _ => relu::relu_mask_backward_inplace(d.f32_mut(), mask.bits()),
    }
}

pub(super) fn maxpool_forward(y: &mut Tensor, x: &Tensor, g: &PoolGeom) {
    maxpool::maxpool_forward(y.f32_mut(), x.f32(), g);
}

pub(super) fn maxpool_backward(
    dx: &mut Tensor,
    dy: &Tensor,
    x: &Tensor,
    g: &PoolGeom,
    p: Precision,
) {
    match (dy.dtype(), x.dtype()) {
        (DType::BF16, DType::BF16) => {
            maxpool::maxpool_backward(dx.f32_mut(), dy.bf16(), x.bf16(), g)
        }
        (DType::BF16, _) => maxpool::maxpool_backward(dx.f32_mut(), dy.bf16(), x.f32(), g),
        (_, DType::BF16) => maxpool::maxpool_backward(dx.f32_mut(), dy.f32(), x.bf16(), g),
        _ => maxpool::maxpool_backward(dx.f32_mut(), dy.f32(), x.f32(), g),
    }
    p.round(dx.f32_mut());
}

pub(super) fn avgpool_forward(y: &mut Tensor, x: &Tensor, p: Precision) {
    let (_, h, w, c) = x.shape().nhwc();
    avgpool::avgpool_forward(y.f32_mut(), x.f32(), h * w, c);
    p.round(y.f32_mut());
}

pub(super) fn avgpool_backward(dx: &mut Tensor, dy: &Tensor, p: Precision) {
    let (_, h, w, c) = dx.shape().nhwc();
    avgpool::avgpool_backward(dx.f32_mut(), dy.f32(), h * w, c);
    p.round(dx.f32_mut());
}

pub(super) fn linear_forward(y: &mut Tensor, x: &Tensor, w: &Tensor, b: &Tensor, p: Precision) {
    let (n, fout) = (y.dims()[0], y.dims()[1]);
    let fin = w.dims()[1];
    linear::linear_forward(y.f32_mut(), x.f32(), w.f32(), b.f32(), n, fin, fout);
    p.round(y.f32_mut());
}

pub(super) fn linear_backward(
    dx: &mut Tensor,
    dw: &mut Tensor,
    db: &mut Tensor,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    p: Precision,
) {
    let (fout, fin) = (w.dims()[0], w.dims()[1]);
    let n = dy.dims()[0];
    linear::linear_backward(
        Some(dx.f32_mut()),
        dw.f32_mut(),
        db.f32_mut(),
        dy.f32(),
        x.f32(),
        w.f32(),
        n,
        fin,
        fout,
    );
    p.round(dx.f32_mut());
}

pub(super) fn cross_entropy(
    d_logits: &mut Tensor,
    logits: &Tensor,
    labels: &[usize],
    smoothing: f32,
    divisor: usize,
    scale: Option<f32>,
    p: Precision,
) -> Result<LossOutput> {
    let classes = logits.dims()[1];
    let loss = cross_entropy::cross_entropy_forward_backward_over(
        d_logits.f32_mut(),
        logits.f32(),
        labels,
        classes,
        smoothing,
        divisor,
    )?;
    if let Some(scale) = scale {
        d_logits.f32_mut().iter_mut().for_each(|g| *g *= scale);
    }
    p.round(d_logits.f32_mut());
    let correct = cross_entropy::argmax_rows(logits.f32(), classes)
        .iter()
        .zip(labels)
        .filter(|(p, l)| p == l)
        .count();
    Ok(LossOutput { loss, correct })
}

pub(super) fn round(t: &mut Tensor, p: Precision) {
    if p.is_low() {
        p.round(t.f32_mut());
    }
}

pub(super) fn widen(dst: &mut Tensor, src: &Tensor) {
    let d = dst.f32_mut();
    match src.dtype() {
        DType::BF16 => bf16_to_f32_par(d, bytemuck::cast_slice(src.bf16())),
        DType::F16 => f16_to_f32_par(d, bytemuck::cast_slice(src.f16())),
        DType::F32 => d.copy_from_slice(src.f32()),
        other => panic!("{}: cannot widen {other:?} to f32", src.tag()),
    }
}

pub(super) fn narrow(dst: &mut Tensor, src: &Tensor) {
    let s = src.f32();
    match dst.dtype() {
        DType::BF16 => f32_to_bf16_par(bytemuck::cast_slice_mut(dst.bf16_mut()), s),
        DType::F16 => f32_to_f16_par(bytemuck::cast_slice_mut(dst.f16_mut()), s),
        other => panic!("{}: cannot narrow f32 to {other:?}", dst.tag()),
    }
}

pub(super) fn copy_rounded(dst: &mut Tensor, src: &Tensor, p: Precision) {
    dst.f32_mut().copy_from_slice(src.f32());
    p.round(dst.f32_mut());
}

#[allow(clippy::too_many_arguments)]
pub(super) fn sgd_update(
    value: &mut Tensor,
    grad: &Tensor,
    momentum_buf: Option<&mut Tensor>,
    first: bool,
    lr: f32,
    momentum: f32,
    weight_decay: f32,
    nesterov: bool,
) {
    optim_update::sgd_update(
        value.f32_mut(),
        grad.f32(),
        momentum_buf.map(|t| t.f32_mut()),
        first,
        lr,
        momentum,
        weight_decay,
        nesterov,
    );
}

#[allow(clippy::too_many_arguments)]
pub(super) fn adamw_update(
    value: &mut Tensor,
    grad: &Tensor,
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    t: u64,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
) {
    optim_update::adamw_update(
        value.f32_mut(),
        grad.f32(),
        exp_avg.f32_mut(),
        exp_avg_sq.f32_mut(),
        t,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
    );
}

pub(super) fn sum_squares(t: &Tensor) -> f64 {
    t.f32().iter().map(|&x| f64::from(x) * f64::from(x)).sum()
}

pub(super) fn scale(t: &mut Tensor, c: f32) {
    t.f32_mut().iter_mut().for_each(|g| *g *= c);
}

pub(super) fn unscale(t: &mut Tensor, inv: f32) -> bool {
    let mut found_inf = false;
    for g in t.f32_mut() {
        *g *= inv;
        found_inf |= !g.is_finite();
    }
    found_inf
}

pub(super) fn all_finite(t: &Tensor) -> bool {
    // Every step's NaN guard reads all gradients (100 MB for ResNet-50):
    // chunks on all threads, each a branch-free sum of x - x, which is +0
    // for a finite x and NaN for inf or NaN, over independent lanes so it
    // vectorises (an early-exit `all(is_finite)` does not).
    t.f32().par_chunks(1 << 16).all(chunk_is_finite)
}

/// Whether every value of `c` is finite (see [`all_finite`]).
// `x - x` is the point: 0 for finite x, NaN otherwise.
#[allow(clippy::eq_op)]
fn chunk_is_finite(c: &[f32]) -> bool {
    const LANES: usize = 16;
    let mut acc = [0.0f32; LANES];
    let mut blocks = c.chunks_exact(LANES);
    for b in &mut blocks {
        for (a, &x) in acc.iter_mut().zip(b) {
            *a += x - x;
        }
    }
    let tail: f32 = blocks.remainder().iter().map(|&x| x - x).sum();
    acc.iter().sum::<f32>() + tail == 0.0
}

pub(super) fn copy_from_host(t: &mut Tensor, values: &[f32]) {
    t.f32_mut().copy_from_slice(values);
}

pub(super) fn copy_to_host_into(dst: &mut [f32], t: &Tensor) {
    dst.copy_from_slice(t.f32());
}

pub(super) fn copy(dst: &mut Tensor, src: &Tensor) {
    dst.f32_mut().copy_from_slice(src.f32());
}

pub(super) fn copy_range(dst: &mut Tensor, dst_at: usize, src: &Tensor, src_at: usize, len: usize) {
    dst.f32_mut()[dst_at..dst_at + len].copy_from_slice(&src.f32()[src_at..src_at + len]);
}

pub(super) fn all_reduce_sum(
    comm: &dyn crate::dist::Collective,
    recv: &mut Tensor,
    send: &Tensor,
    len: usize,
) -> crate::error::Result<()> {
    comm.sum_f32(&send.f32()[..len], &mut recv.f32_mut()[..len])
}

#[cfg(test)]
mod tests {
    use super::chunk_is_finite;

    #[test]
    fn the_finiteness_check_finds_every_non_finite_value_wherever_it_is() {
        for len in [0, 1, 15, 16, 17, 100] {
            let v: Vec<f32> = (0..len).map(|i| (i as f32 - 50.0) * 1e36).collect();
            assert!(chunk_is_finite(&v), "len {len}");
            for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                for at in 0..len {
                    let mut w = v.clone();
                    w[at] = bad;
                    assert!(!chunk_is_finite(&w), "{bad} at {at} of {len}");
                }
            }
        }
        // Large finite values never sum to inf: x - x is 0 for each.
        assert!(chunk_is_finite(&[f32::MAX; 40]));
    }
}
