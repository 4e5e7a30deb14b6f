//! f32 ↔ f16 conversions over slices: what the f16 mode does to every
//! activation it rounds, stores or widens. Rounding is to nearest even,
//! overflow goes to ±inf, exactly `half::f16::from_f32`.
//!
//! With AVX-512F each instruction converts 16 values (`vcvtps2ph` /
//! `vcvtph2ps` on zmm), inlined into the loop; elsewhere `half`'s slice
//! conversions run (F16C, 8 values per call, where the CPU has it). Both
//! give the same bits. Rounding in place goes through a small stack buffer,
//! never a heap copy of the slice.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::sync::OnceLock;

use half::f16;
use half::slice::HalfFloatSliceExt;

fn avx512() -> bool {
    static AVX512: OnceLock<bool> = OnceLock::new();
    *AVX512.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512f")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// `dst[i] = f16(src[i])`, as bits.
pub fn f32_to_f16(dst: &mut [u16], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "f32_to_f16: lengths");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `avx512()` checked that the CPU has AVX-512F.
    let done = if avx512() {
        unsafe { narrow_avx512(dst, src) }
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    let tail: &mut [f16] = bytemuck::cast_slice_mut(&mut dst[done..]);
    tail.convert_from_f32_slice(&src[done..]);
}

/// `dst[i] = f32(src[i])` of f16 bits (exact).
pub fn f16_to_f32(dst: &mut [f32], src: &[u16]) {
    assert_eq!(dst.len(), src.len(), "f16_to_f32: lengths");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as in `f32_to_f16`.
    let done = if avx512() {
        unsafe { widen_avx512(dst, src) }
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    let tail: &[f16] = bytemuck::cast_slice(&src[done..]);
    tail.convert_to_f32_slice(&mut dst[done..]);
}

/// `v[i] = f32(f16(v[i]))`: rounds in place.
pub fn round_to_f16(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as in `f32_to_f16`.
    let done = if avx512() {
        unsafe { round_avx512(v) }
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    let mut buf = [f16::ZERO; 256];
    for chunk in v[done..].chunks_mut(buf.len()) {
        let b = &mut buf[..chunk.len()];
        b.convert_from_f32_slice(chunk);
        b.convert_to_f32_slice(chunk);
    }
}

/// Rounding to nearest even, no exceptions raised: `half`'s rounding.
#[cfg(target_arch = "x86_64")]
const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

/// Converts the whole 16-value blocks; returns how many values it did.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn narrow_avx512(dst: &mut [u16], src: &[f32]) -> usize {
    let blocks = src.len() / 16;
    for i in 0..blocks {
        // SAFETY: block i lies inside both slices.
        unsafe {
            let x = _mm512_loadu_ps(src.as_ptr().add(16 * i));
            let h = _mm512_cvtps_ph::<NEAREST>(x);
            _mm256_storeu_si256(dst.as_mut_ptr().add(16 * i) as *mut __m256i, h);
        }
    }
    16 * blocks
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_avx512(dst: &mut [f32], src: &[u16]) -> usize {
    let blocks = src.len() / 16;
    for i in 0..blocks {
        // SAFETY: block i lies inside both slices.
        unsafe {
            let h = _mm256_loadu_si256(src.as_ptr().add(16 * i) as *const __m256i);
            _mm512_storeu_ps(dst.as_mut_ptr().add(16 * i), _mm512_cvtph_ps(h));
        }
    }
    16 * blocks
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn round_avx512(v: &mut [f32]) -> usize {
    let blocks = v.len() / 16;
    for i in 0..blocks {
        // SAFETY: block i lies inside the slice.
        unsafe {
            let p = v.as_mut_ptr().add(16 * i);
            let h = _mm512_cvtps_ph::<NEAREST>(_mm512_loadu_ps(p));
            _mm512_storeu_ps(p, _mm512_cvtph_ps(h));
        }
    }
    16 * blocks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values() -> Vec<f32> {
        let mut v = vec![
            0.0f32,
            -0.0,
            65504.0,
            65520.0, // the first value that rounds to inf
            -65520.0,
            6.0e-8,
            2.9e-8, // under half the least subnormal: to zero
            1e-40,
            f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        // A sweep of bit patterns, and exact f16 ties (low 13 bits 0x1000).
        v.extend((0..20_000u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761))));
        v.extend((0..1000u32).map(|i| f32::from_bits(0x3f80_1000 + (i << 13))));
        v.push(1.5); // a tail past the last 16-value block
        v
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn slice_conversions_equal_half_value_by_value() {
        let v = values();
        let mut bits = vec![0u16; v.len()];
        f32_to_f16(&mut bits, &v);
        let mut rounded = v.clone();
        round_to_f16(&mut rounded);
        let mut back = vec![0f32; v.len()];
        f16_to_f32(&mut back, &bits);
        for (i, &x) in v.iter().enumerate() {
            let want = f16::from_f32(x);
            if !x.is_nan() {
                assert_eq!(bits[i], want.to_bits(), "{x:e}");
            }
            assert!(same(rounded[i], want.to_f32()), "{x:e}");
            assert!(same(back[i], f16::from_bits(bits[i]).to_f32()), "{x:e}");
        }
    }
}
