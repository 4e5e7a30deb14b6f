//! bf16 GEMM with f32 accumulation on AVX512-BF16 (`vdpbf16ps`), for the
//! bf16 precision mode: `dst (m, n) [+]= a (m, k) · b (k, n)`.
//!
//! The `gemm` crate has no bf16, and the mode's operands already hold
//! bf16-representable values in f32 storage, so this kernel packs them into
//! bf16 pairs (round to nearest even, exact for such values) and multiplies
//! at twice the f32 FMA rate. Each product of two bf16 values is exact in
//! f32; `vdpbf16ps` adds two of them per lane into an f32 accumulator.
//!
//! Layout, BLIS style:
//! * `b` is packed into panels of [`NR`] columns: for each k-pair, NR u32
//!   words holding (b[2p][j], b[2p+1][j]); once for many calls
//!   ([`pack_rhs`], a convolution's weight), or by the call itself one
//!   chunk of k at a time ([`rhs_chunk`], a weight gradient's `dy`);
//! * each parallel task owns up to [`MC_MAX`] rows of `dst`, packs its rows of `a` per
//!   [`KC`] block into micro-panels of [`MR`] rows (one u32 pair per row and
//!   k-pair), and runs the MR×NR micro-kernel over them;
//! * k is walked in the same order whatever the thread count, and tasks
//!   split rows only, so results do not depend on the number of threads.
//!
//! Packing buffers (a copy of `b` or of a chunk of it, and a block of `a`
//! per task) are ordinary heap memory, like the `gemm` crate's own packing
//! buffers. Copies of `b` are large (a weight is megabytes; a chunk up to
//! 1 MiB), so a few freed ones are kept for the next call ([`take_words`]):
//! a fresh allocation of that size comes from `mmap` and pays a page fault
//! per 4 KiB on first touch, which cost more than the packing itself.

use std::arch::x86_64::*;
use std::sync::{Mutex, OnceLock};

use rayon::prelude::*;

use super::bf16_convert::round16;
use super::gemm::{Accumulate, MatRef};
use super::{Lhs, PackedRhs, Rhs};
use super::{bf16_bits_to_f32, f32_to_bf16, f32_to_bf16_bits, pair_to_bf16};

const MR: usize = 8;
pub(super) const NR: usize = 32;
/// k elements per block (even): one block's A micro-panel is MR·KC/2 words.
const KC: usize = 256;
/// Most rows of `dst` per parallel task (fewer when `m` is small, so every
/// thread gets several tasks). The split does not change any result: each
/// element is computed the same way whatever task holds its row.
const MC_MAX: usize = 128;

fn rows_per_task(m: usize) -> usize {
    let per = m.div_ceil(4 * rayon::current_num_threads().max(1));
    per.div_ceil(MR).clamp(1, MC_MAX / MR) * MR
}

/// k-pairs per packed panel of `b` are padded (with zeros) to a multiple
/// of this: the AMX kernel ([`super::amx`]) reads B tiles of 16 k-pairs.
const PAIR_ALIGN: usize = 16;

/// k-pair rows in each NR-column panel of a packed (k, n) `b`: ⌈k/2⌉
/// rounded up to [`PAIR_ALIGN`] (the padding rows are zero).
pub(super) fn panel_pairs(k: usize) -> usize {
    k.div_ceil(2).next_multiple_of(PAIR_ALIGN)
}

/// Which bf16 micro-kernel [`gemm_bf16_kernel`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernel {
    /// `vdpbf16ps`, MR×NR register tiles (this file).
    Avx512Bf16,
    /// `tdpbf16ps`, 32×32 blocks of AMX tiles ([`super::amx`]).
    Amx,
}

/// Whether this CPU runs the kernel (AVX-512F and AVX512-BF16).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
    })
}

/// Loop trips per timing, each 16 instructions on independent accumulators
/// (more than latency × issue rate on the CPUs we know): about 0.05 ms of
/// `vfmadd`.
const RATE_TRIPS: usize = 16_384;

/// `vdpbf16ps`'s f32 flop rate over `vfmadd231ps`'s on this core (each on
/// zmm registers, independent chains; `vdpbf16ps` counts 64 flops, two
/// products and two additions per lane, `vfmadd231ps` 32), the best of a
/// few short trials of each, alternated. About 2 ms.
///
/// The CPUID bit says the instruction exists, not that it is fast: on the
/// 2-core Intel Xeon (AVX512-BF16 and AVX512-FP16, no AMX) of 2026-12-07
/// `vdpbf16ps` retired 1.40 G/s against the FMA's 5.59 G/s, 0.50 of its
/// flop rate,
/// where the AMD EPYC of the earlier sessions ran it at twice the FMA's.
///
/// Panics when the CPU lacks the instructions ([`available`]).
pub(super) fn dot_to_fma_rate() -> f64 {
    assert!(available(), "dot_to_fma_rate: CPU lacks AVX512-BF16");
    let time = |f: &dyn Fn() -> f32| {
        let start = std::time::Instant::now();
        std::hint::black_box(f());
        start.elapsed().as_secs_f64()
    };
    let (mut dot, mut fma) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..5 {
        // SAFETY: `available()` was asserted.
        dot = dot.min(time(&|| unsafe { dot_chains(RATE_TRIPS) }));
        // SAFETY: as above.
        fma = fma.min(time(&|| unsafe { fma_chains(RATE_TRIPS) }));
    }
    // Per instruction the dot product is twice the FMA's flops.
    2.0 * fma / dot
}

/// `trips` × 16 of the instruction `$op zmm_i, zmm16, zmm17` on 16 zeroed
/// accumulators zmm0–zmm15, in assembly: left to LLVM, the same loop of
/// intrinsics spilled and rotated its accumulators, and timed the shuffles
/// instead. Evaluates to zmm0.
macro_rules! chains {
    ($op:literal, $trips:expr, $a:expr, $b:expr) => {{
        let out: __m512;
        // SAFETY: registers only; the caller guarantees the instruction.
        unsafe {
            std::arch::asm!(
                "vxorps xmm0, xmm0, xmm0", "vxorps xmm1, xmm1, xmm1", "vxorps xmm2, xmm2, xmm2",
                "vxorps xmm3, xmm3, xmm3", "vxorps xmm4, xmm4, xmm4", "vxorps xmm5, xmm5, xmm5",
                "vxorps xmm6, xmm6, xmm6", "vxorps xmm7, xmm7, xmm7", "vxorps xmm8, xmm8, xmm8",
                "vxorps xmm9, xmm9, xmm9", "vxorps xmm10, xmm10, xmm10",
                "vxorps xmm11, xmm11, xmm11", "vxorps xmm12, xmm12, xmm12",
                "vxorps xmm13, xmm13, xmm13", "vxorps xmm14, xmm14, xmm14",
                "vxorps xmm15, xmm15, xmm15",
                "2:",
                concat!($op, " zmm0, zmm16, zmm17"), concat!($op, " zmm1, zmm16, zmm17"),
                concat!($op, " zmm2, zmm16, zmm17"), concat!($op, " zmm3, zmm16, zmm17"),
                concat!($op, " zmm4, zmm16, zmm17"), concat!($op, " zmm5, zmm16, zmm17"),
                concat!($op, " zmm6, zmm16, zmm17"), concat!($op, " zmm7, zmm16, zmm17"),
                concat!($op, " zmm8, zmm16, zmm17"), concat!($op, " zmm9, zmm16, zmm17"),
                concat!($op, " zmm10, zmm16, zmm17"), concat!($op, " zmm11, zmm16, zmm17"),
                concat!($op, " zmm12, zmm16, zmm17"), concat!($op, " zmm13, zmm16, zmm17"),
                concat!($op, " zmm14, zmm16, zmm17"), concat!($op, " zmm15, zmm16, zmm17"),
                "dec {n}",
                "jnz 2b",
                n = inout(reg) $trips.max(1) => _,
                in("zmm16") $a, in("zmm17") $b,
                out("zmm0") out, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
                options(nostack, nomem),
            );
        }
        out
    }};
}

/// `trips` × 16 `vdpbf16ps` on register operands ([`chains`]).
///
/// # Safety
/// The CPU must have AVX-512F and AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_chains(trips: usize) -> f32 {
    let a = _mm512_set1_epi32(std::hint::black_box(0x3f80_3f80));
    let b = _mm512_set1_epi32(std::hint::black_box(0x2000_2000));
    _mm512_reduce_add_ps(chains!("vdpbf16ps", trips, a, b))
}

/// `trips` × 16 `vfmadd231ps` on register operands ([`chains`]).
///
/// # Safety
/// The CPU must have AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn fma_chains(trips: usize) -> f32 {
    let a = _mm512_set1_ps(std::hint::black_box(1.0));
    let b = _mm512_set1_ps(std::hint::black_box(1e-20));
    _mm512_reduce_add_ps(chains!("vfmadd231ps", trips, a, b))
}

/// f32 to bf16 bits (round to nearest even), widened to a word.
#[inline]
fn bf16_bits(v: f32) -> u32 {
    f32_to_bf16_bits(v) as u32
}

/// Two k-consecutive values as one `vdpbf16ps` operand word: the lower
/// index in the low half.
#[inline]
fn pair(lo: f32, hi: f32) -> u32 {
    bf16_bits(lo) | (bf16_bits(hi) << 16)
}

/// Freed copies of `b` kept for reuse ([`take_words`], [`return_words`]).
static SPARE_WORDS: Mutex<Vec<Vec<u32>>> = Mutex::new(Vec::new());
/// At most this many spare buffers are kept: a convolution backward holds
/// two packed operands at once, and the split pointwise weight gradient two
/// more.
const SPARE_MAX: usize = 4;
/// Spare buffers larger than this (in words, 32 MiB) go back to the system.
const SPARE_MAX_WORDS: usize = 8 << 20;

/// A buffer of `len` words for a packed `b`, reused when one is spare. Its
/// contents are stale: the packer writes every word.
fn take_words(len: usize) -> Vec<u32> {
    let reused = {
        let mut spare = SPARE_WORDS.lock().unwrap_or_else(|e| e.into_inner());
        // The smallest spare that holds `len` words, else the largest.
        let fits = (0..spare.len())
            .filter(|&i| spare[i].capacity() >= len)
            .min_by_key(|&i| spare[i].capacity());
        let pick = fits.or_else(|| (0..spare.len()).max_by_key(|&i| spare[i].capacity()));
        pick.map(|i| spare.swap_remove(i))
    };
    let mut words = reused.unwrap_or_default();
    words.resize(len, 0);
    words
}

/// Keeps a packed `b`'s buffer for a later [`take_words`] (or frees it when
/// enough are kept or it is very large).
pub(super) fn return_words(words: Vec<u32>) {
    if words.capacity() == 0 || words.capacity() > SPARE_MAX_WORDS {
        return;
    }
    let mut spare = SPARE_WORDS.lock().unwrap_or_else(|e| e.into_inner());
    if spare.len() < SPARE_MAX {
        spare.push(words);
    } else if let Some(i) = (0..spare.len()).min_by_key(|&i| spare[i].capacity()) {
        // Keep the larger buffers: they serve every smaller request.
        if spare[i].capacity() < words.capacity() {
            spare[i] = words;
        }
    }
}

/// `b` (k, n) packed once for any number of products with it
/// ([`Rhs::Packed`]): a convolution's weight is the right operand of every
/// im2col tile's GEMM, and packing it per tile cost more than the tiles'
/// own packing.
///
/// Panics when the CPU lacks the instructions ([`available`]).
pub fn pack_rhs(b: MatRef<'_>) -> PackedRhs {
    assert!(available(), "gemm_bf16: CPU lacks AVX512-BF16");
    PackedRhs {
        // SAFETY: `available()` was asserted.
        words: unsafe { pack_b(b) },
        k: b.rows,
        n: b.cols,
    }
}

/// Packs all of `b` (k, n) into a (reused) buffer ([`pack_b_into`]).
///
/// # Safety
/// The CPU must have AVX-512F ([`available`]).
#[target_feature(enable = "avx512f")]
unsafe fn pack_b(b: MatRef<'_>) -> Vec<u32> {
    let mut out = take_words(panel_pairs(b.rows) * b.cols.div_ceil(NR) * NR);
    // SAFETY: as this function's.
    unsafe { pack_b_into(&mut out, b) };
    out
}

/// Packs all of `b` (k, n) into `out` ([`panel_pairs`]·⌈n/NR⌉·NR words):
/// for each NR-column panel, for each k-pair, NR words. Columns past `n`,
/// the odd k tail and the padding pairs past ⌈k/2⌉ are zero. Every word is written, so `out`'s previous contents do
/// not matter. The inner loops run along whichever direction of `b` is
/// contiguous, so they vectorise.
///
/// # Safety
/// The CPU must have AVX-512F ([`available`]).
#[target_feature(enable = "avx512f")]
unsafe fn pack_b_into(out: &mut [u32], b: MatRef<'_>) {
    let (k, n) = (b.rows, b.cols);
    let (pairs, panels) = (k.div_ceil(2), n.div_ceil(NR));
    let pitch = panel_pairs(k) * NR;
    assert_eq!(out.len(), panels * pitch, "pack_b: buffer length");
    let d = b.data;
    out.par_chunks_mut(pitch)
        .enumerate()
        .for_each(|(panel, words)| {
            let (words, padding) = words.split_at_mut(pairs * NR);
            padding.fill(0);
            let j0 = panel * NR;
            let nw = NR.min(n - j0);
            if nw < NR {
                // The ragged last panel: its columns past `n` stay zero.
                words.fill(0);
            }
            if b.cs == 1 {
                // Row-major: pair two rows, column by column.
                for (kp, row) in words.chunks_exact_mut(NR).enumerate() {
                    let lo = &d[2 * kp * b.rs + j0..][..nw];
                    let hi = (2 * kp + 1 < k).then(|| &d[(2 * kp + 1) * b.rs + j0..][..nw]);
                    pair_to_bf16(&mut row[..nw], lo, hi);
                }
            } else if b.rs == 1 {
                // Column-contiguous (a transposed weight): a column's k
                // values converted in order are its k-pair words already,
                // so convert each column as a slice and scatter its words.
                let mut column = vec![0u32; pairs];
                for jj in 0..nw {
                    let halves: &mut [u16] = bytemuck::cast_slice_mut(&mut column);
                    f32_to_bf16(&mut halves[..k], &d[(j0 + jj) * b.cs..][..k]);
                    if k % 2 == 1 {
                        halves[k] = 0;
                    }
                    for (kp, &w) in column.iter().enumerate() {
                        words[kp * NR + jj] = w;
                    }
                }
            } else {
                // General strides: walk each column down k.
                for jj in 0..nw {
                    let col = |p: usize| d[p * b.rs + (j0 + jj) * b.cs];
                    for kp in 0..pairs {
                        let hi = if 2 * kp + 1 < k { col(2 * kp + 1) } else { 0.0 };
                        words[kp * NR + jj] = pair(col(2 * kp), hi);
                    }
                }
            }
        });
}

/// How a packed block of `a` is laid out: word (row ii, k-pair kp) of a
/// micro-panel sits at `ii·row + kp·pair`, micro-panels `panel` words apart.
#[derive(Clone, Copy)]
struct ALayout {
    row: usize,
    pair: usize,
    panel: usize,
}

/// Packs rows `i0..i0+mc` and k-block `p0..p0+kc` of `a` (rows past `m`
/// and k past the block are zero) and says how it is laid out.
/// * Rows contiguous along k (row-major `a`, the forward and input-gradient
///   case): each row is rounded to bf16 in place order, which is already
///   the k-pair word order, so packing is a streaming conversion and the
///   micro-kernel reads MR row streams.
/// * Otherwise (the transposed patches of a weight gradient): MR-row
///   micro-panels, one word per row for each k-pair, read along the
///   contiguous row direction.
///
/// # Safety
/// The CPU must have AVX-512F ([`available`]).
#[target_feature(enable = "avx512f")]
unsafe fn pack_a(
    out: &mut [u32],
    a: MatRef<'_>,
    i0: usize,
    mc: usize,
    p0: usize,
    kc: usize,
) -> ALayout {
    let kc2 = kc.div_ceil(2);
    let d = a.data;
    let valid = mc.min(a.rows - i0);
    if a.cs == 1 {
        let rows_padded = mc.div_ceil(MR) * MR;
        let words = &mut out[..rows_padded * kc2];
        for (ii, w) in words.chunks_exact_mut(kc2).enumerate() {
            if ii >= valid {
                w.fill(0);
                continue;
            }
            let src = &d[(i0 + ii) * a.rs + p0..][..kc];
            let halves: &mut [u16] = bytemuck::cast_slice_mut(w);
            f32_to_bf16(&mut halves[..kc], src);
            if kc % 2 == 1 {
                halves[kc] = 0;
            }
        }
        return ALayout {
            row: kc2,
            pair: 1,
            panel: MR * kc2,
        };
    }
    pack_panels(out, a.rows, i0, mc, kc, |r0, kp, hi_in, col| {
        let p = p0 + 2 * kp;
        let rows = col.len();
        if a.rs == 1 {
            // Contiguous along the rows: pair two columns. MR values per
            // call: too few for the slice converter, so inline (this
            // function's AVX-512 lets it vectorise).
            let lo = &d[p * a.cs + r0..][..rows];
            if hi_in {
                let hi = &d[(p + 1) * a.cs + r0..][..rows];
                for (w, (&l, &h)) in col.iter_mut().zip(lo.iter().zip(hi)) {
                    *w = pair(l, h);
                }
            } else {
                for (w, &l) in col.iter_mut().zip(lo) {
                    *w = pair(l, 0.0);
                }
            }
        } else {
            for (ii, w) in col.iter_mut().enumerate() {
                let lo = d[(r0 + ii) * a.rs + p * a.cs];
                let hi = if hi_in {
                    d[(r0 + ii) * a.rs + (p + 1) * a.cs]
                } else {
                    0.0
                };
                *w = pair(lo, hi);
            }
        }
    })
}

/// The micro-panel walk of the panel packers: for each MR-row panel of rows
/// `i0..i0+mc` (zero-filled where it runs past `m`) and each k-pair `kp` of
/// a `kc`-long block, `fill(r0, kp, hi_in_block, words)` writes the words of
/// the panel's valid rows (`words.len()` of them, from row `r0`).
#[inline(always)]
fn pack_panels(
    out: &mut [u32],
    m: usize,
    i0: usize,
    mc: usize,
    kc: usize,
    mut fill: impl FnMut(usize, usize, bool, &mut [u32]),
) -> ALayout {
    let kc2 = kc.div_ceil(2);
    for (panel, words) in out
        .chunks_exact_mut(kc2 * MR)
        .take(mc.div_ceil(MR))
        .enumerate()
    {
        let r0 = i0 + panel * MR;
        let rows = MR.min(m - r0.min(m));
        if rows < MR {
            words.fill(0);
        }
        for (kp, col) in words.chunks_exact_mut(MR).enumerate() {
            fill(r0, kp, 2 * kp + 1 < kc, &mut col[..rows]);
        }
    }
    ALayout {
        row: 1,
        pair: MR,
        panel: MR * kc2,
    }
}

/// Reinterprets 32 bf16 lanes held as integers.
#[inline(always)]
fn as_bh(v: __m512i) -> __m512bh {
    // SAFETY: same size, and every bit pattern is a valid vector of either.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// Packs rows `i0..i0+mc`, k-block `p0..p0+kc` of the transpose of a bf16
/// row matrix (`halves`: `k` rows of `m` values, row stride `stride`
/// halves): a = halvesᵀ, so a k-pair is two consecutive rows and a
/// micro-panel's MR values are contiguous within each. No rounding: the
/// values are bf16 already. Rows past `m` and k past the block are zero.
///
/// # Safety
/// The CPU must have AVX-512F ([`available`]).
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_a_bf16_transposed(
    out: &mut [u32],
    halves: &[u16],
    stride: usize,
    m: usize,
    i0: usize,
    mc: usize,
    p0: usize,
    kc: usize,
) -> ALayout {
    pack_panels(out, m, i0, mc, kc, |r0, kp, hi_in, col| {
        let p = p0 + 2 * kp;
        let lo = &halves[p * stride + r0..][..col.len()];
        if hi_in {
            let hi = &halves[(p + 1) * stride + r0..][..col.len()];
            for (w, (&l, &h)) in col.iter_mut().zip(lo.iter().zip(hi)) {
                *w = l as u32 | ((h as u32) << 16);
            }
        } else {
            for (w, &l) in col.iter_mut().zip(lo) {
                *w = l as u32;
            }
        }
    })
}

/// `c (MR×NR, row stride ldc) += Σ_kp a[·, kp] ⊗ bp[kp]` over `kc2`
/// k-pairs, with row ii's word for k-pair kp at `ap[ii·l.row + kp·l.pair]`.
/// The tile of `c` is loaded into the accumulators (when `load`; else they
/// start at zero, as from a zeroed `c`, which then need not be zeroed) and
/// stored back once, rounded to bf16 when `round` (the last k-block of an
/// output the caller wants in bf16).
///
/// # Safety
/// The CPU must have AVX-512F and AVX512-BF16; `ap` must hold every word
/// the layout addresses for MR rows and `kc2` pairs, `bp` `kc2·NR` words,
/// and `c` MR rows of NR floats `ldc` apart.
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_kernel(
    kc2: usize,
    ap: &[u32],
    l: ALayout,
    bp: &[u32],
    c: *mut f32,
    ldc: usize,
    load: bool,
    round: bool,
) {
    debug_assert!(ap.len() > (MR - 1) * l.row + (kc2 - 1) * l.pair && bp.len() >= kc2 * NR);
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    if load {
        for (ii, ci) in acc.iter_mut().enumerate() {
            // SAFETY: the tile lies inside `c` by the contract above.
            unsafe {
                ci[0] = _mm512_loadu_ps(c.add(ii * ldc));
                ci[1] = _mm512_loadu_ps(c.add(ii * ldc + 16));
            }
        }
    }
    let a = ap.as_ptr();
    for kp in 0..kc2 {
        // SAFETY: in bounds by the contract above; unaligned loads.
        let (b0, b1) = unsafe {
            let p = bp.as_ptr().add(kp * NR) as *const __m512i;
            (_mm512_loadu_si512(p), _mm512_loadu_si512(p.add(1)))
        };
        let (b0, b1) = (as_bh(b0), as_bh(b1));
        for (ii, ci) in acc.iter_mut().enumerate() {
            // SAFETY: as above.
            let av = as_bh(_mm512_set1_epi32(
                unsafe { *a.add(ii * l.row + kp * l.pair) } as i32,
            ));
            ci[0] = _mm512_dpbf16_ps(ci[0], av, b0);
            ci[1] = _mm512_dpbf16_ps(ci[1], av, b1);
        }
    }
    let finish = |v: __m512| {
        if round {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(round16(v)))
        } else {
            v
        }
    };
    for (ii, ci) in acc.iter().enumerate() {
        // SAFETY: as for the loads.
        unsafe {
            _mm512_storeu_ps(c.add(ii * ldc), finish(ci[0]));
            _mm512_storeu_ps(c.add(ii * ldc + 16), finish(ci[1]));
        }
    }
}

/// `dst (m, n) row-major [+]= a · b` in bf16 with f32 accumulation; with
/// `round_output` the result is rounded to bf16 as it is stored (the whole
/// sum, `dst`'s previous value included when accumulating).
///
/// The kernel is the one [`super::bf16_path`] names (AMX where the CPU has
/// it, unless `MEMFIT_CPU_BF16` says otherwise).
///
/// Panics when the CPU lacks the instructions ([`available`]) or the
/// operands do not fit their slices; callers check both, so neither is user
/// input.
pub fn gemm_bf16_lhs(dst: &mut [f32], a: Lhs<'_>, b: Rhs<'_>, acc: Accumulate, round_output: bool) {
    gemm_bf16_kernel(super::bf16_kernel(), dst, a, b, acc, round_output)
}

/// [`gemm_bf16_lhs`] on the given micro-kernel (the tests compare them).
///
/// Panics when the CPU lacks the kernel's instructions.
pub(super) fn gemm_bf16_kernel(
    kernel: Kernel,
    dst: &mut [f32],
    a: Lhs<'_>,
    b: Rhs<'_>,
    acc: Accumulate,
    round_output: bool,
) {
    assert!(available(), "gemm_bf16: CPU lacks AVX512-BF16");
    if kernel == Kernel::Amx {
        assert!(super::amx::available(), "gemm_bf16: CPU lacks AMX-BF16");
    }
    let ((m, k), (kb, n)) = (a.dims(), b.dims());
    assert_eq!(kb, k, "gemm_bf16: inner dimensions");
    assert!(dst.len() >= m * n, "gemm_bf16: dst too small");
    let words_needed = match a {
        Lhs::F32(_) => 0,
        Lhs::Bf16Rows { .. } => m * k.div_ceil(2),
        Lhs::Bf16RowsTransposed { .. } => k * m.div_ceil(2),
    };
    if let Lhs::Bf16Rows { words, .. } | Lhs::Bf16RowsTransposed { words, .. } = a {
        assert!(words.len() >= words_needed, "gemm_bf16: lhs rows too short");
    }
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if acc == Accumulate::No {
            dst[..m * n].fill(0.0);
        }
        return;
    }
    // Without accumulation the first k-block stores instead of adding, so
    // `dst` is never zeroed first (a serial pass over the whole output).
    // The same bits: a sum never comes out as -0 from +0 accumulators, and
    // +0 + t = t for every other t.
    let overwrite = acc == Accumulate::No;
    if kernel == Kernel::Amx {
        let packed_here: PackedRhs;
        let bp: &[u32] = match b {
            Rhs::F32(b) => {
                packed_here = pack_rhs(b);
                &packed_here.words
            }
            Rhs::Packed(p) => &p.words,
        };
        super::amx::gemm(dst, a, bp, k, n, overwrite, round_output);
        return;
    }
    let panels = n.div_ceil(NR);
    // A `b` this call packs is packed one chunk of k at a time, into a
    // buffer that stays in cache while every task reads it. Packed whole,
    // a weight gradient's `dy` (k = every pixel of the batch) is megabytes,
    // written out once and read back from memory by each task. Chunks are
    // whole k-blocks, so every output sums the same blocks in the same
    // order either way: the bits do not change.
    let (chunk, mut chunk_words) = match b {
        Rhs::F32(_) => {
            let chunk = rhs_chunk(n).min(k.next_multiple_of(KC));
            (chunk, take_words(panel_pairs(chunk) * panels * NR))
        }
        Rhs::Packed(_) => (k, Vec::new()),
    };
    for c0 in (0..k).step_by(chunk) {
        let c1 = (c0 + chunk).min(k);
        let (bp, pitch): (&[u32], usize) = match b {
            Rhs::F32(b) => {
                let pitch = panel_pairs(c1 - c0) * NR;
                let words = &mut chunk_words[..panels * pitch];
                // SAFETY: `available()` was asserted.
                unsafe { pack_b_into(words, b.row_range(c0, c1)) };
                (words, pitch)
            }
            Rhs::Packed(p) => (&p.words, panel_pairs(k) * NR),
        };
        // SAFETY: `available()` was asserted.
        unsafe {
            run_chunk(
                dst,
                a,
                bp,
                pitch,
                (m, k, n),
                (c0, c1),
                overwrite,
                round_output,
            )
        };
    }
    return_words(chunk_words);
}

/// Words of a per-call packed `b` chunk: 256 Ki words (1 MiB) stay in the
/// cores' shared cache while their tasks read it. On a 2-core Zen 5 EPYC
/// this took ResNet-50 bf16 224²/b16's weight gradients from 0.33–0.35 to
/// 0.28–0.30 s/step (a chunk of 64 Ki words was no better than none: too
/// many small parallel passes for the widest `dy`).
const CHUNK_WORDS: usize = 1 << 18;

/// k rows of a per-call packed `b` (n columns) per chunk: whole k-blocks,
/// at least one.
fn rhs_chunk(n: usize) -> usize {
    let per_pair = n.div_ceil(NR) * NR;
    ((2 * CHUNK_WORDS / per_pair) / KC).max(1) * KC
}

/// The AVX512-BF16 kernel over k rows `c0..c1` of the product, with `bp`
/// those rows of `b` packed (panels `pitch` words apart): `overwrite` and
/// `round_output` are the whole call's (they apply at k = 0 and at the last
/// k-block).
///
/// # Safety
/// The CPU must have AVX-512F and AVX512-BF16 ([`available`]).
#[allow(clippy::too_many_arguments)]
unsafe fn run_chunk(
    dst: &mut [f32],
    a: Lhs<'_>,
    bp: &[u32],
    pitch: usize,
    (m, k, n): (usize, usize, usize),
    (c0, c1): (usize, usize),
    overwrite: bool,
    round_output: bool,
) {
    let (pairs, panels) = (k.div_ceil(2), n.div_ceil(NR));
    let mc_task = rows_per_task(m);
    dst[..m * n]
        .par_chunks_mut(mc_task * n)
        .enumerate()
        .for_each(|(blk, drows)| {
            let i0 = blk * mc_task;
            let mc = drows.len() / n;
            let mut ap = vec![0u32; mc.div_ceil(MR) * KC.div_ceil(2) * MR];
            let mut tile = [0.0f32; MR * NR];
            for p0 in (c0..c1).step_by(KC) {
                let kc = KC.min(c1 - p0);
                let kc2 = kc.div_ceil(2);
                let round = round_output && p0 + kc == k;
                let load = !(overwrite && p0 == 0);
                let packed = match a {
                    // SAFETY: `available()` was asserted.
                    Lhs::F32(a) => Some(unsafe { pack_a(&mut ap, a, i0, mc, p0, kc) }),
                    // SAFETY: as above.
                    Lhs::Bf16RowsTransposed { words, m, .. } => Some(unsafe {
                        let halves: &[u16] = bytemuck::cast_slice(words);
                        pack_a_bf16_transposed(
                            &mut ap,
                            halves,
                            2 * m.div_ceil(2),
                            m,
                            i0,
                            mc,
                            p0,
                            kc,
                        )
                    }),
                    Lhs::Bf16Rows { .. } => None,
                };
                for mp in 0..mc.div_ceil(MR) {
                    let r0 = mp * MR;
                    let rows = MR.min(mc - r0);
                    // This micro-panel of A and how it is laid out.
                    let (apanel, layout): (&[u32], ALayout) = match (a, packed) {
                        (_, Some(l)) => (&ap[mp * l.panel..][..l.panel], l),
                        (Lhs::Bf16Rows { words, .. }, None) if rows == MR => {
                            let l = ALayout {
                                row: pairs,
                                pair: 1,
                                panel: 0,
                            };
                            (&words[(i0 + r0) * pairs + p0 / 2..], l)
                        }
                        (Lhs::Bf16Rows { words, .. }, None) => {
                            // The ragged last rows: copy them zero-padded.
                            let pad = &mut ap[..MR * kc2];
                            pad.fill(0);
                            for ii in 0..rows {
                                let src = &words[(i0 + r0 + ii) * pairs + p0 / 2..][..kc2];
                                pad[ii * kc2..(ii + 1) * kc2].copy_from_slice(src);
                            }
                            let l = ALayout {
                                row: kc2,
                                pair: 1,
                                panel: 0,
                            };
                            (&ap[..MR * kc2], l)
                        }
                        (Lhs::F32(_) | Lhs::Bf16RowsTransposed { .. }, None) => {
                            unreachable!("these operands are always packed")
                        }
                    };
                    for panel in 0..panels {
                        let j0 = panel * NR;
                        let nw = NR.min(n - j0);
                        let bpanel = &bp[panel * pitch + ((p0 - c0) / 2) * NR..][..kc2 * NR];
                        if rows == MR && nw == NR {
                            let c = drows[r0 * n + j0..].as_mut_ptr();
                            // SAFETY: `available()` was asserted; the A
                            // micro-panel holds MR rows of kc2 words at its
                            // layout, a B panel kc2·NR words, and the full
                            // MR×NR tile lies inside `drows`.
                            unsafe { micro_kernel(kc2, apanel, layout, bpanel, c, n, load, round) };
                        } else {
                            // A ragged edge: run on a full tile from zero,
                            // then add (or store) its valid part.
                            // SAFETY: as above; `tile` is MR×NR.
                            unsafe {
                                micro_kernel(
                                    kc2,
                                    apanel,
                                    layout,
                                    bpanel,
                                    tile.as_mut_ptr(),
                                    NR,
                                    false,
                                    false,
                                )
                            };
                            for (ii, trow) in tile.chunks_exact(NR).take(rows).enumerate() {
                                let drow = &mut drows[(r0 + ii) * n + j0..][..nw];
                                for (d, t) in drow.iter_mut().zip(trow) {
                                    *d = if load { *d + t } else { *t };
                                    if round {
                                        *d = bf16_bits_to_f32(f32_to_bf16_bits(*d));
                                    }
                                }
                            }
                        }
                    }
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This file's kernel (AMX has its own tests, in `amx.rs`).
    fn gemm_bf16(dst: &mut [f32], a: MatRef<'_>, b: MatRef<'_>, acc: Accumulate) {
        gemm_bf16_kernel(
            Kernel::Avx512Bf16,
            dst,
            Lhs::F32(a),
            Rhs::F32(b),
            acc,
            false,
        )
    }

    /// The kernels this CPU runs: the bit-equality tests run on each.
    fn kernels() -> Vec<Kernel> {
        let mut all = vec![Kernel::Avx512Bf16];
        if super::super::amx::available() {
            all.push(Kernel::Amx);
        }
        all
    }

    fn round_bf16(v: f32) -> f32 {
        f32::from_bits(bf16_bits(v) << 16)
    }

    #[test]
    fn rounding_is_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
        assert_eq!(bf16_bits(1.0 + 2f32.powi(-8)), 0x3f80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even.
        assert_eq!(bf16_bits(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert_eq!(bf16_bits(-2.0), 0xc000);
        assert!(f32::from_bits(bf16_bits(f32::NAN) << 16).is_nan());
        assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
    }

    /// Products of bf16 values summed in f64: what the kernel computes up
    /// to f32 accumulation error.
    fn reference(a: MatRef<'_>, b: MatRef<'_>) -> Vec<f64> {
        let mut out = vec![0.0; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                for p in 0..a.cols {
                    out[i * b.cols + j] += round_bf16(a.data[i * a.rs + p * a.cs]) as f64
                        * round_bf16(b.data[p * b.rs + j * b.cs]) as f64;
                }
            }
        }
        out
    }

    #[test]
    fn matches_reference_on_ragged_shapes_and_transposes() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        // Ragged against MR, NR, KC and MC, odd k, and a k spanning blocks.
        for &(m, k, n) in &[(1, 1, 1), (9, 3, 33), (37, 257, 23), (130, 515, 70)] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 97.0)
                .collect();
            let b: Vec<f32> = (0..k * n)
                .map(|i| ((i * 104729 % 811) as f32 - 405.0) / 53.0)
                .collect();
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let av = MatRef::test_view(&a, m, k, ta);
                let bv = MatRef::test_view(&b, k, n, tb);
                let want = reference(av, bv);
                let scale = want.iter().fold(1.0f64, |s, w| s.max(w.abs()));
                let mut dst = vec![1.0f32; m * n];
                gemm_bf16(&mut dst, av, bv, Accumulate::Yes);
                for (d, w) in dst.iter().zip(&want) {
                    let err = (*d as f64 - (w + 1.0)).abs();
                    assert!(
                        err <= 1e-5 * scale * (k as f64).sqrt(),
                        "{m}x{k}x{n}: {d} vs {}",
                        w + 1.0
                    );
                }
                let mut dst2 = vec![f32::NAN; m * n];
                gemm_bf16(&mut dst2, av, bv, Accumulate::No);
                for (d, w) in dst2.iter().zip(&want) {
                    assert!((*d as f64 - w).abs() <= 1e-5 * scale * (k as f64).sqrt());
                }
            }
        }
    }

    #[test]
    fn a_packed_rhs_gives_the_same_bits_as_packing_per_call() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        // Odd k (the zero tail of a column-contiguous pack), ragged n, and
        // a k that a per-call pack walks in three chunks ([`rhs_chunk`]),
        // the last one ragged.
        assert_eq!(rhs_chunk(4096), KC);
        for kernel in kernels() {
            for &(m, k, n) in &[(19, 37, 45), (64, 300, 32), (9, 601, 4096)] {
                let a: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 31 % 101) as f32 - 50.0) / 9.0)
                    .collect();
                let b: Vec<f32> = (0..k * n)
                    .map(|i| ((i * 17 % 89) as f32 - 44.0) / 7.0)
                    .collect();
                for (tb, acc) in [false, true]
                    .into_iter()
                    .flat_map(|tb| [(tb, Accumulate::Yes), (tb, Accumulate::No)])
                {
                    // Without accumulation `dst`'s contents must not matter.
                    let start = if acc == Accumulate::Yes {
                        0.5
                    } else {
                        f32::NAN
                    };
                    let bv = MatRef::test_view(&b, k, n, tb);
                    let av = MatRef::row_major(&a, m, k);
                    let mut want = vec![start; m * n];
                    gemm_bf16_kernel(kernel, &mut want, Lhs::F32(av), Rhs::F32(bv), acc, true);
                    let packed = pack_rhs(bv);
                    let mut got = vec![start; m * n];
                    gemm_bf16_kernel(
                        kernel,
                        &mut got,
                        Lhs::F32(av),
                        Rhs::Packed(&packed),
                        acc,
                        true,
                    );
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{kernel:?} {m}x{k}x{n} transposed {tb} {acc:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn packing_writes_every_word_of_a_reused_buffer() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        // Ragged n (a part-filled last panel) and odd k (a zero tail), in
        // each of the packer's three stride cases.
        let (k, n) = (37, 45);
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 13 % 71) as f32 - 35.0) / 3.0)
            .collect();
        let rowm = MatRef::row_major(&b, k, n);
        let colm = MatRef::row_major(&b, n, k).t();
        let strided = MatRef {
            data: &b,
            rows: k,
            cols: n / 2,
            rs: n,
            cs: 2,
        };
        for bv in [rowm, colm, strided] {
            let len = panel_pairs(bv.rows) * bv.cols.div_ceil(NR) * NR;
            let mut fresh = vec![0u32; len];
            let mut stale = vec![u32::MAX; len];
            // SAFETY: `available()` was checked.
            unsafe {
                pack_b_into(&mut fresh, bv);
                pack_b_into(&mut stale, bv);
            }
            assert_eq!(
                fresh, stale,
                "{}x{} rs {} cs {}",
                bv.rows, bv.cols, bv.rs, bv.cs
            );
        }
        // Through the spare buffers: a dirty one returned, then reused.
        return_words(vec![u32::MAX; 4 * k * n]);
        let got = pack_rhs(rowm);
        let mut want = vec![0u32; got.words.len()];
        // SAFETY: as above.
        unsafe { pack_b_into(&mut want, rowm) };
        assert_eq!(got.words, want);
    }

    #[test]
    fn overwriting_gives_the_bits_of_accumulating_into_zeros() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        // Ragged edges and k over several blocks; sums that cancel to zero
        // (the -0 question) from the repeating values.
        for kernel in kernels() {
            for &(m, k, n) in &[(9, 3, 33), (37, 515, 23), (64, 256, 64)] {
                let a: Vec<f32> = (0..m * k).map(|i| ((i % 5) as f32 - 2.0) / 4.0).collect();
                let b: Vec<f32> = (0..k * n)
                    .map(|i| ((i * 7 % 9) as f32 - 4.0) / 8.0)
                    .collect();
                let (av, bv) = (MatRef::row_major(&a, m, k), MatRef::row_major(&b, k, n));
                for round in [false, true] {
                    let mut want = vec![0.0f32; m * n];
                    gemm_bf16_kernel(
                        kernel,
                        &mut want,
                        Lhs::F32(av),
                        Rhs::F32(bv),
                        Accumulate::Yes,
                        round,
                    );
                    let mut got = vec![f32::NAN; m * n];
                    gemm_bf16_kernel(
                        kernel,
                        &mut got,
                        Lhs::F32(av),
                        Rhs::F32(bv),
                        Accumulate::No,
                        round,
                    );
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{kernel:?} {m}x{k}x{n} round {round}"
                    );
                }
            }
        }
    }

    #[test]
    fn result_does_not_depend_on_thread_count() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        let (m, k, n) = (300, 600, 40);
        let a: Vec<f32> = (0..m * k).map(|i| ((i % 97) as f32 - 48.0) / 7.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i % 89) as f32 - 44.0) / 5.0).collect();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut dst = vec![0.0f32; m * n];
            pool.install(|| {
                gemm_bf16(
                    &mut dst,
                    MatRef::row_major(&a, m, k),
                    MatRef::row_major(&b, k, n),
                    Accumulate::No,
                )
            });
            dst
        };
        assert_eq!(run(1), run(3));
    }
}
