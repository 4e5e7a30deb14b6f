//! 2-D convolution, NHWC activations, HWIO weights, no bias, groups 1.
//!
//! The weight is a (K = kh·kw·cin, cout) row-major matrix, so one output row
//! (one pixel, all output channels) is a patch row times the weight:
//! * 1×1 stride-1 convolutions are a single GEMM on the activation itself;
//! * every other shape goes through im2col in tiles of `tile_rows` output
//!   pixels, so the workspace stays bounded (and is allocated by the caller
//!   from the pool, where it is counted).

use rayon::prelude::*;

use crate::device::cpu::{
    Accumulate, GemmMath, Lhs, MatRef, PackedRhs, Rhs, bf16_to_f32, bf16_to_f32_par, f32_to_bf16,
    f32_to_bf16_par, gemm, gemm_bf16_lhs, gemm_bf16_rounded, pack_rhs, round_to_bf16,
    round_to_bf16_par,
};
use crate::error::{Error, Result};
use crate::profile::{Family, timed};
use crate::tensor::DType;

/// Target floats per im2col tile (4 MiB): large enough for GEMM efficiency,
/// small enough to stay in cache-friendly territory and cheap to hold.
const TILE_FLOATS: usize = 1 << 20;

/// Rows from which a pointwise weight gradient is split in two (see
/// [`ConvGeom::splits_wgrad`]).
const WGRAD_SPLIT_MIN_ROWS: usize = 4096;

/// A convolution's input activation (n, h, w, cin).
#[derive(Clone, Copy)]
pub enum ConvInput<'a> {
    F32(&'a [f32]),
    /// bf16 values, two channels per word (lower channel in the low half;
    /// `cin` even): the bf16 mode's stored activations, read in place
    /// instead of through a whole f32 copy. The native bf16 GEMM and the
    /// bf16 im2col read the words as they are; the f32 GEMM (a CPU without
    /// bf16 dot products) reads them widened one tile of rows at a time
    /// into the workspace (exact: every bf16 value is an f32).
    Bf16Words(&'a [u32]),
}

impl ConvInput<'_> {
    fn len(&self) -> usize {
        match self {
            ConvInput::F32(x) => x.len(),
            ConvInput::Bf16Words(w) => 2 * w.len(),
        }
    }

    /// The bf16 words of rows `r0..r0+rows` of `cin` values each.
    fn bf16_rows(&self, g: &ConvGeom, r0: usize, rows: usize) -> Option<&[u32]> {
        match self {
            ConvInput::F32(_) => None,
            ConvInput::Bf16Words(w) => Some(&w[r0 * g.cin / 2..(r0 + rows) * g.cin / 2]),
        }
    }

    /// [`ConvGeom::widens`] for this input.
    fn widens(&self, math: GemmMath) -> bool {
        let dtype = match self {
            ConvInput::F32(_) => DType::F32,
            ConvInput::Bf16Words(_) => DType::BF16,
        };
        ConvGeom::widens(dtype, math)
    }
}

/// `dst` (rows·cin f32) = the bf16 `words` of those rows, widened (exact).
fn widen_rows(dst: &mut [f32], words: &[u32]) {
    bf16_to_f32_par(dst, bytemuck::cast_slice(words));
}

/// Everything that determines a convolution's shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvGeom {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub cin: usize,
    pub cout: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: usize,
    pub pad: usize,
}

impl ConvGeom {
    pub fn validate(&self) -> Result<()> {
        if self.stride == 0 || self.kh == 0 || self.kw == 0 {
            return Err(Error::invalid(
                "conv2d",
                format!("degenerate geometry {self:?}"),
            ));
        }
        if self.h + 2 * self.pad < self.kh || self.w + 2 * self.pad < self.kw {
            return Err(Error::invalid(
                "conv2d",
                format!(
                    "input {}x{} (padding {}) is smaller than the {}x{} kernel",
                    self.h, self.w, self.pad, self.kh, self.kw
                ),
            ));
        }
        Ok(())
    }

    pub fn oh(&self) -> usize {
        (self.h + 2 * self.pad - self.kh) / self.stride + 1
    }

    pub fn ow(&self) -> usize {
        (self.w + 2 * self.pad - self.kw) / self.stride + 1
    }

    /// GEMM rows: output pixels over the batch.
    pub fn rows(&self) -> usize {
        self.n * self.oh() * self.ow()
    }

    /// GEMM inner dimension: one patch.
    pub fn k(&self) -> usize {
        self.kh * self.kw * self.cin
    }

    pub fn input_len(&self) -> usize {
        self.n * self.h * self.w * self.cin
    }

    pub fn output_len(&self) -> usize {
        self.rows() * self.cout
    }

    pub fn weight_len(&self) -> usize {
        self.k() * self.cout
    }

    /// A 1×1 stride-1 unpadded convolution needs no im2col.
    pub fn is_pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.stride == 1 && self.pad == 0
    }

    /// Output pixels per im2col tile.
    pub fn tile_rows(&self) -> usize {
        (TILE_FLOATS / self.k()).max(64).min(self.rows().max(1))
    }

    /// f32 elements of workspace `conv2d_forward` needs for an f32 input.
    pub fn forward_workspace_len(&self) -> usize {
        self.forward_workspace_len_for(false)
    }

    /// f32 elements of workspace `conv2d_backward` needs for an f32 input.
    pub fn backward_workspace_len(&self) -> usize {
        self.backward_workspace_len_for(false)
    }

    /// f32 elements of workspace `conv2d_forward` needs; `widens`: the
    /// input is bf16 and the GEMM f32 ([`ConvGeom::widens`]), so a
    /// pointwise convolution needs one tile of widened rows.
    pub fn forward_workspace_len_for(&self, widens: bool) -> usize {
        if !self.is_pointwise() {
            self.tile_rows() * self.k()
        } else if widens {
            self.tile_rows() * self.cin
        } else {
            0
        }
    }

    /// f32 elements of workspace `conv2d_backward` needs: patches and their
    /// gradient, one tile each; for a pointwise convolution whose weight
    /// gradient is split over the batch, the second half's partial sum
    /// (and, widening, one tile of widened rows per half).
    pub fn backward_workspace_len_for(&self, widens: bool) -> usize {
        if !self.is_pointwise() {
            2 * self.forward_workspace_len_for(widens)
        } else if self.splits_wgrad() {
            self.weight_len()
                + if widens {
                    2 * self.tile_rows() * self.cin
                } else {
                    0
                }
        } else {
            self.forward_workspace_len_for(widens)
        }
    }

    /// f32 elements of one tile of output rows: what
    /// [`conv2d_forward_bf16_out`] computes in f32 before storing it.
    pub fn output_tile_len(&self) -> usize {
        self.tile_rows() * self.cout
    }

    /// Whether a convolution widens its input tile by tile: a bf16 input
    /// with the f32 GEMM (the native bf16 GEMM reads the words in place).
    pub fn widens(input: DType, math: GemmMath) -> bool {
        input == DType::BF16 && !math.native_bf16()
    }

    /// Whether the pointwise weight gradient `xᵀ·dy` is computed as two
    /// halves over the rows, one per thread. Its output (cin, cout) is small
    /// and its inner dimension (every pixel of the batch) long, a shape the
    /// GEMM only threads over the output, so splitting the inner dimension
    /// is what keeps both cores busy. The split point depends on the shape
    /// only, so the result does not depend on the thread count.
    pub fn splits_wgrad(&self) -> bool {
        self.is_pointwise() && self.rows() >= WGRAD_SPLIT_MIN_ROWS
    }

    /// Multiply-adds of the forward pass (the dgrad and wgrad are the same).
    pub fn macs(&self) -> usize {
        self.rows() * self.k() * self.cout
    }
}

/// One kernel row (fixed ky) of the patch of output pixel `r`: the patch
/// holds `kw·cin` values for it, of which `[lo, hi)` come from the input in
/// one contiguous run starting at `src` (input layout (iy, ix, cin) makes
/// consecutive kx consecutive pixels) and the rest are padding zeros.
/// `None` when the whole kernel row falls in the padding.
struct PatchRun {
    lo: usize,
    hi: usize,
    src: usize,
}

/// The patch of output pixel `r`, one [`PatchRun`] per kernel row, in
/// patch order. Copying runs instead of single pixels matters most for the
/// stem: with three input channels a pixel is three floats.
fn patch_runs(g: &ConvGeom, r: usize) -> impl Iterator<Item = Option<PatchRun>> + '_ {
    let (oh, ow, cin) = (g.oh(), g.ow(), g.cin);
    let (n, oy, ox) = (r / (oh * ow), (r / ow) % oh, r % ow);
    let ix0 = (ox * g.stride) as isize - g.pad as isize;
    let kx_lo = (-ix0).clamp(0, g.kw as isize) as usize;
    let kx_hi = (g.w as isize - ix0).clamp(kx_lo as isize, g.kw as isize) as usize;
    (0..g.kh).map(move |ky| {
        let iy = (oy * g.stride + ky) as isize - g.pad as isize;
        if iy < 0 || iy >= g.h as isize || kx_lo == kx_hi {
            return None;
        }
        let pixel = (n * g.h + iy as usize) * g.w + (ix0 + kx_lo as isize) as usize;
        Some(PatchRun {
            lo: kx_lo * cin,
            hi: kx_hi * cin,
            src: pixel * cin,
        })
    })
}

/// Copy the patches of output rows `row0..row0+rows` into `col` (rows, K),
/// from an f32 input or, widened, from a bf16 one.
fn im2col_tile(col: &mut [f32], x: ConvInput<'_>, g: &ConvGeom, row0: usize, rows: usize) {
    let (k, line) = (g.k(), g.kw * g.cin);
    let (x, x_bf16): (&[f32], &[u16]) = match x {
        ConvInput::F32(x) => (x, &[]),
        ConvInput::Bf16Words(w) => (&[], bytemuck::cast_slice(w)),
    };
    let bf16_in = x.is_empty();
    col[..rows * k]
        .par_chunks_mut(k)
        .enumerate()
        .for_each(|(i, patch)| {
            for (dst, run) in patch.chunks_exact_mut(line).zip(patch_runs(g, row0 + i)) {
                let Some(PatchRun { lo, hi, src }) = run else {
                    dst.fill(0.0);
                    continue;
                };
                dst[..lo].fill(0.0);
                if bf16_in {
                    bf16_to_f32(&mut dst[lo..hi], &x_bf16[src..src + hi - lo]);
                } else {
                    dst[lo..hi].copy_from_slice(&x[src..src + hi - lo]);
                }
                dst[hi..].fill(0.0);
            }
        });
}

/// [`im2col_tile`] straight into bf16 for the native bf16 GEMM: each patch
/// row becomes ⌈K/2⌉ words of k-pairs (an odd tail zero), so the GEMM reads
/// the patches in place instead of packing an f32 copy. Each kernel row's
/// contiguous input run is converted (or, from a bf16 input, copied: its
/// values are bf16 already) as one slice, so the vector converter sees
/// whole blocks even for the stem's 3 channels.
fn im2col_tile_bf16(col: &mut [u32], x: ConvInput<'_>, g: &ConvGeom, row0: usize, rows: usize) {
    let (k, line) = (g.k(), g.kw * g.cin);
    let k2 = k.div_ceil(2);
    let (x, x_bf16): (&[f32], &[u16]) = match x {
        ConvInput::F32(x) => (x, &[]),
        ConvInput::Bf16Words(w) => (&[], bytemuck::cast_slice(w)),
    };
    let bf16_in = x.is_empty();
    col[..rows * k2]
        .par_chunks_mut(k2)
        .enumerate()
        .for_each(|(i, words)| {
            let patch: &mut [u16] = bytemuck::cast_slice_mut(words);
            if k % 2 == 1 {
                patch[k] = 0;
            }
            for (dst, run) in patch[..k]
                .chunks_exact_mut(line)
                .zip(patch_runs(g, row0 + i))
            {
                let Some(PatchRun { lo, hi, src }) = run else {
                    dst.fill(0);
                    continue;
                };
                dst[..lo].fill(0);
                if bf16_in {
                    dst[lo..hi].copy_from_slice(&x_bf16[src..src + hi - lo]);
                } else {
                    f32_to_bf16(&mut dst[lo..hi], &x[src..src + hi - lo]);
                }
                dst[hi..].fill(0);
            }
        });
}

/// Add patch gradients `dcol` (rows, K) of output rows `row0..row0+rows`
/// back into `dx`. Patches overlap, so rather than scatter from patches this
/// gathers per input line (n, iy): each thread owns whole lines of `dx`, and
/// every element sums its contributions in the same (ky, kx) order whatever
/// the thread count.
fn col2im_tile(dx: &mut [f32], dcol: &[f32], g: &ConvGeom, row0: usize, rows: usize) {
    if rows == 0 {
        return;
    }
    let (oh, ow, k, cin) = (g.oh(), g.ow(), g.k(), g.cin);
    let (s, pad) = (g.stride, g.pad);
    let row1 = row0 + rows;
    // Input lines (n·h + iy) the tile's patches can touch.
    let line_of = |r: usize, dy: isize| {
        let (n, oy) = (r / (oh * ow), (r / ow) % oh);
        let iy = (oy * s) as isize - pad as isize + dy;
        n * g.h + iy.clamp(0, g.h as isize - 1) as usize
    };
    let first = line_of(row0, 0);
    let last = line_of(row1 - 1, g.kh as isize - 1);
    let line_len = g.w * cin;
    // The output index `o` (oy or ox) that kernel offset `kk` maps input
    // index `i` to, if any.
    let out_index = |i: usize, kk: usize, limit: usize| -> Option<usize> {
        let t = (i + pad).checked_sub(kk)?;
        (t % s == 0 && t / s < limit).then_some(t / s)
    };
    dx[first * line_len..(last + 1) * line_len]
        .par_chunks_mut(line_len)
        .enumerate()
        .for_each(|(j, line)| {
            let (n, iy) = ((first + j) / g.h, (first + j) % g.h);
            for ky in 0..g.kh {
                let Some(oy) = out_index(iy, ky, oh) else {
                    continue;
                };
                for ix in 0..g.w {
                    let dst = &mut line[ix * cin..(ix + 1) * cin];
                    for kx in 0..g.kw {
                        let Some(ox) = out_index(ix, kx, ow) else {
                            continue;
                        };
                        let r = (n * oh + oy) * ow + ox;
                        if r < row0 || r >= row1 {
                            continue;
                        }
                        let src = &dcol[(r - row0) * k + (ky * g.kw + kx) * cin..][..cin];
                        for (d, v) in dst.iter_mut().zip(src) {
                            *d += v;
                        }
                    }
                }
            }
        });
}

/// A bf16 input needs the bf16 arithmetic and an even `cin` (rows of
/// whole words); callers choose the input form, so this is an engine bug,
/// never user input.
fn check_bf16_input(g: &ConvGeom, x: ConvInput<'_>, math: GemmMath) {
    if let ConvInput::Bf16Words(_) = x {
        assert!(
            math == GemmMath::Bf16 && g.cin.is_multiple_of(2),
            "conv2d: bf16 input needs the bf16 arithmetic and an even cin ({g:?})"
        );
    }
}

fn check_lens(g: &ConvGeom, y: usize, x: usize, w: usize) {
    assert_eq!(y, g.output_len(), "conv2d: output length for {g:?}");
    assert_eq!(x, g.input_len(), "conv2d: input length for {g:?}");
    assert_eq!(w, g.weight_len(), "conv2d: weight length for {g:?}");
}

/// y (n, oh, ow, cout) = conv(x (n, h, w, cin), w (kh, kw, cin, cout)).
/// `ws` holds at least `g.forward_workspace_len_for(widens)` floats
/// ([`ConvGeom::widens`]). `math` is the
/// GEMM arithmetic: bf16 takes bf16-representable `x` (the native kernel
/// rounds the weight as it packs it; the f32 fallback needs it
/// bf16-representable too) and returns `y` rounded to bf16, as a bf16
/// convolution's output is.
pub fn conv2d_forward(
    y: &mut [f32],
    x: ConvInput<'_>,
    w: &[f32],
    g: &ConvGeom,
    ws: &mut [f32],
    math: GemmMath,
) {
    timed(Family::ConvForward, 2 * g.macs() as u64, || {
        conv2d_forward_untimed(y, x, w, g, ws, math)
    })
}

fn conv2d_forward_untimed(
    y: &mut [f32],
    x: ConvInput<'_>,
    w: &[f32],
    g: &ConvGeom,
    ws: &mut [f32],
    math: GemmMath,
) {
    check_lens(g, y.len(), x.len(), w.len());
    check_bf16_input(g, x, math);
    let wm = MatRef::row_major(w, g.k(), g.cout);
    if g.is_pointwise() {
        // One GEMM over every row.
        forward_rows(y, x, wm, None, g, 0, g.rows(), ws, math, true);
        return;
    }
    let tile = g.tile_rows();
    // The native bf16 GEMM takes the patches as bf16 rows (half the bytes
    // written, and no second pass to pack them); the weight is packed once
    // for all tiles.
    let w_packed = math.native_bf16().then(|| pack_rhs(wm));
    for row0 in (0..g.rows()).step_by(tile) {
        let rows = tile.min(g.rows() - row0);
        let y_tile = &mut y[row0 * g.cout..(row0 + rows) * g.cout];
        forward_rows(
            y_tile,
            x,
            wm,
            w_packed.as_ref(),
            g,
            row0,
            rows,
            ws,
            math,
            true,
        );
    }
}

/// [`conv2d_forward`] with `y` stored in bf16 (`math` bf16): each tile of
/// output rows is computed in f32 in the workspace, after the input's
/// part, and stored rounded, so no f32 copy of the whole output exists.
/// `ws` holds at least `g.forward_workspace_len_for(widens) +
/// g.output_tile_len()` floats; `y` holds the bits of the f32 kernel's
/// rounded output.
pub fn conv2d_forward_bf16_out(
    y: &mut [half::bf16],
    x: ConvInput<'_>,
    w: &[f32],
    g: &ConvGeom,
    ws: &mut [f32],
    math: GemmMath,
) {
    timed(Family::ConvForward, 2 * g.macs() as u64, || {
        check_lens(g, y.len(), x.len(), w.len());
        check_bf16_input(g, x, math);
        assert_eq!(
            math,
            GemmMath::Bf16,
            "conv2d: a bf16 output needs bf16 arithmetic"
        );
        let wm = MatRef::row_major(w, g.k(), g.cout);
        let (ws, out) = ws.split_at_mut(g.forward_workspace_len_for(x.widens(math)));
        let out = &mut out[..g.output_tile_len()];
        let tile = g.tile_rows();
        let w_packed = math.native_bf16().then(|| pack_rhs(wm));
        for row0 in (0..g.rows()).step_by(tile) {
            let rows = tile.min(g.rows() - row0);
            let o = &mut out[..rows * g.cout];
            // Unrounded: the conversion rounds to nearest even, as the
            // f32 kernel's rounding would.
            forward_rows(o, x, wm, w_packed.as_ref(), g, row0, rows, ws, math, false);
            let y_tile = &mut y[row0 * g.cout..(row0 + rows) * g.cout];
            f32_to_bf16_par(bytemuck::cast_slice_mut(y_tile), o);
        }
    })
}

/// Output rows `row0..row0+rows` of the convolution into `y` (rows·cout
/// f32; under bf16 arithmetic rounded to bf16 when `round`, else left for
/// the caller to round). `ws` holds the input's part of the workspace: an
/// im2col tile, or widened rows.
#[allow(clippy::too_many_arguments)]
fn forward_rows(
    y: &mut [f32],
    x: ConvInput<'_>,
    wm: MatRef<'_>,
    w_packed: Option<&PackedRhs>,
    g: &ConvGeom,
    row0: usize,
    rows: usize,
    ws: &mut [f32],
    math: GemmMath,
    round: bool,
) {
    let rhs = || w_packed.map_or(Rhs::F32(wm), Rhs::Packed);
    let round = round && math == GemmMath::Bf16;
    // An f32 left operand times the weight, rounded as asked.
    let f32_lhs = |y: &mut [f32], a: MatRef<'_>| {
        if round {
            gemm_bf16_rounded(y, a, wm, Accumulate::No)
        } else {
            gemm(y, a, wm, Accumulate::No, math)
        }
    };
    if g.is_pointwise() {
        match (x, math) {
            (ConvInput::Bf16Words(_), _) if x.widens(math) => {
                // The f32 GEMM, one tile of widened rows at a time: each
                // output row is its own dot products.
                let tile = g.tile_rows();
                assert!(
                    ws.len() >= tile.min(rows) * g.cin,
                    "conv2d_forward: workspace too small"
                );
                for r0 in (row0..row0 + rows).step_by(tile) {
                    let n = tile.min(row0 + rows - r0);
                    let a = &mut ws[..n * g.cin];
                    widen_rows(a, x.bf16_rows(g, r0, n).expect("bf16 input"));
                    let y_tile = &mut y[(r0 - row0) * g.cout..(r0 - row0 + n) * g.cout];
                    f32_lhs(y_tile, MatRef::row_major(a, n, g.cin));
                }
            }
            (ConvInput::Bf16Words(_), _) => {
                let words = x.bf16_rows(g, row0, rows).expect("bf16 input");
                let a = Lhs::Bf16Rows {
                    words,
                    rows,
                    k: g.cin,
                };
                gemm_bf16_lhs(y, a, rhs(), Accumulate::No, round)
            }
            (ConvInput::F32(x), _) => f32_lhs(
                y,
                MatRef::row_major(&x[row0 * g.cin..(row0 + rows) * g.cin], rows, g.cin),
            ),
        }
        return;
    }
    let k = g.k();
    assert!(ws.len() >= rows * k, "conv2d_forward: workspace too small");
    if let Some(w_packed) = w_packed {
        let words: &mut [u32] = bytemuck::cast_slice_mut(&mut ws[..]);
        im2col_tile_bf16(words, x, g, row0, rows);
        let words = &words[..rows * k.div_ceil(2)];
        let a = Lhs::Bf16Rows { words, rows, k };
        gemm_bf16_lhs(y, a, Rhs::Packed(w_packed), Accumulate::No, round);
        return;
    }
    im2col_tile(ws, x, g, row0, rows);
    let col = MatRef::row_major(&ws[..rows * k], rows, k);
    gemm(y, col, wm, Accumulate::No, math);
    if round {
        round_to_bf16_par(y);
    }
}

/// Gradients of a convolution. `dw += xᵀ-patches · dy`; when `dx` is given,
/// `dx += dy · wᵀ` scattered back (it accumulates, for residual fan-in).
/// `ws` holds at least `g.backward_workspace_len_for(widens)` floats
/// ([`ConvGeom::widens`]).
///
/// `math` is the GEMM arithmetic of both gradients (bf16 needs
/// bf16-representable `dy`, `x` and `w`, and returns `dx` rounded to bf16,
/// its previous contents included, as a bf16 input gradient is).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward(
    dx: Option<&mut [f32]>,
    dw: &mut [f32],
    dy: &[f32],
    x: ConvInput<'_>,
    w: &[f32],
    g: &ConvGeom,
    ws: &mut [f32],
    math: GemmMath,
) {
    check_lens(g, dy.len(), x.len(), w.len());
    check_bf16_input(g, x, math);
    assert_eq!(dw.len(), w.len(), "conv2d_backward: dw length");
    let (k, cout) = (g.k(), g.cout);
    let w_t = MatRef::row_major(w, k, cout).t();
    if g.is_pointwise() {
        let rows = g.rows();
        let dym = MatRef::row_major(dy, rows, cout);
        let flops = 2 * g.macs() as u64;
        let widens = x.widens(math);
        let tile = g.tile_rows();
        // dw [+]= x[r0..r0+n]ᵀ · dy[r0..r0+n]: a bf16 input is the
        // transpose of its rows, read in place by the native GEMM's
        // packing, or widened a tile at a time into `buf` for the f32 GEMM
        // (which then sums the rows tile by tile).
        let wgrad = |dw: &mut [f32], r0: usize, n: usize, acc: Accumulate, buf: &mut [f32]| {
            let b = MatRef::row_major(&dy[r0 * cout..(r0 + n) * cout], n, cout);
            match (x.bf16_rows(g, r0, n), x) {
                (Some(_), _) if widens => {
                    for t0 in (r0..r0 + n).step_by(tile) {
                        let m = tile.min(r0 + n - t0);
                        let a = &mut buf[..m * g.cin];
                        widen_rows(a, x.bf16_rows(g, t0, m).expect("bf16 input"));
                        let a = MatRef::row_major(a, m, g.cin).t();
                        let b = MatRef::row_major(&dy[t0 * cout..(t0 + m) * cout], m, cout);
                        let acc = if t0 == r0 { acc } else { Accumulate::Yes };
                        gemm(dw, a, b, acc, math);
                    }
                }
                (Some(words), _) => {
                    let a = Lhs::Bf16RowsTransposed {
                        words,
                        m: g.cin,
                        k: n,
                    };
                    gemm_bf16_lhs(dw, a, Rhs::F32(b), acc, false)
                }
                (None, ConvInput::F32(x)) => {
                    let a = MatRef::row_major(&x[r0 * g.cin..(r0 + n) * g.cin], n, g.cin).t();
                    gemm(dw, a, b, acc, math)
                }
                (None, ConvInput::Bf16Words(_)) => unreachable!("bf16_rows is Some"),
            }
        };
        let buf_len = if widens { tile * g.cin } else { 0 };
        assert!(
            ws.len() >= g.backward_workspace_len_for(widens),
            "conv2d_backward: workspace too small"
        );
        timed(Family::ConvWgrad, flops, || {
            if g.splits_wgrad() {
                let half = rows / 2;
                let (part, rest) = ws.split_at_mut(dw.len());
                let (buf0, rest) = rest.split_at_mut(buf_len);
                let buf1 = &mut rest[..buf_len];
                rayon::join(
                    || wgrad(dw, 0, half, Accumulate::Yes, buf0),
                    || wgrad(part, half, rows - half, Accumulate::No, buf1),
                );
                for (d, p) in dw.iter_mut().zip(part.iter()) {
                    *d += p;
                }
            } else {
                wgrad(dw, 0, rows, Accumulate::Yes, &mut ws[..buf_len])
            }
        });
        if let Some(dx) = dx {
            assert_eq!(dx.len(), x.len(), "conv2d_backward: dx length");
            timed(Family::ConvDgrad, flops, || match math {
                GemmMath::Bf16 => gemm_bf16_rounded(dx, dym, w_t, Accumulate::Yes),
                GemmMath::F32 => gemm(dx, dym, w_t, Accumulate::Yes, math),
            });
        }
        return;
    }
    let tile = g.tile_rows();
    assert!(
        ws.len() >= 2 * tile * k,
        "conv2d_backward: workspace too small"
    );
    let (col, dcol) = ws.split_at_mut(tile * k);
    let mut dx = dx;
    // The weight is the right operand of every tile's input gradient: pack
    // it once.
    let w_t_packed = (dx.is_some() && math.native_bf16()).then(|| pack_rhs(w_t));
    for row0 in (0..g.rows()).step_by(tile) {
        let rows = tile.min(g.rows() - row0);
        let dy_tile = MatRef::row_major(&dy[row0 * cout..(row0 + rows) * cout], rows, cout);
        let flops = 2 * (rows * k * cout) as u64;
        timed(Family::ConvWgrad, flops, || {
            if math.native_bf16() {
                // Patches as bf16 rows, read transposed by the GEMM's packing.
                let words: &mut [u32] = bytemuck::cast_slice_mut(&mut col[..]);
                im2col_tile_bf16(words, x, g, row0, rows);
                let words = &words[..rows * k.div_ceil(2)];
                let a = Lhs::Bf16RowsTransposed {
                    words,
                    m: k,
                    k: rows,
                };
                gemm_bf16_lhs(dw, a, Rhs::F32(dy_tile), Accumulate::Yes, false);
                return;
            }
            im2col_tile(col, x, g, row0, rows);
            let col_t = MatRef::row_major(&col[..rows * k], rows, k).t();
            gemm(dw, col_t, dy_tile, Accumulate::Yes, math);
        });
        if let Some(dx) = dx.as_deref_mut() {
            timed(Family::ConvDgrad, flops, || {
                let dcol = &mut dcol[..rows * k];
                match &w_t_packed {
                    Some(p) => gemm_bf16_lhs(
                        dcol,
                        Lhs::F32(dy_tile),
                        Rhs::Packed(p),
                        Accumulate::No,
                        false,
                    ),
                    None => gemm(dcol, dy_tile, w_t, Accumulate::No, math),
                }
                col2im_tile(dx, dcol, g, row0, rows);
            });
        }
    }
    // Tiles overlap in dx, so it is rounded once all of them are in.
    if let Some(dx) = dx.filter(|_| math == GemmMath::Bf16) {
        dx.par_chunks_mut(1 << 14).for_each(round_to_bf16);
    }
}

/// PyTorch's OIHW weight layout to ours (HWIO).
pub fn oihw_to_hwio(oihw: &[f32], cout: usize, cin: usize, kh: usize, kw: usize) -> Vec<f32> {
    let mut out = vec![0.0; oihw.len()];
    for co in 0..cout {
        for ci in 0..cin {
            for ky in 0..kh {
                for kx in 0..kw {
                    out[((ky * kw + kx) * cin + ci) * cout + co] =
                        oihw[((co * cin + ci) * kh + ky) * kw + kx];
                }
            }
        }
    }
    out
}

/// Ours (HWIO) to PyTorch's OIHW.
pub fn hwio_to_oihw(hwio: &[f32], cout: usize, cin: usize, kh: usize, kw: usize) -> Vec<f32> {
    let mut out = vec![0.0; hwio.len()];
    for co in 0..cout {
        for ci in 0..cin {
            for ky in 0..kh {
                for kx in 0..kw {
                    out[((co * cin + ci) * kh + ky) * kw + kx] =
                        hwio[((ky * kw + kx) * cin + ci) * cout + co];
                }
            }
        }
    }
    out
}

/// Naive f64 reference: the definition, loop by loop.
pub fn conv2d_ref(x: &[f64], w: &[f64], g: &ConvGeom) -> Vec<f64> {
    let (oh, ow) = (g.oh(), g.ow());
    let mut y = vec![0.0; g.output_len()];
    for n in 0..g.n {
        for oy in 0..oh {
            for ox in 0..ow {
                for co in 0..g.cout {
                    let mut s = 0.0;
                    for ky in 0..g.kh {
                        for kx in 0..g.kw {
                            let iy = (oy * g.stride + ky) as isize - g.pad as isize;
                            let ix = (ox * g.stride + kx) as isize - g.pad as isize;
                            if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
                                continue;
                            }
                            for ci in 0..g.cin {
                                s += x[((n * g.h + iy as usize) * g.w + ix as usize) * g.cin + ci]
                                    * w[((ky * g.kw + kx) * g.cin + ci) * g.cout + co];
                            }
                        }
                    }
                    y[((n * oh + oy) * ow + ox) * g.cout + co] = s;
                }
            }
        }
    }
    y
}

/// Naive f64 reference gradients: (dx, dw) of `sum(dy * conv(x, w))`.
pub fn conv2d_backward_ref(dy: &[f64], x: &[f64], w: &[f64], g: &ConvGeom) -> (Vec<f64>, Vec<f64>) {
    let (oh, ow) = (g.oh(), g.ow());
    let mut dx = vec![0.0; x.len()];
    let mut dw = vec![0.0; w.len()];
    for n in 0..g.n {
        for oy in 0..oh {
            for ox in 0..ow {
                for co in 0..g.cout {
                    let d = dy[((n * oh + oy) * ow + ox) * g.cout + co];
                    for ky in 0..g.kh {
                        for kx in 0..g.kw {
                            let iy = (oy * g.stride + ky) as isize - g.pad as isize;
                            let ix = (ox * g.stride + kx) as isize - g.pad as isize;
                            if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
                                continue;
                            }
                            for ci in 0..g.cin {
                                let xi = ((n * g.h + iy as usize) * g.w + ix as usize) * g.cin + ci;
                                let wi = ((ky * g.kw + kx) * g.cin + ci) * g.cout + co;
                                dx[xi] += d * w[wi];
                                dw[wi] += d * x[xi];
                            }
                        }
                    }
                }
            }
        }
    }
    (dx, dw)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    #[derive(Clone, Copy, Debug)]
    struct ConvCase {
        n: usize,
        h: usize,
        w: usize,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        pad: usize,
    }

    const CASES: &[ConvCase] = &[
        ConvCase {
            n: 2,
            h: 7,
            w: 5,
            cin: 3,
            cout: 4,
            k: 3,
            stride: 1,
            pad: 1,
        },
        ConvCase {
            n: 1,
            h: 9,
            w: 8,
            cin: 5,
            cout: 6,
            k: 3,
            stride: 2,
            pad: 1,
        },
        ConvCase {
            n: 2,
            h: 13,
            w: 11,
            cin: 3,
            cout: 4,
            k: 7,
            stride: 2,
            pad: 3,
        },
        ConvCase {
            n: 2,
            h: 6,
            w: 5,
            cin: 4,
            cout: 3,
            k: 1,
            stride: 1,
            pad: 0,
        },
        ConvCase {
            n: 3,
            h: 9,
            w: 7,
            cin: 5,
            cout: 6,
            k: 1,
            stride: 2,
            pad: 0,
        },
        ConvCase {
            n: 1,
            h: 4,
            w: 4,
            cin: 2,
            cout: 3,
            k: 3,
            stride: 1,
            pad: 0,
        },
        ConvCase {
            n: 1,
            h: 5,
            w: 6,
            cin: 3,
            cout: 2,
            k: 2,
            stride: 3,
            pad: 1,
        },
        // Input narrower than the kernel: every patch row is cut on both
        // sides.
        ConvCase {
            n: 2,
            h: 3,
            w: 2,
            cin: 3,
            cout: 2,
            k: 5,
            stride: 1,
            pad: 2,
        },
        // Padding wider than the kernel: whole patches fall in the padding.
        ConvCase {
            n: 1,
            h: 3,
            w: 2,
            cin: 2,
            cout: 3,
            k: 1,
            stride: 1,
            pad: 1,
        },
    ];

    fn geom(c: &ConvCase) -> ConvGeom {
        ConvGeom {
            n: c.n,
            h: c.h,
            w: c.w,
            cin: c.cin,
            cout: c.cout,
            kh: c.k,
            kw: c.k,
            stride: c.stride,
            pad: c.pad,
        }
    }

    /// The forward, then the backward into `dx` and `dw` (which accumulate),
    /// sharing one workspace of the larger size filled with `ws_fill` (NaN
    /// shows that no stale workspace leaks into a result). Returns y.
    #[allow(clippy::too_many_arguments)]
    fn forward_backward(
        g: &ConvGeom,
        x: &[f32],
        w: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        dw: &mut [f32],
        math: GemmMath,
        ws_fill: f32,
    ) -> Vec<f32> {
        let ws_len = g.backward_workspace_len().max(g.forward_workspace_len());
        let mut ws = vec![ws_fill; ws_len];
        let mut y = vec![0.0; g.output_len()];
        conv2d_forward(&mut y, ConvInput::F32(x), w, g, &mut ws, math);
        conv2d_backward(Some(dx), dw, dy, ConvInput::F32(x), w, g, &mut ws, math);
        y
    }

    #[test]
    fn forward_and_backward_match_f64_reference() {
        let mut r = rng(1);
        for c in CASES {
            let g = geom(c);
            let x = rand_vec(&mut r, g.input_len());
            let w = rand_vec(&mut r, g.weight_len());
            let dy = rand_vec(&mut r, g.output_len());
            // Both gradients accumulate: start from ones and expect ref + 1.
            let mut dx = vec![1.0; x.len()];
            let mut dw = vec![1.0; w.len()];
            let y = forward_backward(&g, &x, &w, &dy, &mut dx, &mut dw, GemmMath::F32, 0.0);
            let y_ref = conv2d_ref(&to_f64(&x), &to_f64(&w), &g);
            assert_close(&format!("{c:?} y"), &y, &y_ref, 1e-5, 1e-5);
            let (dx_ref, dw_ref) = conv2d_backward_ref(&to_f64(&dy), &to_f64(&x), &to_f64(&w), &g);
            let plus1 = |v: Vec<f64>| v.into_iter().map(|a| a + 1.0).collect::<Vec<_>>();
            assert_close(&format!("{c:?} dx"), &dx, &plus1(dx_ref), 1e-5, 1e-5);
            assert_close(&format!("{c:?} dw"), &dw, &plus1(dw_ref), 1e-4, 1e-5);
        }
    }

    #[test]
    fn tiles_cover_large_row_counts() {
        // Several tiles each, with stride and padding, so the gathered col2im
        // must stitch patches across tile boundaries: K = 7*7*64 makes
        // tile_rows 334 (800 rows, 3 tiles; stride 2: 200 rows, 1 tile);
        // K = 3*3*512 makes it 227 (stride 2 on 32x32: 512 rows, 3 tiles).
        for (cin, kk, stride, pad, hw) in [
            (64, 7, 1, 3, 20),
            (64, 7, 2, 3, 20),
            (512, 3, 2, 1, 32),
            (512, 3, 1, 1, 12),
        ] {
            let g = ConvGeom {
                n: 2,
                h: hw,
                w: hw,
                cin,
                cout: 3,
                kh: kk,
                kw: kk,
                stride,
                pad,
            };
            let mut r = rng(2);
            let x = rand_vec(&mut r, g.input_len());
            let w = rand_vec(&mut r, g.weight_len());
            let dy = rand_vec(&mut r, g.output_len());
            // dx accumulates: start from ones.
            let mut dx = vec![1.0; x.len()];
            let mut dw = vec![0.0; w.len()];
            let y = forward_backward(&g, &x, &w, &dy, &mut dx, &mut dw, GemmMath::F32, 0.0);
            assert_close(
                "tiled y",
                &y,
                &conv2d_ref(&to_f64(&x), &to_f64(&w), &g),
                1e-4,
                1e-5,
            );
            let (dx_ref, dw_ref) = conv2d_backward_ref(&to_f64(&dy), &to_f64(&x), &to_f64(&w), &g);
            let dx_ref: Vec<f64> = dx_ref.iter().map(|v| v + 1.0).collect();
            assert_close(&format!("tiled dx {g:?}"), &dx, &dx_ref, 1e-4, 1e-5);
            assert_close(&format!("tiled dw {g:?}"), &dw, &dw_ref, 1e-3, 1e-5);
        }
        let big = ConvGeom {
            n: 2,
            h: 32,
            w: 32,
            cin: 512,
            cout: 3,
            kh: 3,
            kw: 3,
            stride: 2,
            pad: 1,
        };
        assert!(big.rows() > 2 * big.tile_rows());
    }

    #[test]
    fn bf16_math_matches_the_reference_on_rounded_operands() {
        // bf16 mode passes bf16-representable activations; the weight is
        // rounded by the GEMM itself. Shapes: the 7x7 s2 stem on 3 channels
        // (odd K), a padded 3x3, a strided 1x1, a multi-tile 3x3, and a
        // 5x5 wider than its 2x2 input.
        let cases = [
            (3, 5, 1, 2, 2, 4),
            (3, 7, 2, 3, 16, 8),
            (16, 3, 1, 1, 9, 24),
            (12, 1, 2, 0, 9, 40),
            (512, 3, 2, 1, 32, 3),
        ];
        let round = |mut v: Vec<f32>| -> Vec<f32> {
            crate::device::cpu::round_to_bf16(&mut v);
            v
        };
        for (cin, kk, stride, pad, hw, cout) in cases {
            let g = ConvGeom {
                n: 2,
                h: hw,
                w: hw,
                cin,
                cout,
                kh: kk,
                kw: kk,
                stride,
                pad,
            };
            let mut r = rng(5);
            let x = round(rand_vec(&mut r, g.input_len()));
            let w = rand_vec(&mut r, g.weight_len());
            let dy = round(rand_vec(&mut r, g.output_len()));
            let w_rounded = round(w.clone());
            // The native kernel rounds the weight as it packs it; the f32
            // fallback (CPUs without AVX512-BF16) takes it pre-rounded, as
            // the layers pass it there (`Precision::gemm_rounds_operands`).
            let w_in = if GemmMath::Bf16.native_bf16() {
                &w
            } else {
                &w_rounded
            };
            let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; w.len()]);
            let y = forward_backward(
                &g,
                &x,
                w_in,
                &dy,
                &mut dx,
                &mut dw,
                GemmMath::Bf16,
                f32::NAN,
            );
            let y_ref = conv2d_ref(&to_f64(&x), &to_f64(&w_rounded), &g);
            // The output comes back rounded to bf16: exactly representable,
            // and within half a bf16 ulp (2^-9 relative) of the exact sum.
            assert_eq!(round(y.clone()), y, "bf16 y is not rounded");
            assert_close(&format!("bf16 y {g:?}"), &y, &y_ref, 1e-4, 2f64.powi(-8));
            let (dx_ref, dw_ref) =
                conv2d_backward_ref(&to_f64(&dy), &to_f64(&x), &to_f64(&w_rounded), &g);
            assert_eq!(round(dx.clone()), dx, "bf16 dx is not rounded");
            assert_close(&format!("bf16 dx {g:?}"), &dx, &dx_ref, 1e-4, 2f64.powi(-8));
            assert_close(&format!("bf16 dw {g:?}"), &dw, &dw_ref, 1e-3, 1e-5);
        }
    }

    #[test]
    fn bf16_patches_are_the_rounded_f32_patches() {
        // Channel counts below and at the converter's 16-lane block, odd
        // and even K, padding and stride.
        for (cin, kk, stride, pad) in [(3, 7, 2, 3), (5, 3, 1, 1), (16, 3, 2, 1), (32, 1, 2, 0)] {
            let g = ConvGeom {
                n: 2,
                h: 9,
                w: 7,
                cin,
                cout: 4,
                kh: kk,
                kw: kk,
                stride,
                pad,
            };
            let mut r = rng(6);
            let x = rand_vec(&mut r, g.input_len());
            let (k, rows) = (g.k(), g.rows());
            let mut col = vec![f32::NAN; rows * k];
            im2col_tile(&mut col, ConvInput::F32(&x), &g, 0, rows);
            let k2 = k.div_ceil(2);
            let mut want = vec![0u16; rows * 2 * k2];
            for (w, c) in want.chunks_exact_mut(2 * k2).zip(col.chunks_exact(k)) {
                f32_to_bf16(&mut w[..k], c);
            }
            // Two tiles, the second starting mid-image.
            let mut words = vec![u32::MAX; rows * k2];
            let split = rows / 2 + 1;
            let xf = ConvInput::F32(&x);
            im2col_tile_bf16(&mut words, xf, &g, 0, split);
            im2col_tile_bf16(&mut words[split * k2..], xf, &g, split, rows - split);
            let got: &[u16] = bytemuck::cast_slice(&words);
            assert_eq!(got, &want[..], "{g:?}");
        }
    }

    /// A bf16 input, read in place (by the native GEMM, or widened tile by
    /// tile for the f32 GEMM, whichever this CPU runs), gives the bits of
    /// its f32 copy; and a bf16 output holds the bits of the f32 kernel's
    /// rounded output. The pointwise weight gradient of a widened input
    /// sums its rows tile by tile, so there it is held to the f64
    /// reference instead (the multi-tile case: 2*64*64 rows of 320).
    #[test]
    fn bf16_input_gives_the_bits_of_its_f32_copy() {
        // Pointwise (plain, and with the weight gradient split: 2*48*49 rows),
        // strided 1x1, padded 3x3; even cin, ragged against the GEMM tiles;
        // last, pointwise over several widening tiles.
        let cases = [
            (2, 6, 5, 8, 6, 1, 1, 0),
            (2, 48, 49, 8, 5, 1, 1, 0),
            (3, 9, 7, 6, 10, 1, 2, 0),
            (2, 9, 8, 18, 7, 3, 2, 1),
            (2, 64, 64, 320, 6, 1, 1, 0),
        ];
        for (n, h, w, cin, cout, kk, stride, pad) in cases {
            let g = ConvGeom {
                n,
                h,
                w,
                cin,
                cout,
                kh: kk,
                kw: kk,
                stride,
                pad,
            };
            let mut r = rng(7);
            let mut x = rand_vec(&mut r, g.input_len());
            round_to_bf16(&mut x);
            let mut wt = rand_vec(&mut r, g.weight_len());
            // The f32 GEMM's bf16 arithmetic takes a rounded weight.
            round_to_bf16(&mut wt);
            let mut dy = rand_vec(&mut r, g.output_len());
            round_to_bf16(&mut dy);
            let mut halves = vec![0u16; x.len()];
            f32_to_bf16(&mut halves, &x);
            let words: Vec<u32> = bytemuck::cast_slice(&halves).to_vec();
            let run = |input: ConvInput<'_>| {
                let widens = input.widens(GemmMath::Bf16);
                let ws_len = g
                    .backward_workspace_len_for(widens)
                    .max(g.forward_workspace_len_for(widens) + g.output_tile_len());
                let mut ws = vec![f32::NAN; ws_len];
                let mut y = vec![0.0; g.output_len()];
                conv2d_forward(&mut y, input, &wt, &g, &mut ws, GemmMath::Bf16);
                let mut y_low = vec![half::bf16::ZERO; g.output_len()];
                ws.fill(f32::NAN);
                conv2d_forward_bf16_out(&mut y_low, input, &wt, &g, &mut ws, GemmMath::Bf16);
                let (mut dx, mut dw) = (vec![0.25; x.len()], vec![0.5; wt.len()]);
                ws.fill(f32::NAN);
                conv2d_backward(
                    Some(&mut dx),
                    &mut dw,
                    &dy,
                    input,
                    &wt,
                    &g,
                    &mut ws,
                    GemmMath::Bf16,
                );
                let low: Vec<f32> = y_low.iter().map(|v| v.to_f32()).collect();
                [y, low, dx, dw]
            };
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let want = run(ConvInput::F32(&x));
            let got = run(ConvInput::Bf16Words(&words));
            let tiled_wgrad = g.is_pointwise()
                && !GemmMath::Bf16.native_bf16()
                && g.tile_rows() < g.rows().div_ceil(if g.splits_wgrad() { 2 } else { 1 });
            for (name, (a, b)) in ["y", "y bf16", "dx"].iter().zip(got.iter().zip(&want)) {
                assert_eq!(bits(a), bits(b), "{name} {g:?}");
            }
            assert_eq!(
                bits(&want[1]),
                bits(&want[0]),
                "bf16 output = rounded f32 output {g:?}"
            );
            if tiled_wgrad {
                let (_, dw_ref) = conv2d_backward_ref(&to_f64(&dy), &to_f64(&x), &to_f64(&wt), &g);
                let dw_ref: Vec<f64> = dw_ref.iter().map(|v| v + 0.5).collect();
                assert_close("tiled dw", &got[3], &dw_ref, 1e-3, 1e-4);
            } else {
                assert_eq!(bits(&got[3]), bits(&want[3]), "dw {g:?}");
            }
        }
    }

    #[test]
    fn split_pointwise_weight_gradient_matches_reference() {
        // 2*48*49 = 4704 rows: an odd split (2352 + 2352) past the threshold.
        let g = ConvGeom {
            n: 2,
            h: 48,
            w: 49,
            cin: 8,
            cout: 5,
            kh: 1,
            kw: 1,
            stride: 1,
            pad: 0,
        };
        assert!(g.splits_wgrad());
        assert_eq!(g.backward_workspace_len(), g.weight_len());
        let mut r = rng(4);
        let x = rand_vec(&mut r, g.input_len());
        let w = rand_vec(&mut r, g.weight_len());
        let dy = rand_vec(&mut r, g.output_len());
        // Garbage in the workspace must not leak into the result.
        let mut ws = vec![f32::NAN; g.backward_workspace_len()];
        let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.5; w.len()]);
        conv2d_backward(
            Some(&mut dx),
            &mut dw,
            &dy,
            ConvInput::F32(&x),
            &w,
            &g,
            &mut ws,
            GemmMath::F32,
        );
        let (dx_ref, dw_ref) = conv2d_backward_ref(&to_f64(&dy), &to_f64(&x), &to_f64(&w), &g);
        let dw_ref: Vec<f64> = dw_ref.iter().map(|v| v + 0.5).collect();
        assert_close("split dw", &dw, &dw_ref, 1e-3, 1e-5);
        assert_close("split dx", &dx, &dx_ref, 1e-4, 1e-5);
    }

    #[test]
    fn reference_backward_matches_finite_differences() {
        let mut r = rng(3);
        for c in &CASES[..3] {
            let g = geom(c);
            let x = to_f64(&rand_vec(&mut r, g.input_len()));
            let w = to_f64(&rand_vec(&mut r, g.weight_len()));
            let dy = to_f64(&rand_vec(&mut r, g.output_len()));
            let (dx, dw) = conv2d_backward_ref(&dy, &x, &w, &g);
            let fd_x = finite_diff(&x, 1e-6, |xp| dot(&conv2d_ref(xp, &w, &g), &dy));
            let fd_w = finite_diff(&w, 1e-6, |wp| dot(&conv2d_ref(&x, wp, &g), &dy));
            assert_close64("fd dx", &dx, &fd_x, 1e-7, 1e-6);
            assert_close64("fd dw", &dw, &fd_w, 1e-7, 1e-6);
        }
    }

    #[test]
    fn weight_layout_round_trips() {
        let oihw: Vec<f32> = (0..4 * 3 * 2 * 5).map(|i| i as f32).collect();
        let hwio = oihw_to_hwio(&oihw, 4, 3, 2, 5);
        assert_ne!(hwio, oihw);
        // Spot check: o=1, i=2, kh=1, kw=3.
        assert_eq!(
            hwio[((5 + 3) * 3 + 2) * 4 + 1],
            oihw[((3 + 2) * 2 + 1) * 5 + 3]
        );
        assert_eq!(hwio_to_oihw(&hwio, 4, 3, 2, 5), oihw);
    }

    #[test]
    fn too_small_input_is_an_error() {
        let g = ConvGeom {
            n: 1,
            h: 2,
            w: 2,
            cin: 1,
            cout: 1,
            kh: 7,
            kw: 7,
            stride: 2,
            pad: 1,
        };
        assert!(
            g.validate()
                .unwrap_err()
                .to_string()
                .contains("smaller than the 7x7 kernel")
        );
    }
}
