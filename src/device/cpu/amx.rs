//! The AMX (`tdpbf16ps`) micro-kernel of the bf16 GEMM, and what AMX needs
//! from the CPU and the OS: `dst (m, n) [+]= a (m, k) · b (k, n)` with bf16
//! products and f32 accumulation, as [`super::bf16_gemm`] computes it with
//! `vdpbf16ps`. This file owns the tiles; it does not know who calls the
//! GEMM.
//!
//! * Detection: CPUID leaf 7 (EDX bit 22 AMX-BF16, bit 24 AMX-TILE; Rust's
//!   `is_x86_feature_detected!` names for them are unstable), and on Linux
//!   the permission to use tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//!   XFEATURE_XTILEDATA)`), asked once per process. Refused: no AMX.
//! * Tiles: one configuration (palette 1, all eight tiles 16 rows of 64
//!   bytes), loaded at the start of each parallel task that uses tiles and
//!   released at its end ([`Tiles`]); tile state is per thread.
//! * A 32×32 block of C is four f32 tiles (tmm4..tmm7), fed per 16 k-pairs
//!   by two A tiles (tmm0, tmm1: 16 rows × 16 k-pair words) and two B tiles
//!   (tmm2, tmm3: 16 k-pairs × 16 columns), 4 `tdpbf16ps`.
//! * B tiles are read straight from the packed panels of
//!   [`super::bf16_gemm`] (k-pair rows of NR = 32 words, which is AMX's
//!   VNNI layout; panels are padded to whole 16-pair tiles): the left 16
//!   columns at offset 0, the right at 64 bytes, row stride 128 bytes.
//! * A is packed here per [`KC`] block: rows of whole 16-pair tiles (zero
//!   past k and past m), from each [`Lhs`] form.
//!
//! Rust's AMX intrinsics are unstable, so the instructions are inline
//! assembly. The compiler never allocates tile registers itself (it knows
//! none), so they keep their contents between the `asm!` blocks of one
//! block computation.

use std::arch::asm;
use std::marker::PhantomData;
use std::sync::OnceLock;

use rayon::prelude::*;

use super::bf16_gemm::{NR, panel_pairs};
use super::gemm::MatRef;
use super::{Lhs, bf16_bits_to_f32, f32_to_bf16, f32_to_bf16_bits, round_to_bf16};

/// Rows of C per block (two A tiles of 16).
const MR: usize = 32;
/// k elements per block: a multiple of 32 (whole tiles of 16 k-pairs), so
/// only the last block is ragged. One block's B panel (KC/2 pairs of 128
/// bytes, 32 KiB) stays in L1 across the row blocks of a task.
const KC: usize = 512;
/// Most rows of `dst` per parallel task (a multiple of [`MR`]).
const MC_MAX: usize = 128;
/// k-pairs per A or B tile.
const TILE_PAIRS: usize = 16;

/// Whether this CPU and OS run the AMX kernel: AMX-TILE and AMX-BF16,
/// permission to use tile data, and AVX512-BF16 (for the packing and
/// rounding helpers the kernel shares with [`super::bf16_gemm`]).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| super::bf16_gemm::available() && cpu_has_amx() && request_tile_data())
}

/// CPUID leaf 7, subleaf 0: EDX bit 22 (AMX-BF16) and bit 24 (AMX-TILE).
fn cpu_has_amx() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    if __cpuid(0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    edx & (1 << 22) != 0 && edx & (1 << 24) != 0
}

/// Asks Linux for this process's permission to use AMX tile data (off by
/// default: the state is 8 KiB per thread). Other systems: not attempted,
/// so no AMX.
#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: this request only widens the set of xsave features the
    // process may use; it touches no memory of ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    rc == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// The `ldtilecfg` operand: palette 1, tiles 0..8 at 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

static CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// The tiles configured on this thread while it lives (released on drop,
/// a panic included). Not `Send`: tile state belongs to the thread.
struct Tiles(PhantomData<*const ()>);

impl Tiles {
    /// Loads [`CONFIG`] on this thread.
    ///
    /// # Safety
    /// [`available`] must be true. No other tile user may run on this
    /// thread while the guard lives (the kernel runs no nested rayon work
    /// inside a task).
    unsafe fn load() -> Tiles {
        // SAFETY: AMX and tile-data permission are there (the contract);
        // CONFIG is a valid 64-byte, 64-aligned palette-1 configuration.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly, preserves_flags))
        };
        Tiles(PhantomData)
    }

    /// `c (MR×NR f32, row stride ldc floats) = [c +] a · b` over `kt` tiles
    /// of 16 k-pairs: `a` MR rows of `lda` words (row ii's k-pair t·16+q at
    /// `a[ii·lda + t·16 + q]`), `b` k-pair rows of NR words. With `load`
    /// the sums start from `c`, else from zero.
    ///
    /// # Safety
    /// `a` must hold MR rows of `kt·16` words `lda` apart, `b` `kt·16·NR`
    /// words, and `c` MR rows of NR floats `ldc` apart.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block(
        &self,
        kt: usize,
        a: *const u32,
        lda: usize,
        b: *const u32,
        c: *mut f32,
        ldc: usize,
        load: bool,
    ) {
        let (sa, sb, sc) = (lda * 4, NR * 4, ldc * 4);
        // SAFETY (every block below): the tiles are configured (`self`);
        // each tile load or store touches 16 rows of 64 bytes at the given
        // stride, inside the buffers by the contract above.
        unsafe {
            let c_lo = c.add(16 * ldc);
            if load {
                asm!(
                    "tileloadd tmm4, [{c} + {s}*1]",
                    "tileloadd tmm5, [{c} + {s}*1 + 64]",
                    "tileloadd tmm6, [{d} + {s}*1]",
                    "tileloadd tmm7, [{d} + {s}*1 + 64]",
                    c = in(reg) c, d = in(reg) c_lo, s = in(reg) sc,
                    options(nostack, readonly, preserves_flags),
                );
            } else {
                asm!(
                    "tilezero tmm4",
                    "tilezero tmm5",
                    "tilezero tmm6",
                    "tilezero tmm7",
                    options(nostack, nomem, preserves_flags),
                );
            }
            for t in 0..kt {
                let at = a.add(TILE_PAIRS * t);
                let bt = b.add(TILE_PAIRS * NR * t);
                asm!(
                    "tileloadd tmm0, [{a} + {sa}*1]",
                    "tileloadd tmm1, [{a2} + {sa}*1]",
                    "tileloadd tmm2, [{b} + {sb}*1]",
                    "tileloadd tmm3, [{b} + {sb}*1 + 64]",
                    "tdpbf16ps tmm4, tmm0, tmm2",
                    "tdpbf16ps tmm5, tmm0, tmm3",
                    "tdpbf16ps tmm6, tmm1, tmm2",
                    "tdpbf16ps tmm7, tmm1, tmm3",
                    a = in(reg) at, a2 = in(reg) at.add(16 * lda), sa = in(reg) sa,
                    b = in(reg) bt, sb = in(reg) sb,
                    options(nostack, readonly, preserves_flags),
                );
            }
            asm!(
                "tilestored [{c} + {s}*1], tmm4",
                "tilestored [{c} + {s}*1 + 64], tmm5",
                "tilestored [{d} + {s}*1], tmm6",
                "tilestored [{d} + {s}*1 + 64], tmm7",
                c = in(reg) c, d = in(reg) c_lo, s = in(reg) sc,
                options(nostack, preserves_flags),
            );
        }
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: the configuration was loaded by `load` on this thread.
        unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    }
}

fn rows_per_task(m: usize) -> usize {
    let per = m.div_ceil(4 * rayon::current_num_threads().max(1));
    per.next_multiple_of(MR).clamp(MR, MC_MAX)
}

/// One C block staged for a ragged edge, in tile rows.
#[repr(align(64))]
struct Stage([f32; MR * NR]);

/// `dst (m, n) [+]= a · b` on AMX, `b` packed by [`super::bf16_gemm`]
/// (`bp`: ⌈n/NR⌉ panels of [`panel_pairs`]`(k)` k-pair rows). The first
/// k-block stores instead of adding when `overwrite`; with `round_output`
/// the last one rounds to bf16 as it stores. Called by
/// [`super::bf16_gemm::gemm_bf16_kernel`], which checked the shapes, `k >
/// 0` and [`available`].
pub(super) fn gemm(
    dst: &mut [f32],
    a: Lhs<'_>,
    bp: &[u32],
    k: usize,
    n: usize,
    overwrite: bool,
    round_output: bool,
) {
    assert!(available(), "gemm_bf16: CPU lacks AMX-BF16");
    let m = a.dims().0;
    let pitch = panel_pairs(k) * NR;
    let panels = n.div_ceil(NR);
    assert!(
        bp.len() >= panels * pitch,
        "gemm_bf16: packed rhs too short"
    );
    let mc_task = rows_per_task(m);
    dst[..m * n]
        .par_chunks_mut(mc_task * n)
        .enumerate()
        .for_each(|(blk, drows)| {
            let i0 = blk * mc_task;
            let mc = drows.len() / n;
            let rows_pad = mc.next_multiple_of(MR);
            let mut ap = vec![0u32; rows_pad * KC / 2];
            let mut stage = Stage([0.0; MR * NR]);
            // SAFETY: `available()` was asserted; nothing in this task
            // runs other tile code on this thread.
            let tiles = unsafe { Tiles::load() };
            for p0 in (0..k).step_by(KC) {
                let kc = KC.min(k - p0);
                let kc2p = kc.div_ceil(2).next_multiple_of(TILE_PAIRS);
                let kt = kc2p / TILE_PAIRS;
                let round = round_output && p0 + kc == k;
                let load = !(overwrite && p0 == 0);
                let ap = &mut ap[..rows_pad * kc2p];
                // SAFETY: the CPU has AVX-512F (`available`).
                unsafe { pack_a(ap, a, i0, mc, p0, kc, kc2p) };
                for panel in 0..panels {
                    let j0 = panel * NR;
                    let nw = NR.min(n - j0);
                    // p0/2 + kc2p <= panel_pairs(k): p0 is a multiple of
                    // KC, so the block's pairs end where k's do, rounded
                    // up to a tile.
                    let bpanel = &bp[panel * pitch + (p0 / 2) * NR..][..kc2p * NR];
                    for r0 in (0..mc).step_by(MR) {
                        let rows = MR.min(mc - r0);
                        let apanel = &ap[r0 * kc2p..][..MR * kc2p];
                        if rows == MR && nw == NR {
                            let c = drows[r0 * n + j0..].as_mut_ptr();
                            // SAFETY: `apanel` holds MR rows of kc2p words,
                            // `bpanel` kc2p·NR words, and the MR×NR block
                            // of C lies inside `drows` (row stride n).
                            unsafe {
                                tiles.block(kt, apanel.as_ptr(), kc2p, bpanel.as_ptr(), c, n, load)
                            };
                            if round {
                                for ii in 0..MR {
                                    round_to_bf16(&mut drows[(r0 + ii) * n + j0..][..NR]);
                                }
                            }
                            continue;
                        }
                        // A ragged edge: through the staging block.
                        let s = &mut stage.0;
                        if load {
                            for ii in 0..rows {
                                let src = &drows[(r0 + ii) * n + j0..][..nw];
                                s[ii * NR..][..nw].copy_from_slice(src);
                            }
                        }
                        // SAFETY: as above, with C the MR×NR stage.
                        unsafe {
                            tiles.block(
                                kt,
                                apanel.as_ptr(),
                                kc2p,
                                bpanel.as_ptr(),
                                s.as_mut_ptr(),
                                NR,
                                load,
                            )
                        };
                        for ii in 0..rows {
                            let drow = &mut drows[(r0 + ii) * n + j0..][..nw];
                            for (d, &t) in drow.iter_mut().zip(&s[ii * NR..][..nw]) {
                                *d = if round {
                                    bf16_bits_to_f32(f32_to_bf16_bits(t))
                                } else {
                                    t
                                };
                            }
                        }
                    }
                }
            }
            drop(tiles);
        });
}

/// Packs rows `i0..i0+mc` and k-block `p0..p0+kc` of `a` into `out`:
/// `mc` rounded up to [`MR`] rows of `kc2p` words (k-pairs, the lower k in
/// the low half), zero past the rows, past k and in an odd k's tail half.
///
/// # Safety
/// The CPU must have AVX-512F ([`available`]).
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_a(
    out: &mut [u32],
    a: Lhs<'_>,
    i0: usize,
    mc: usize,
    p0: usize,
    kc: usize,
    kc2p: usize,
) {
    let kc2 = kc.div_ceil(2);
    let m = a.dims().0;
    let valid = mc.min(m - i0);
    match a {
        Lhs::Bf16Rows { words, k, .. } => {
            // Whole words already: copy each row's block.
            let pairs = k.div_ceil(2);
            for (ii, row) in out.chunks_exact_mut(kc2p).enumerate() {
                if ii < valid {
                    row[..kc2].copy_from_slice(&words[(i0 + ii) * pairs + p0 / 2..][..kc2]);
                    row[kc2..].fill(0);
                } else {
                    row.fill(0);
                }
            }
        }
        Lhs::F32(a) if a.cs == 1 => {
            // Rows contiguous along k: a row rounded in order is its words.
            for (ii, row) in out.chunks_exact_mut(kc2p).enumerate() {
                if ii < valid {
                    let src = &a.data[(i0 + ii) * a.rs + p0..][..kc];
                    let halves: &mut [u16] = bytemuck::cast_slice_mut(row);
                    f32_to_bf16(&mut halves[..kc], src);
                    halves[kc..].fill(0);
                } else {
                    row.fill(0);
                }
            }
        }
        Lhs::F32(a) => pack_transposed(out, valid, kc, kc2p, |r0, kp, hi_in, col| {
            f32_pairs(col, a, i0 + r0, p0 + 2 * kp, hi_in)
        }),
        Lhs::Bf16RowsTransposed { words, m, .. } => {
            // a = halvesᵀ: a k-pair is two consecutive rows of halves.
            let halves: &[u16] = bytemuck::cast_slice(words);
            let stride = 2 * m.div_ceil(2);
            pack_transposed(out, valid, kc, kc2p, |r0, kp, hi_in, col| {
                let p = p0 + 2 * kp;
                let lo = &halves[p * stride + i0 + r0..][..col.len()];
                if hi_in {
                    let hi = &halves[(p + 1) * stride + i0 + r0..][..col.len()];
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
    }
}

/// The words of k-pair (p, p+1) (p+1 only when `hi_in`) for rows `r..r +
/// col.len()` of an f32 `a` that is not row-contiguous.
#[inline(always)]
fn f32_pairs(col: &mut [u32], a: MatRef<'_>, r: usize, p: usize, hi_in: bool) {
    let bits = |i: usize, p: usize| f32_to_bf16_bits(a.data[i * a.rs + p * a.cs]) as u32;
    for (ii, w) in col.iter_mut().enumerate() {
        let hi = if hi_in { bits(r + ii, p + 1) } else { 0 };
        *w = bits(r + ii, p) | (hi << 16);
    }
}

/// The packing of an `a` read across its rows (transposed storage): for
/// each group of 16 rows and each k-pair `kp` of the block, `fill(r0, kp,
/// hi_in_block, col)` writes the words of the group's valid rows (from
/// block row `r0`), which land in column `kp` of those rows of `out`.
/// Everything else of `out` (rows past `valid`, pairs past k) is zeroed.
#[inline(always)]
fn pack_transposed(
    out: &mut [u32],
    valid: usize,
    kc: usize,
    kc2p: usize,
    mut fill: impl FnMut(usize, usize, bool, &mut [u32]),
) {
    const G: usize = 16;
    let kc2 = kc.div_ceil(2);
    let mut col = [0u32; G];
    for (g, rows_out) in out.chunks_exact_mut(G * kc2p).enumerate() {
        let r0 = g * G;
        let rows = G.min(valid - r0.min(valid));
        if rows < G || kc2 < kc2p {
            rows_out.fill(0);
        }
        if rows == 0 {
            continue;
        }
        for kp in 0..kc2 {
            fill(r0, kp, 2 * kp + 1 < kc, &mut col[..rows]);
            for (ii, &w) in col[..rows].iter().enumerate() {
                rows_out[ii * kc2p + kp] = w;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::bf16_gemm::{Kernel, gemm_bf16_kernel};
    use super::super::gemm::Accumulate;
    use super::super::{Rhs, pack_rhs};
    use super::*;

    fn skip() -> bool {
        if !available() {
            eprintln!("skipped: this CPU (or OS) has no AMX-BF16");
        }
        !available()
    }

    fn round_bf16(v: f32) -> f32 {
        bf16_bits_to_f32(f32_to_bf16_bits(v))
    }

    /// Values of a few bf16 magnitudes and both signs, bf16-representable.
    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let h = (i * 2654435761 + seed * 40503) % 65521;
                round_bf16((h as f32 - 32760.0) / 4099.0 * (1 + h % 3) as f32)
            })
            .collect()
    }

    /// bf16 words of a row-major (rows, cols) matrix: rows of ⌈cols/2⌉
    /// words, an odd tail's high half zero.
    fn words_of(v: &[f32], rows: usize, cols: usize) -> Vec<u32> {
        let pairs = cols.div_ceil(2);
        let mut out = vec![0u32; rows * pairs];
        for r in 0..rows {
            let halves: &mut [u16] = bytemuck::cast_slice_mut(&mut out[r * pairs..][..pairs]);
            f32_to_bf16(&mut halves[..cols], &v[r * cols..][..cols]);
        }
        out
    }

    /// The four left-operand forms of one (m, k) matrix `a` (row-major
    /// values `av`): f32 row-major, f32 transposed storage, bf16 rows, and
    /// bf16 rows of its transpose. Returns the backing data and a builder.
    struct Forms {
        at: Vec<f32>,
        rows: Vec<u32>,
        rows_t: Vec<u32>,
    }

    fn forms(av: &[f32], m: usize, k: usize) -> Forms {
        let mut at = vec![0.0; m * k];
        for i in 0..m {
            for p in 0..k {
                at[p * m + i] = av[i * k + p];
            }
        }
        Forms {
            rows: words_of(av, m, k),
            rows_t: words_of(&at, k, m),
            at,
        }
    }

    fn lhs_forms<'a>(
        av: &'a [f32],
        f: &'a Forms,
        m: usize,
        k: usize,
    ) -> Vec<(&'static str, Lhs<'a>)> {
        vec![
            ("f32 rows", Lhs::F32(MatRef::row_major(av, m, k))),
            (
                "f32 transposed",
                Lhs::F32(MatRef::row_major(&f.at, k, m).t()),
            ),
            (
                "bf16 rows",
                Lhs::Bf16Rows {
                    words: &f.rows,
                    rows: m,
                    k,
                },
            ),
            (
                "bf16 rows transposed",
                Lhs::Bf16RowsTransposed {
                    words: &f.rows_t,
                    m,
                    k,
                },
            ),
        ]
    }

    /// (Σ a·b in f64, Σ |a|·|b|) per element of the (m, n) product.
    fn reference(av: &[f32], b: MatRef<'_>, m: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
        let n = b.cols;
        let (mut sum, mut abs) = (vec![0.0; m * n], vec![0.0; m * n]);
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    let t = av[i * k + p] as f64 * b.data[p * b.rs + j * b.cs] as f64;
                    sum[i * n + j] += t;
                    abs[i * n + j] += t.abs();
                }
            }
        }
        (sum, abs)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Ragged against the 32×32 block, the 16-pair tile, KC (512) and the
    /// task rows; odd k; k over one, two and three blocks.
    const SHAPES: &[(usize, usize, usize)] = &[
        (1, 1, 1),
        (9, 3, 33),
        (33, 31, 17),
        (37, 257, 23),
        (64, 64, 64),
        (130, 515, 70),
        (70, 1100, 96),
    ];

    /// Tolerance: every product of two bf16 values is exact in f32, so the
    /// only error is f32 accumulation, at most k·eps_f32·Σ|a||b| (the
    /// recursive-summation bound γ_k ≤ k·u with u = eps/2, kept loose by a
    /// factor two for the pairwise order inside `tdpbf16ps`), plus the
    /// starting value's share when accumulating.
    fn bound(k: usize, abs: f64, start: f64) -> f64 {
        (k as f64 + 1.0) * f32::EPSILON as f64 * (abs + start.abs())
    }

    #[test]
    fn matches_the_f64_reference_for_every_operand_form() {
        if skip() {
            return;
        }
        for &(m, k, n) in SHAPES {
            let av = values(m * k, 1);
            let bv = values(k * n, 2);
            let f = forms(&av, m, k);
            for tb in [false, true] {
                let b = MatRef::test_view(&bv, k, n, tb);
                let (want, abs) = reference(&av, b, m, k);
                let packed = pack_rhs(b);
                for (name, a) in lhs_forms(&av, &f, m, k) {
                    for rhs in [Rhs::F32(b), Rhs::Packed(&packed)] {
                        let mut acc = vec![1.0f32; m * n];
                        gemm_bf16_kernel(Kernel::Amx, &mut acc, a, rhs, Accumulate::Yes, false);
                        let mut over = vec![f32::NAN; m * n];
                        gemm_bf16_kernel(Kernel::Amx, &mut over, a, rhs, Accumulate::No, false);
                        for e in 0..m * n {
                            let (d, w) = (over[e] as f64, want[e]);
                            let tol = bound(k, abs[e], 0.0);
                            assert!(
                                (d - w).abs() <= tol,
                                "{m}x{k}x{n} {name} tb {tb} [{e}]: {d} vs {w}"
                            );
                            let (d, w) = (acc[e] as f64, want[e] + 1.0);
                            let tol = bound(k, abs[e], 1.0);
                            assert!(
                                (d - w).abs() <= tol,
                                "{m}x{k}x{n} {name} tb {tb} acc [{e}]: {d} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_operand_form_gives_the_same_bits() {
        if skip() {
            return;
        }
        // The forms differ only in packing, so the tiles see the same words.
        for &(m, k, n) in SHAPES {
            let av = values(m * k, 3);
            let bv = values(k * n, 4);
            let f = forms(&av, m, k);
            let b = MatRef::row_major(&bv, k, n);
            let mut first: Option<Vec<u32>> = None;
            for (name, a) in lhs_forms(&av, &f, m, k) {
                let mut dst = vec![0.25f32; m * n];
                gemm_bf16_kernel(
                    Kernel::Amx,
                    &mut dst,
                    a,
                    Rhs::F32(b),
                    Accumulate::Yes,
                    false,
                );
                match &first {
                    None => first = Some(bits(&dst)),
                    Some(want) => assert_eq!(&bits(&dst), want, "{m}x{k}x{n} {name}"),
                }
            }
        }
    }

    #[test]
    fn rounded_output_is_the_rounded_sum() {
        if skip() {
            return;
        }
        for &(m, k, n) in SHAPES {
            let av = values(m * k, 5);
            let bv = values(k * n, 6);
            let (a, b) = (MatRef::row_major(&av, m, k), MatRef::row_major(&bv, k, n));
            for acc in [Accumulate::Yes, Accumulate::No] {
                let mut want = vec![0.75f32; m * n];
                gemm_bf16_kernel(Kernel::Amx, &mut want, Lhs::F32(a), Rhs::F32(b), acc, false);
                round_to_bf16(&mut want);
                let mut got = vec![0.75f32; m * n];
                gemm_bf16_kernel(Kernel::Amx, &mut got, Lhs::F32(a), Rhs::F32(b), acc, true);
                assert_eq!(bits(&got), bits(&want), "{m}x{k}x{n} {acc:?}");
            }
        }
    }

    /// AMX against the AVX512-BF16 kernel on the same inputs: NOT
    /// bit-identical, so the bound is asserted (twice the reference bound:
    /// each is within it of the exact sum). Measured on a Sapphire
    /// Rapids-class Xeon: about 64% of the elements here differ in the
    /// last bits. Why: `vdpbf16ps` is exactly a chain of f32 additions per
    /// lane, the odd product of each pair first (an f32 emulation of that
    /// chain matched all 4096 elements of a 64×300×64 probe), whereas
    /// `tdpbf16ps` sums each instruction's 16 k-pairs (32 products) inside
    /// the unit before adding them to the accumulator (an f32 tree per
    /// tile, then one add, matched 95% of the probe; no sequential order
    /// matched more than 44%). The products are exact either way; only the
    /// order of the f32 additions differs.
    #[test]
    fn amx_and_avx512bf16_agree() {
        if skip() {
            return;
        }
        let (mut differ, mut total) = (0usize, 0usize);
        for &(m, k, n) in SHAPES {
            let av = values(m * k, 7);
            let bv = values(k * n, 8);
            let (a, b) = (MatRef::row_major(&av, m, k), MatRef::row_major(&bv, k, n));
            let (_, abs) = reference(&av, b, m, k);
            let mut x = vec![0.0f32; m * n];
            gemm_bf16_kernel(
                Kernel::Amx,
                &mut x,
                Lhs::F32(a),
                Rhs::F32(b),
                Accumulate::No,
                false,
            );
            let mut y = vec![0.0f32; m * n];
            gemm_bf16_kernel(
                Kernel::Avx512Bf16,
                &mut y,
                Lhs::F32(a),
                Rhs::F32(b),
                Accumulate::No,
                false,
            );
            for e in 0..m * n {
                total += 1;
                if x[e].to_bits() != y[e].to_bits() {
                    differ += 1;
                }
                let tol = 2.0 * bound(k, abs[e], 0.0);
                assert!(
                    ((x[e] - y[e]) as f64).abs() <= tol,
                    "{m}x{k}x{n} [{e}]: {} vs {}",
                    x[e],
                    y[e]
                );
            }
        }
        eprintln!("amx vs avx512bf16: {differ} of {total} elements differ in their bits");
    }

    #[test]
    fn result_does_not_depend_on_thread_count() {
        if skip() {
            return;
        }
        let (m, k, n) = (300, 600, 40);
        let av = values(m * k, 9);
        let bv = values(k * n, 10);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut dst = vec![0.0f32; m * n];
            pool.install(|| {
                gemm_bf16_kernel(
                    Kernel::Amx,
                    &mut dst,
                    Lhs::F32(MatRef::row_major(&av, m, k)),
                    Rhs::F32(MatRef::row_major(&bv, k, n)),
                    Accumulate::No,
                    false,
                )
            });
            bits(&dst)
        };
        assert_eq!(run(1), run(3));
    }
}
