//! CPU backend: GEMM through the `gemm` crate (f32) or our AVX512-BF16
//! kernel (bf16 mode), threads through rayon.

mod bf16_convert;
#[cfg(target_arch = "x86_64")]
mod bf16_gemm;
mod gemm;

pub use self::bf16_convert::{
    bf16_bits_to_f32, bf16_to_f32, f32_to_bf16, f32_to_bf16_bits, pair_to_bf16, round_to_bf16,
};

pub use self::gemm::{Accumulate, MatRef, gemm_f32};

#[cfg(target_arch = "x86_64")]
pub use self::bf16_gemm::{available as bf16_gemm_available, gemm_bf16_lhs, pack_rhs};

/// No bf16 kernel off x86-64: bf16 mode runs the f32 GEMM.
#[cfg(not(target_arch = "x86_64"))]
pub fn bf16_gemm_available() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
pub fn gemm_bf16_lhs(_: &mut [f32], _: Lhs<'_>, _: Rhs<'_>, _: Accumulate, _: bool) {
    unreachable!("gemm_bf16_lhs is only called when bf16_gemm_available()")
}

#[cfg(not(target_arch = "x86_64"))]
pub fn pack_rhs(_: MatRef<'_>) -> PackedRhs {
    unreachable!("pack_rhs is only called when bf16_gemm_available()")
}

/// The right operand of the bf16 GEMM ([`gemm_bf16_lhs`]).
#[derive(Clone, Copy)]
pub enum Rhs<'a> {
    /// f32 values, rounded to bf16 and packed by the call.
    F32(MatRef<'a>),
    /// Packed once by [`pack_rhs`] for several calls.
    Packed(&'a PackedRhs),
}

impl Rhs<'_> {
    /// (inner dimension, columns) of the operand.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            Rhs::F32(b) => (b.rows, b.cols),
            Rhs::Packed(p) => (p.k, p.n),
        }
    }
}

/// A (k, n) right operand in the bf16 GEMM's packed layout (NR-column
/// panels of k-pair words), from [`pack_rhs`]. Ordinary heap memory, like
/// the GEMM's per-call packing buffers; a dropped one's buffer is kept for
/// the next packing.
pub struct PackedRhs {
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    words: Vec<u32>,
    k: usize,
    n: usize,
}

#[cfg(target_arch = "x86_64")]
impl Drop for PackedRhs {
    fn drop(&mut self) {
        bf16_gemm::return_words(std::mem::take(&mut self.words));
    }
}

/// The left operand of the bf16 GEMM ([`gemm_bf16_lhs`]).
#[derive(Clone, Copy)]
pub enum Lhs<'a> {
    /// f32 values, rounded to bf16 as they are packed.
    F32(MatRef<'a>),
    /// Rows already in bf16, read in place: `words` holds `rows` × ⌈k/2⌉
    /// words, two k-consecutive values per word (lower index in the low
    /// half, an odd tail zero).
    Bf16Rows {
        words: &'a [u32],
        rows: usize,
        k: usize,
    },
    /// The transpose of such rows: `words` holds `k` rows of ⌈m/2⌉ words
    /// (m bf16 values each), and the operand is their transpose (m, k) —
    /// the patches of a weight gradient.
    Bf16RowsTransposed {
        words: &'a [u32],
        m: usize,
        k: usize,
    },
}

impl Lhs<'_> {
    /// (rows, inner dimension) of the operand.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            Lhs::F32(a) => (a.rows, a.cols),
            Lhs::Bf16Rows { rows, k, .. } => (*rows, *k),
            Lhs::Bf16RowsTransposed { m, k, .. } => (*m, *k),
        }
    }
}

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

impl GemmMath {
    /// Whether this arithmetic runs the native bf16 kernel here (which
    /// takes [`Lhs`] operands in bf16 and rounds f32 ones while packing).
    pub fn native_bf16(self) -> bool {
        self == GemmMath::Bf16 && bf16_gemm_available()
    }
}

/// `dst [+]= a · b` in the given arithmetic.
pub fn gemm(dst: &mut [f32], a: MatRef<'_>, b: MatRef<'_>, acc: Accumulate, math: GemmMath) {
    if math.native_bf16() {
        gemm_bf16_lhs(dst, Lhs::F32(a), Rhs::F32(b), acc, false)
    } else {
        gemm_f32(dst, a, b, acc)
    }
}

/// [`gemm`] in bf16 with the result stored rounded to bf16 (the native
/// kernel rounds as it stores; the fallback rounds after the f32 GEMM).
pub fn gemm_bf16_rounded(dst: &mut [f32], a: MatRef<'_>, b: MatRef<'_>, acc: Accumulate) {
    if GemmMath::Bf16.native_bf16() {
        gemm_bf16_lhs(dst, Lhs::F32(a), Rhs::F32(b), acc, true);
    } else {
        gemm_f32(dst, a, b, acc);
        round_to_bf16(&mut dst[..a.rows * b.cols]);
    }
}
