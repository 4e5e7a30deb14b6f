//! Mixed precision: the element type activations are stored in, and the
//! conversions at the boundaries.
//!
//! Under bf16 or f16, every op that outputs the low type in PyTorch's
//! autocast (convolution, linear, batch norm, ReLU, residual add, pooling)
//! rounds its f32 result to the nearest low-type value, and a weight is
//! rounded to the low type before each convolution or matmul. A product of
//! two low-type values is exact in f32, so the f32 GEMM on rounded operands
//! computes what a low-type GEMM with f32 accumulation computes. What a
//! backward needs is *stored* in the low type (half the bytes: that is where
//! the memory goes) and converted back to f32, exactly, when read. Batch-norm
//! statistics, the loss, weight gradients and the master weights stay f32.
//! Activation gradients are rounded at the same points as activations, so
//! f16 overflows to inf where a real f16 pass would (the loss scaler's job).

use std::ops::Deref;

pub use crate::tensor::Precision;

use crate::backend;
use crate::error::Result;
use crate::memory::{Category, Pool, Tag};
use crate::tensor::{DType, Tensor};

/// An activation as a kernel reads it: the tensor itself, or a converted
/// copy in the workspace that is freed when the view drops.
pub enum View<'a> {
    Borrowed(&'a Tensor),
    Owned(Tensor),
}

impl Deref for View<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        match self {
            View::Borrowed(t) => t,
            View::Owned(t) => t,
        }
    }
}

/// Reads `t` as f32 (exact: every stored value is representable).
pub fn f32_view<'a>(pool: &Pool, t: &'a Tensor) -> Result<View<'a>> {
    if t.dtype() == DType::F32 {
        return Ok(View::Borrowed(t));
    }
    let (tag, _) = t.meta();
    let mut out = pool.empty_f32(t.dims(), Category::Workspace, tag)?;
    backend::widen(&mut out, t)?;
    Ok(View::Owned(out))
}

/// `t` as the kernels that read bf16 in place (batch norm, the residual
/// add, the native-GEMM convolutions) take it: itself when it is f32 or
/// bf16, else an exact f32 copy (f16).
pub fn bf16_or_f32_view<'a>(pool: &Pool, t: &'a Tensor) -> Result<View<'a>> {
    if t.dtype() == DType::BF16 {
        return Ok(View::Borrowed(t));
    }
    f32_view(pool, t)
}

/// `t` as an owned f32 tensor in its own category: itself when it is f32,
/// else a widened copy (and `t` is freed).
pub fn into_f32(pool: &Pool, t: Tensor) -> Result<Tensor> {
    if t.dtype() == DType::F32 {
        return Ok(t);
    }
    let (tag, category) = t.meta();
    let mut out = pool.empty_f32(t.dims(), category, tag)?;
    backend::widen(&mut out, &t)?;
    Ok(out)
}

/// `t` (f32, already rounded to `p`) as the backward stores it: itself under
/// fp32, else a low-type copy under the same tag and category, and the f32
/// original is freed.
pub fn store(pool: &Pool, t: Tensor, p: Precision) -> Result<Tensor> {
    if !p.is_low() || t.dtype() != DType::F32 {
        return Ok(t);
    }
    let (tag, category) = t.meta();
    let mut out = pool.empty(t.dims(), p.dtype(), category, tag)?;
    backend::narrow(&mut out, &t)?;
    Ok(out)
}

/// An activation gradient (rounded to `p`) as a block hands it to the
/// stage before it: under bf16 on a device that reads bf16 (`Capabilities::reads_bf16`),
/// a bf16 copy (lossless: every op rounds the gradients it outputs to
/// bf16, as a bf16 pass does) and the f32 original is freed; else itself.
/// The gradient a segment's replay waits with is then half the bytes.
pub fn store_grad(pool: &Pool, t: Tensor, p: Precision) -> Result<Tensor> {
    if t.dtype() == DType::F32 && p.bf16_in_place(t.device().capabilities()) {
        return store(pool, t, p);
    }
    Ok(t)
}

/// A copy of a weight rounded to `p` for one convolution or matmul, or
/// `None` under fp32 (use the weight itself).
pub fn rounded_weight(pool: &Pool, w: &Tensor, p: Precision, tag: Tag) -> Result<Option<Tensor>> {
    if !p.is_low() {
        return Ok(None);
    }
    let mut out = pool.empty_f32(w.dims(), Category::Workspace, tag)?;
    backend::copy_rounded(&mut out, w, p)?;
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn rounding_matches_the_half_crate_and_store_is_lossless_after_it() {
        let pool = Pool::new();
        let vals = [
            1.0f32,
            1.0 + 1.0 / 256.0,
            1.0 / 3.0,
            -2.5e-8,
            70000.0,
            3.0e38,
        ];
        for p in [Precision::BF16, Precision::F16] {
            let mut v = vals;
            p.round(&mut v);
            for (&r, &x) in v.iter().zip(&vals) {
                let want = match p {
                    Precision::BF16 => half::bf16::from_f32(x).to_f32(),
                    _ => f16::from_f32(x).to_f32(),
                };
                assert_eq!(r.to_bits(), want.to_bits(), "{p}: {x}");
            }
            let t = pool
                .from_f32(&[v.len()], &v, Category::Activations, Tag::fixed("t"))
                .unwrap();
            let stored = store(&pool, t, p).unwrap();
            assert_eq!(stored.dtype(), p.dtype());
            assert_eq!(stored.bytes(), 2 * v.len());
            let back = f32_view(&pool, &stored).unwrap();
            let got: Vec<u32> = back.f32().iter().map(|x| x.to_bits()).collect();
            let want: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
            assert_eq!(got, want, "{p}: store then widen is exact");
        }
        // f16 overflows where a real f16 op would; bf16 keeps the range.
        let mut big = [70000.0f32];
        Precision::F16.round(&mut big);
        assert!(big[0].is_infinite());
        let mut big = [70000.0f32];
        Precision::BF16.round(&mut big);
        assert_eq!(big[0], 70144.0);
    }

    #[test]
    fn fp32_views_and_stores_are_free() {
        let pool = Pool::new();
        let t = pool
            .from_f32(
                &[4],
                &[1.0, 2.0, 3.0, 4.0],
                Category::Activations,
                Tag::fixed("t"),
            )
            .unwrap();
        let before = pool.live_bytes();
        let t = store(&pool, t, Precision::F32).unwrap();
        let v = f32_view(&pool, &t).unwrap();
        assert_eq!(pool.live_bytes(), before, "no copies under fp32");
        assert!(matches!(v, View::Borrowed(_)));
        assert_eq!("bf16".parse::<Precision>().unwrap(), Precision::BF16);
        assert!("int8".parse::<Precision>().is_err());
    }
}
