//! CPU backend: GEMM through the `gemm` crate (f32) or our bf16 kernels
//! (bf16 mode: AMX or AVX512-BF16, [`bf16_path`]), threads through rayon.

#[cfg(target_arch = "x86_64")]
mod amx;
mod bf16_convert;
#[cfg(target_arch = "x86_64")]
mod bf16_gemm;
mod f16_convert;
mod gemm;

use std::sync::OnceLock;

pub use self::bf16_convert::{
    bf16_bits_to_f32, bf16_to_f32, f32_to_bf16, f32_to_bf16_bits, pair_to_bf16, round_to_bf16,
};

pub use self::f16_convert::{f16_to_f32, f32_to_f16, round_to_f16};
pub use self::gemm::{Accumulate, MatRef, gemm_f32};

#[cfg(target_arch = "x86_64")]
pub use self::bf16_gemm::{gemm_bf16_lhs, pack_rhs};

/// The arithmetic the CPU runs the bf16 mode's GEMMs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Path {
    /// AMX tiles, `tdpbf16ps` ([`amx`]).
    Amx,
    /// AVX512-BF16 vectors, `vdpbf16ps` ([`bf16_gemm`]).
    Avx512Bf16,
    /// The f32 GEMM on operands already rounded to bf16: the same values,
    /// no speed-up.
    F32,
}

impl Bf16Path {
    /// The value of `MEMFIT_CPU_BF16` that forces this path.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Path::Amx => "amx",
            Bf16Path::Avx512Bf16 => "avx512bf16",
            Bf16Path::F32 => "f32",
        }
    }

    /// The path and its instruction, as `bench step` prints it.
    pub fn describe(self) -> &'static str {
        match self {
            Bf16Path::Amx => "amx (tdpbf16ps)",
            Bf16Path::Avx512Bf16 => "avx512bf16 (vdpbf16ps)",
            Bf16Path::F32 => "f32 (f32 products of bf16-rounded operands)",
        }
    }
}

/// The env var that forces a bf16 path: `amx`, `avx512bf16` or `f32`
/// (unset, empty or `auto`: the fastest the CPU has).
pub const BF16_PATH_VAR: &str = "MEMFIT_CPU_BF16";

/// The least `vdpbf16ps` flop rate, as a multiple of the f32 FMA's, at
/// which the AVX512-BF16 kernel is the automatic path. Below it the f32
/// GEMM on bf16-rounded operands is faster: on the Intel Xeon of
/// 2026-12-07 (rate 0.50) our kernel reached 0.82 of `vdpbf16ps`'s peak and
/// the `gemm` crate 0.6 of the FMA's, a break-even near 0.73, and a
/// ResNet-50 bf16 step took 3.43 s on the kernel against 2.53 s on the f32
/// GEMM. CPUs that run it at twice the FMA's rate (AMD Zen 4) are far above.
pub const MIN_DOT_TO_FMA_RATE: f64 = 0.8;

/// The path for a `MEMFIT_CPU_BF16` value on a CPU with (`amx`,
/// `avx512bf16`) of the instructions, and the warning to print when the
/// request cannot be honoured. `dot_rate` measures `vdpbf16ps`'s flop rate
/// against the f32 FMA's; it is called only when the automatic choice
/// rests on it (AVX512-BF16 without AMX). An unknown value, or a path this
/// CPU lacks, is not an error: the warning names it and the automatic
/// choice runs (a forced path is a benchmarking aid, and falling back
/// changes speed, never results beyond the stated tolerances).
pub fn choose_bf16_path(
    request: Option<&str>,
    amx: bool,
    avx512bf16: bool,
    dot_rate: &dyn Fn() -> f64,
) -> (Bf16Path, Option<String>) {
    let auto = || {
        if amx {
            Bf16Path::Amx
        } else if avx512bf16 && dot_rate() >= MIN_DOT_TO_FMA_RATE {
            Bf16Path::Avx512Bf16
        } else {
            Bf16Path::F32
        }
    };
    let wanted = match request.map(str::trim) {
        None | Some("") | Some("auto") => return (auto(), None),
        Some("amx") => Bf16Path::Amx,
        Some("avx512bf16") => Bf16Path::Avx512Bf16,
        Some("f32") => Bf16Path::F32,
        Some(other) => {
            let auto = auto();
            return (
                auto,
                Some(format!(
                    "warning: {BF16_PATH_VAR}={other:?} is not one of amx, avx512bf16, f32, auto; using {}",
                    auto.name()
                )),
            );
        }
    };
    let present = match wanted {
        Bf16Path::Amx => amx,
        Bf16Path::Avx512Bf16 => avx512bf16,
        Bf16Path::F32 => true,
    };
    if present {
        (wanted, None)
    } else {
        let auto = auto();
        let warning = format!(
            "warning: {BF16_PATH_VAR}={}: this CPU (or OS) does not run it; using {}",
            wanted.name(),
            auto.name()
        );
        (auto, Some(warning))
    }
}

/// `vdpbf16ps`'s measured flop rate over the f32 FMA's on this CPU, once
/// per process; `None` without AVX512-BF16.
pub fn dot_to_fma_rate() -> Option<f64> {
    static RATE: OnceLock<Option<f64>> = OnceLock::new();
    *RATE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        let rate = bf16_gemm::available().then(bf16_gemm::dot_to_fma_rate);
        #[cfg(not(target_arch = "x86_64"))]
        let rate = None;
        rate
    })
}

/// The bf16 path of this process: chosen once, from the CPU (its
/// instructions and, for AVX512-BF16, their measured speed) and
/// `MEMFIT_CPU_BF16` (a warning on stderr the first time when that cannot
/// be honoured, [`choose_bf16_path`]).
pub fn bf16_path_kind() -> Bf16Path {
    static PATH: OnceLock<Bf16Path> = OnceLock::new();
    *PATH.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        let (amx, avx) = (amx::available(), bf16_gemm::available());
        #[cfg(not(target_arch = "x86_64"))]
        let (amx, avx) = (false, false);
        let request = std::env::var(BF16_PATH_VAR).ok();
        let rate = || dot_to_fma_rate().unwrap_or(0.0);
        let (path, warning) = choose_bf16_path(request.as_deref(), amx, avx, &rate);
        if let Some(w) = warning {
            eprintln!("{w}");
        }
        path
    })
}

/// The path and why, as `bench step` prints it: [`bf16_path`], and where
/// the CPU has AVX512-BF16, `vdpbf16ps`'s measured flop rate against the
/// f32 FMA's (what chose between the two when there is no AMX).
pub fn bf16_path_report() -> String {
    let path = bf16_path();
    match dot_to_fma_rate() {
        Some(rate) => format!(
            "{path}; vdpbf16ps measured at {rate:.2}x the f32 FMA's flop rate here \
             (the AVX512-BF16 kernel runs by default from {MIN_DOT_TO_FMA_RATE}x)"
        ),
        None => path.to_string(),
    }
}

/// [`bf16_path_kind`] in words, e.g. `amx (tdpbf16ps)`.
pub fn bf16_path() -> &'static str {
    bf16_path_kind().describe()
}

/// Whether bf16 GEMMs run a native bf16 kernel here (AMX or AVX512-BF16).
pub fn bf16_gemm_available() -> bool {
    bf16_path_kind() != Bf16Path::F32
}

/// The micro-kernel of [`gemm_bf16_lhs`]: AMX on that path, else
/// AVX512-BF16.
#[cfg(target_arch = "x86_64")]
fn bf16_kernel() -> bf16_gemm::Kernel {
    match bf16_path_kind() {
        Bf16Path::Amx => bf16_gemm::Kernel::Amx,
        Bf16Path::Avx512Bf16 | Bf16Path::F32 => bf16_gemm::Kernel::Avx512Bf16,
    }
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
    /// bf16 products, f32 accumulation: the AMX or AVX512-BF16 kernel where
    /// the CPU has it ([`bf16_path`]), else the f32 GEMM on the (already
    /// rounded) operands.
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
        round_to_bf16_par(&mut dst[..a.rows * b.cols]);
    }
}

/// Elements per thread's share in the `_par` conversions below (they are
/// elementwise, so the bits do not depend on the split).
const PAR_CHUNK: usize = 1 << 14;

/// [`round_to_bf16`] split over the threads.
pub fn round_to_bf16_par(v: &mut [f32]) {
    use rayon::prelude::*;
    v.par_chunks_mut(PAR_CHUNK).for_each(round_to_bf16);
}

/// `convert(dst chunk, src chunk)` over equal-length slices, split over the
/// threads in [`PAR_CHUNK`]-element chunks (the four `*_par` conversions).
fn convert_par<D: Send, S: Sync>(
    what: &str,
    dst: &mut [D],
    src: &[S],
    convert: impl Fn(&mut [D], &[S]) + Sync,
) {
    use rayon::prelude::*;
    assert_eq!(dst.len(), src.len(), "{what}: lengths");
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(src.par_chunks(PAR_CHUNK))
        .for_each(|(d, s)| convert(d, s));
}

/// [`bf16_to_f32`] split over the threads.
pub fn bf16_to_f32_par(dst: &mut [f32], src: &[u16]) {
    convert_par("bf16_to_f32_par", dst, src, bf16_to_f32);
}

/// [`f32_to_bf16`] split over the threads.
pub fn f32_to_bf16_par(dst: &mut [u16], src: &[f32]) {
    convert_par("f32_to_bf16_par", dst, src, f32_to_bf16);
}

/// [`f16_to_f32`] split over the threads.
pub fn f16_to_f32_par(dst: &mut [f32], src: &[u16]) {
    convert_par("f16_to_f32_par", dst, src, f16_to_f32);
}

/// [`f32_to_f16`] split over the threads.
pub fn f32_to_f16_par(dst: &mut [u16], src: &[f32]) {
    convert_par("f32_to_f16_par", dst, src, f32_to_f16);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dot_product_rate_is_measured_sanely() {
        // Whatever this CPU is, a rate is a positive finite number, and
        // twice-measured rates agree to within a factor of two (the two
        // kinds of CPU we know sit at 0.5 and 2, far from the threshold).
        if let Some(rate) = dot_to_fma_rate() {
            assert!(rate.is_finite() && rate > 0.05 && rate < 20.0, "{rate}");
            #[cfg(target_arch = "x86_64")]
            {
                let again = bf16_gemm::dot_to_fma_rate();
                assert!(
                    again / rate < 2.0 && rate / again < 2.0,
                    "{rate} vs {again}"
                );
            }
        }
    }

    #[test]
    fn the_bf16_path_follows_the_cpu_and_the_env_var() {
        use Bf16Path::*;
        let fast = || 2.0;
        let pick = |req, amx, avx| choose_bf16_path(req, amx, avx, &fast);
        assert_eq!(pick(None, true, true), (Amx, None));
        assert_eq!(pick(Some("auto"), false, true), (Avx512Bf16, None));
        assert_eq!(pick(None, false, false), (F32, None));
        // AVX512-BF16 whose dot products are slower than the f32 FMA's:
        // the f32 GEMM, unless forced.
        let slow = || 0.5;
        let pick_slow = |req, amx| choose_bf16_path(req, amx, true, &slow);
        assert_eq!(pick_slow(None, false), (F32, None));
        assert_eq!(pick_slow(None, true), (Amx, None));
        assert_eq!(pick_slow(Some("avx512bf16"), false), (Avx512Bf16, None));
        // The rate is measured only when the choice rests on it.
        let unmeasured = || -> f64 { panic!("measured") };
        assert_eq!(choose_bf16_path(None, true, true, &unmeasured), (Amx, None));
        assert_eq!(
            choose_bf16_path(Some("f32"), false, true, &unmeasured),
            (F32, None)
        );
        assert_eq!(pick(Some("avx512bf16"), true, true), (Avx512Bf16, None));
        assert_eq!(pick(Some("f32"), true, true), (F32, None));
        // What the CPU cannot run, or a typo: the automatic path, warned.
        let (path, warning) = pick(Some("amx"), false, true);
        assert_eq!(path, Avx512Bf16);
        assert!(warning.unwrap().contains("MEMFIT_CPU_BF16=amx"));
        let (path, warning) = pick(Some("AMX!"), true, true);
        assert_eq!(path, Amx);
        assert!(warning.unwrap().contains("not one of"));
    }
}
