//! The regions of one cuDNN convolution's workspace and the tiles of
//! images it is run in: the pure arithmetic the planner (through
//! `ops::conv2d_workspace`) and the call (`ops::conv2d_forward`,
//! `ops::conv2d_backward`) share, so the call uses exactly what the plan
//! counted. No cuDNN call here (tests/cuda_plan.rs checks it anywhere).
//!
//! From the workspace's address rounded up to [`WS_ALIGN`] (the slack is
//! counted: a pool block is only 64-byte aligned), each region a multiple
//! of [`WS_ALIGN`]:
//!
//! | region | when | holds |
//! |---|---|---|
//! | w | always | the weight in cuDNN's OHWI layout, in the convolution's type |
//! | dw | backward | the OHWI weight gradient cuDNN writes, added into the HWIO `dw` |
//! | x | bf16, f32 input | one tile of the input narrowed to bf16 (exact: the layers round it) |
//! | y | bf16: forward with an f32 output, or backward | one tile of the output (widened after) or of `dy` (narrowed before) |
//! | dx | bf16 backward | one tile of the input gradient, added into the f32 `dx` |
//! | cuDNN | always | cuDNN's own, for the tile's geometry |
//!
//! An f32 convolution stages nothing and runs in one call (tile = the
//! batch). A bf16 one runs cuDNN in bf16 with f32 accumulation (tensor
//! cores) on bf16 activations read in place; the f32 operands it meets
//! (the stem's image, the f32 gradients of a stage's backward) go through
//! the staging regions one tile of images at a time, so no f32 copy or
//! bf16 copy of a whole activation is made and the workspace stays within
//! [`BF16_STAGE_BYTES`] of staging whatever the batch.

use super::dnn::WS_ALIGN;
use crate::backend::ConvPass;
use crate::ops::conv2d::ConvGeom;
use crate::tensor::DType;

/// The most bytes the staging regions of a bf16 convolution hold together
/// (one tile of images; at least one image). 32 MiB: at ResNet-50 224²
/// sizes a tile is 16 images or more (a GEMM of 50 000 rows and up), and
/// the transient it adds to a step's peak is under 1% of a 4 GiB budget.
pub const BF16_STAGE_BYTES: usize = 32 << 20;

/// The staging bound in force: [`BF16_STAGE_BYTES`], or the bytes
/// `MEMFIT_CUDA_STAGE_BYTES` names (read once per process: tests set it so
/// that small convolutions run in several tiles; a value that is not a
/// positive number is ignored).
pub fn stage_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        std::env::var("MEMFIT_CUDA_STAGE_BYTES")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&b| b > 0)
            .unwrap_or(BF16_STAGE_BYTES)
    })
}

fn aligned(bytes: usize) -> usize {
    bytes.next_multiple_of(WS_ALIGN)
}

/// One convolution's workspace: its type, tile and region offsets (bytes
/// from the aligned base).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvWs {
    /// The type cuDNN runs in: F32, or BF16 (in and out, f32 accumulation).
    pub dtype: DType,
    /// Images per cuDNN call (the batch when nothing is staged).
    pub tile: usize,
    pub w: usize,
    pub dw: Option<usize>,
    pub x: Option<usize>,
    pub y: Option<usize>,
    pub dx: Option<usize>,
    /// Where cuDNN's own region starts.
    pub cudnn: usize,
}

impl ConvWs {
    /// The layout for `pass` of `g` run in `dtype`, with an input stored
    /// as `input` and, for the forward, an output stored as `output`. A
    /// bf16 backward always counts `dy` and `dx` staging: the gradients of
    /// a stage's backward are f32 (a bf16 `dy` is then read in place and
    /// its region goes unused).
    pub fn new(g: &ConvGeom, pass: ConvPass, dtype: DType, input: DType, output: DType) -> Self {
        let elem = dtype.unit_bytes();
        let weight = aligned(g.kh * g.kw * g.cin * g.cout * elem);
        let low = dtype == DType::BF16;
        let in_image = g.h * g.w * g.cin * elem;
        let out_image = g.oh() * g.ow() * g.cout * elem;
        let stage_x = low && input != DType::BF16;
        let (stage_y, stage_dx) = match pass {
            ConvPass::Forward => (low && output != DType::BF16, false),
            ConvPass::Backward => (low, low),
        };
        let per_image = usize::from(stage_x) * in_image
            + usize::from(stage_y) * out_image
            + usize::from(stage_dx) * in_image;
        let tile = stage_bytes()
            .checked_div(per_image)
            .map_or(g.n, |t| t.clamp(1, g.n.max(1)));
        let mut at = weight;
        let mut region = |on: bool, bytes: usize| {
            on.then(|| {
                let start = at;
                at += aligned(bytes);
                start
            })
        };
        let dw = region(pass == ConvPass::Backward, weight);
        let x = region(stage_x, tile * in_image);
        let y = region(stage_y, tile * out_image);
        let dx = region(stage_dx, tile * in_image);
        ConvWs {
            dtype,
            tile,
            w: 0,
            dw,
            x,
            y,
            dx,
            cudnn: at,
        }
    }

    /// Bytes of the whole workspace with `cudnn` bytes for cuDNN: the
    /// alignment slack, the regions, cuDNN's.
    pub fn bytes(&self, cudnn: usize) -> usize {
        WS_ALIGN + self.cudnn + cudnn
    }

    /// The tiles of a batch of `n` images: (first image, images).
    pub fn tiles(&self, n: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let step = self.tile.max(1);
        (0..n).step_by(step).map(move |s| (s, step.min(n - s)))
    }

    /// The geometries cuDNN is called with for `g`: the full tile and, when
    /// the batch does not divide, the last one (cuDNN's workspace is the
    /// larger of their answers).
    pub fn geometries(&self, g: &ConvGeom) -> Vec<ConvGeom> {
        let mut out = vec![ConvGeom {
            n: self.tile.min(g.n),
            ..*g
        }];
        let rest = g.n % self.tile.max(1);
        if rest != 0 && self.tile < g.n {
            out.push(ConvGeom { n: rest, ..*g });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(n: usize, h: usize, cin: usize, cout: usize) -> ConvGeom {
        ConvGeom {
            n,
            h,
            w: h,
            cin,
            cout,
            kh: 3,
            kw: 3,
            stride: 1,
            pad: 1,
        }
    }

    #[test]
    fn an_f32_convolution_stages_nothing_and_keeps_the_old_layout() {
        let geom = g(8, 14, 16, 32);
        let weight = aligned(9 * 16 * 32 * 4);
        let f = ConvWs::new(&geom, ConvPass::Forward, DType::F32, DType::F32, DType::F32);
        assert_eq!((f.tile, f.x, f.y, f.dx, f.dw), (8, None, None, None, None));
        assert_eq!(f.cudnn, weight);
        let b = ConvWs::new(
            &geom,
            ConvPass::Backward,
            DType::F32,
            DType::F32,
            DType::F32,
        );
        assert_eq!((b.dw, b.cudnn, b.tile), (Some(weight), 2 * weight, 8));
        assert_eq!(b.tiles(8).collect::<Vec<_>>(), vec![(0, 8)]);
    }

    #[test]
    fn a_bf16_backward_stages_dy_and_dx_in_tiles_within_the_bound() {
        // 56x56x256 -> 56x56x256 at batch 105: dy and dx are 1.6 MB per
        // image in bf16, so a tile holds 10 images, and the last 5.
        let geom = g(105, 56, 256, 256);
        let b = ConvWs::new(
            &geom,
            ConvPass::Backward,
            DType::BF16,
            DType::BF16,
            DType::F32,
        );
        let image = 56 * 56 * 256 * 2;
        assert_eq!(b.tile, stage_bytes() / (2 * image));
        assert_eq!(b.x, None, "a bf16 input is read in place");
        let (y, dx) = (b.y.unwrap(), b.dx.unwrap());
        assert!(dx - y >= b.tile * image && b.cudnn - dx >= b.tile * image);
        assert!((b.cudnn - y) <= stage_bytes() + 2 * WS_ALIGN);
        let tiles: Vec<_> = b.tiles(105).collect();
        assert_eq!(tiles.iter().map(|t| t.1).sum::<usize>(), 105);
        assert_eq!(tiles.len(), 11);
        assert!(tiles.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
        let geoms = b.geometries(&geom);
        assert_eq!(geoms[0].n, b.tile);
        assert_eq!(geoms.len(), 2);
        assert_eq!(geoms[1].n, 5);
        // A bf16 forward of bf16 in and out stages nothing: one call.
        let f = ConvWs::new(
            &geom,
            ConvPass::Forward,
            DType::BF16,
            DType::BF16,
            DType::BF16,
        );
        assert_eq!((f.tile, f.x, f.y), (105, None, None));
        assert_eq!(f.cudnn, aligned(9 * 256 * 256 * 2));
    }

    #[test]
    fn an_image_larger_than_the_bound_still_makes_a_tile_of_one() {
        let geom = g(3, 2048, 64, 64);
        let f = ConvWs::new(
            &geom,
            ConvPass::Forward,
            DType::BF16,
            DType::F32,
            DType::BF16,
        );
        assert_eq!(f.tile, 1);
        assert_eq!(f.tiles(3).count(), 3);
        assert_eq!(f.geometries(&geom).len(), 1);
    }
}
