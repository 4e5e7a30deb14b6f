//! CPU backend: GEMM through the `gemm` crate (f32) or our AVX512-BF16
//! kernel (bf16 mode), threads through rayon.

mod bf16_convert;
#[cfg(target_arch = "x86_64")]
mod bf16_gemm;
mod gemm;

pub use self::bf16_convert::{
    bf16_bits_to_f32, bf16_to_f32, f32_to_bf16, f32_to_bf16_bits, pair_to_bf16, round_to_bf16,
};

#[cfg(target_arch = "x86_64")]
pub use self::bf16_gemm::{available as bf16_gemm_available, gemm_bf16};

/// No bf16 kernel off x86-64: bf16 mode runs the f32 GEMM.
#[cfg(not(target_arch = "x86_64"))]
pub fn bf16_gemm_available() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
pub fn gemm_bf16(_: &mut [f32], _: MatRef<'_>, _: MatRef<'_>, _: Accumulate) {
    unreachable!("gemm_bf16 is only called when bf16_gemm_available()")
}
pub use self::gemm::{Accumulate, MatRef, gemm_f32};

/// The arithmetic a GEMM runs in. Operands and results are f32 storage
/// either way; `Bf16` operands are bf16-representable values (the bf16
/// precision mode rounds them first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmMath {
    F32,
    /// bf16 products, f32 accumulation: the AVX512-BF16 kernel where the
    /// CPU has it, else the f32 GEMM on the (already rounded) operands.
    Bf16,
}

/// `dst [+]= a · b` in the given arithmetic.
pub fn gemm(dst: &mut [f32], a: MatRef<'_>, b: MatRef<'_>, acc: Accumulate, math: GemmMath) {
    match math {
        GemmMath::Bf16 if bf16_gemm_available() => gemm_bf16(dst, a, b, acc),
        _ => gemm_f32(dst, a, b, acc),
    }
}

/// `dst (m, n) [+]= colsᵀ · b` in bf16, where `words` holds `k` rows of
/// ⌈m/2⌉ words (m bf16 values each, an odd tail zero): the weight gradient
/// of bf16 patch rows. Only when [`bf16_gemm_available`].
pub fn gemm_bf16_rows_transposed(
    dst: &mut [f32],
    words: &[u32],
    m: usize,
    k: usize,
    b: MatRef<'_>,
    acc: Accumulate,
) {
    #[cfg(target_arch = "x86_64")]
    bf16_gemm::gemm_bf16_lhs(
        dst,
        bf16_gemm::Lhs::Bf16RowsTransposed { words, m, k },
        b,
        acc,
        false,
    );
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dst, words, m, k, b, acc);
        unreachable!("gemm_bf16_rows_transposed is only called when bf16_gemm_available()")
    }
}

/// `dst [+]= a · b` in bf16 with `a` already as bf16 rows: `words` holds
/// `rows` × ⌈k/2⌉ words, two k-consecutive values per word (lower index in
/// the low half, an odd tail zero). With `round_output` the result is
/// stored rounded to bf16. Only when [`bf16_gemm_available`].
pub fn gemm_bf16_rows(
    dst: &mut [f32],
    words: &[u32],
    rows: usize,
    k: usize,
    b: MatRef<'_>,
    acc: Accumulate,
    round_output: bool,
) {
    #[cfg(target_arch = "x86_64")]
    bf16_gemm::gemm_bf16_lhs(
        dst,
        bf16_gemm::Lhs::Bf16Rows { words, rows, k },
        b,
        acc,
        round_output,
    );
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dst, words, rows, k, b, acc, round_output);
        unreachable!("gemm_bf16_rows is only called when bf16_gemm_available()")
    }
}

/// [`gemm`] in bf16 with the result stored rounded to bf16 (the native
/// kernel rounds as it stores; the fallback rounds after the f32 GEMM).
pub fn gemm_bf16_rounded(dst: &mut [f32], a: MatRef<'_>, b: MatRef<'_>, acc: Accumulate) {
    #[cfg(target_arch = "x86_64")]
    if bf16_gemm_available() {
        bf16_gemm::gemm_bf16_lhs(dst, bf16_gemm::Lhs::F32(a), b, acc, true);
        return;
    }
    gemm_f32(dst, a, b, acc);
    round_to_bf16(&mut dst[..a.rows * b.cols]);
}
