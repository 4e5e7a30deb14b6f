//! f32 ↔ bf16 conversions over slices: what the bf16 mode does to every
//! activation it rounds, stores, widens or packs for the GEMM. Rounding is
//! to nearest even with NaN kept quiet, exactly `half::bf16::from_f32`.
//!
//! They are memory-bound passes over whole activations, so each has an
//! AVX-512 path (16 values per instruction) and an AVX2 path (8 values, for
//! CPUs such as AMD Zen 3) besides the scalar one, chosen at run time; all
//! give the same bits.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// f32 to bf16 bits, rounding to nearest even (NaN stays a quiet NaN).
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    // Wrapping: only NaN patterns can carry past the top, and those take
    // the other branch.
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x0040;
    (if x.is_nan() { nan } else { rounded }) as u16
}

/// bf16 bits to f32 (exact).
#[inline(always)]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// The widest vector path this CPU runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Simd {
    Avx512,
    Avx2,
    Scalar,
}

fn simd() -> Simd {
    static SIMD: OnceLock<Simd> = OnceLock::new();
    *SIMD.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                return Simd::Avx512;
            }
            if is_x86_feature_detected!("avx2") {
                return Simd::Avx2;
            }
        }
        Simd::Scalar
    })
}

/// 16 values rounded to bf16, the bits in the low half of each lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn round16(x: __m512) -> __m512i {
    let b = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
    let nan = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
    let is_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    _mm512_mask_blend_epi32(is_nan, rounded, nan)
}

/// `dst[i] = bf16(src[i])`.
pub fn f32_to_bf16(dst: &mut [u16], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "f32_to_bf16: lengths");
    // SAFETY: `simd()` checked that the CPU has the features.
    #[cfg(target_arch = "x86_64")]
    let done = match simd() {
        Simd::Avx512 => unsafe { f32_to_bf16_avx512(dst, src) },
        Simd::Avx2 => unsafe { f32_to_bf16_avx2(dst, src) },
        Simd::Scalar => 0,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for (d, &s) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = f32_to_bf16_bits(s);
    }
}

/// Converts the whole 16-value blocks; returns how many values it did.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn f32_to_bf16_avx512(dst: &mut [u16], src: &[f32]) -> usize {
    let blocks = src.len() / 16;
    for i in 0..blocks {
        // SAFETY: block i lies inside both slices.
        unsafe {
            let x = _mm512_loadu_ps(src.as_ptr().add(16 * i));
            let h = _mm512_cvtepi32_epi16(round16(x));
            _mm256_storeu_si256(dst.as_mut_ptr().add(16 * i) as *mut __m256i, h);
        }
    }
    16 * blocks
}

/// `v[i] = f32(bf16(v[i]))`: rounds in place.
pub fn round_to_bf16(v: &mut [f32]) {
    // SAFETY: `simd()` checked that the CPU has the features.
    #[cfg(target_arch = "x86_64")]
    let done = match simd() {
        Simd::Avx512 => unsafe { round_avx512(v) },
        Simd::Avx2 => unsafe { round_avx2(v) },
        Simd::Scalar => 0,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for x in &mut v[done..] {
        *x = bf16_bits_to_f32(f32_to_bf16_bits(*x));
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn round_avx512(v: &mut [f32]) -> usize {
    let blocks = v.len() / 16;
    for i in 0..blocks {
        // SAFETY: block i lies inside the slice.
        unsafe {
            let p = v.as_mut_ptr().add(16 * i);
            let r = _mm512_slli_epi32::<16>(round16(_mm512_loadu_ps(p)));
            _mm512_storeu_ps(p, _mm512_castsi512_ps(r));
        }
    }
    16 * blocks
}

/// `dst[i] = f32(src[i])` (exact).
pub fn bf16_to_f32(dst: &mut [f32], src: &[u16]) {
    assert_eq!(dst.len(), src.len(), "bf16_to_f32: lengths");
    // SAFETY: `simd()` checked that the CPU has the features.
    #[cfg(target_arch = "x86_64")]
    let done = match simd() {
        Simd::Avx512 => unsafe { widen_avx512(dst, src) },
        Simd::Avx2 => unsafe { widen_avx2(dst, src) },
        Simd::Scalar => 0,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for (d, &s) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = bf16_bits_to_f32(s);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen_avx512(dst: &mut [f32], src: &[u16]) -> usize {
    let blocks = src.len() / 16;
    for i in 0..blocks {
        // SAFETY: block i lies inside both slices.
        unsafe {
            let h = _mm256_loadu_si256(src.as_ptr().add(16 * i) as *const __m256i);
            let w = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
            _mm512_storeu_ps(dst.as_mut_ptr().add(16 * i), _mm512_castsi512_ps(w));
        }
    }
    16 * blocks
}

/// 8 values rounded to bf16, the bits in the low half of each lane
/// ([`round16`] on AVX2).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn round8(x: __m256) -> __m256i {
    let b = _mm256_castps_si256(x);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
    let bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, bias));
    let nan = _mm256_or_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(0x40));
    let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    _mm256_blendv_epi8(rounded, nan, is_nan)
}

/// Converts the whole 16-value blocks; returns how many values it did.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn f32_to_bf16_avx2(dst: &mut [u16], src: &[f32]) -> usize {
    let blocks = src.len() / 16;
    for i in 0..blocks {
        // SAFETY: block i lies inside both slices.
        unsafe {
            let p = src.as_ptr().add(16 * i);
            let lo = round8(_mm256_loadu_ps(p));
            let hi = round8(_mm256_loadu_ps(p.add(8)));
            // Every lane is below 0x10000, so the saturating pack is exact;
            // it interleaves 64-bit quarters (lo0 hi0 lo1 hi1), which the
            // permute puts back in order.
            let packed = _mm256_packus_epi32(lo, hi);
            let h = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
            _mm256_storeu_si256(dst.as_mut_ptr().add(16 * i) as *mut __m256i, h);
        }
    }
    16 * blocks
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn round_avx2(v: &mut [f32]) -> usize {
    let blocks = v.len() / 8;
    for i in 0..blocks {
        // SAFETY: block i lies inside the slice.
        unsafe {
            let p = v.as_mut_ptr().add(8 * i);
            let r = _mm256_slli_epi32::<16>(round8(_mm256_loadu_ps(p)));
            _mm256_storeu_ps(p, _mm256_castsi256_ps(r));
        }
    }
    8 * blocks
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_avx2(dst: &mut [f32], src: &[u16]) -> usize {
    let blocks = src.len() / 8;
    for i in 0..blocks {
        // SAFETY: block i lies inside both slices.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(8 * i) as *const __m128i);
            let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
            _mm256_storeu_ps(dst.as_mut_ptr().add(8 * i), _mm256_castsi256_ps(w));
        }
    }
    8 * blocks
}

/// `dst[i] = bf16(lo[i]) | bf16(hi[i]) << 16` (hi = 0 when `None`): two
/// k-consecutive values per word, the operand form of `vdpbf16ps`.
pub fn pair_to_bf16(dst: &mut [u32], lo: &[f32], hi: Option<&[f32]>) {
    assert_eq!(dst.len(), lo.len(), "pair_to_bf16: lengths");
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    // Only the AVX512-BF16 GEMM packs pairs, so there is no AVX2 path.
    if simd() == Simd::Avx512 && hi.is_some() {
        // SAFETY: the CPU has the features (checked above).
        done = unsafe { pair_avx512(dst, lo, hi.unwrap_or(&[])) };
    }
    for (i, d) in dst.iter_mut().enumerate().skip(done) {
        let h = hi.map_or(0, |h| f32_to_bf16_bits(h[i]) as u32);
        *d = f32_to_bf16_bits(lo[i]) as u32 | (h << 16);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pair_avx512(dst: &mut [u32], lo: &[f32], hi: &[f32]) -> usize {
    assert_eq!(hi.len(), lo.len(), "pair_to_bf16: lengths");
    let blocks = lo.len() / 16;
    for i in 0..blocks {
        // SAFETY: block i lies inside all three slices.
        unsafe {
            let l = round16(_mm512_loadu_ps(lo.as_ptr().add(16 * i)));
            let h = round16(_mm512_loadu_ps(hi.as_ptr().add(16 * i)));
            let w = _mm512_or_si512(l, _mm512_slli_epi32::<16>(h));
            _mm512_storeu_si512(dst.as_mut_ptr().add(16 * i) as *mut __m512i, w);
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
            f32::MIN_POSITIVE,
            1e-40,
            -1e-40,
            f32::MAX,
            -f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7fff_ffff),
            f32::from_bits(0xffff_ffff),
        ];
        // A sweep of bit patterns, and exact ties (low 16 bits 0x8000).
        v.extend((0..20_000u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761))));
        v.extend((0..1000u32).map(|i| f32::from_bits(0x3f80_8000 + (i << 16))));
        v.push(1.5); // an odd tail past the last 16-value block
        v
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn scalar_rounding_equals_half() {
        for x in values() {
            let want = half::bf16::from_f32(x);
            let got = f32_to_bf16_bits(x);
            assert!(
                same(bf16_bits_to_f32(got), want.to_f32()),
                "{x:e} ({:#x})",
                x.to_bits()
            );
            if !x.is_nan() {
                assert_eq!(got, want.to_bits(), "{x:e}");
            }
        }
    }

    #[test]
    fn slice_paths_equal_the_scalar_path() {
        let v = values();
        let mut bits = vec![0u16; v.len()];
        f32_to_bf16(&mut bits, &v);
        let mut rounded = v.clone();
        round_to_bf16(&mut rounded);
        let mut back = vec![0f32; v.len()];
        bf16_to_f32(&mut back, &bits);
        let hi: Vec<f32> = v.iter().rev().copied().collect();
        let mut pairs = vec![0u32; v.len()];
        pair_to_bf16(&mut pairs, &v, Some(&hi));
        let mut lone = vec![0u32; v.len()];
        pair_to_bf16(&mut lone, &v, None);
        for (i, &x) in v.iter().enumerate() {
            let want = f32_to_bf16_bits(x);
            assert_eq!(bits[i], want, "{x:e}");
            assert!(same(rounded[i], bf16_bits_to_f32(want)), "{x:e}");
            assert_eq!(back[i].to_bits(), (want as u32) << 16);
            let want_pair = want as u32 | ((f32_to_bf16_bits(hi[i]) as u32) << 16);
            assert_eq!(pairs[i], want_pair, "{x:e}");
            assert_eq!(lone[i], want as u32);
        }
    }

    /// The AVX2 kernels directly, so they are checked on AVX-512 CPUs too
    /// (where the slice functions take the AVX-512 path).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_paths_equal_the_scalar_path() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let v = values();
        let mut bits = vec![0u16; v.len()];
        let mut rounded = v.clone();
        let want_bits: Vec<u16> = v.iter().map(|&x| f32_to_bf16_bits(x)).collect();
        let mut back = vec![0f32; v.len()];
        // SAFETY: the CPU has AVX2 (checked above).
        let (narrowed, rounded_n, widened) = unsafe {
            (
                f32_to_bf16_avx2(&mut bits, &v),
                round_avx2(&mut rounded),
                widen_avx2(&mut back, &want_bits),
            )
        };
        assert_eq!(narrowed, v.len() / 16 * 16);
        assert_eq!(rounded_n, v.len() / 8 * 8);
        assert_eq!(widened, v.len() / 8 * 8);
        for i in 0..narrowed {
            assert_eq!(bits[i], want_bits[i], "{:e}", v[i]);
        }
        for i in 0..rounded_n {
            assert!(
                same(rounded[i], bf16_bits_to_f32(want_bits[i])),
                "{:e}",
                v[i]
            );
            assert_eq!(back[i].to_bits(), (want_bits[i] as u32) << 16);
        }
    }
}
