//! The stem, in two kinds: torchvision's ImageNet stem (conv 7×7 stride 2 →
//! BN → ReLU → max ctx 3×3 stride 2, a quarter of the input side) and the
//! small-image (CIFAR-style) stem (conv 3×3 stride 1 → BN → ReLU, full
//! resolution), which keeps 28×28 or 32×32 inputs large enough for layer4.
//! Both name their parameters `conv1` and `bn1`, as torchvision does.

use rand::rngs::ChaCha8Rng;

use crate::backend;
use crate::error::{Error, Result};
use crate::memory::{Category, Pool, Tag};
use crate::nn::precision::{bf16_or_f32_view, f32_view, store};
use crate::nn::{BatchNorm, BnStats, Conv, Ctx, Mode, Precision};
use crate::ops::maxpool::PoolGeom;
use crate::tensor::{DType, Tensor};

/// Which stem the network starts with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum StemKind {
    /// torchvision: conv 7×7 stride 2 pad 3 → BN → ReLU → max ctx 3×3
    /// stride 2 pad 1.
    #[default]
    ImageNet,
    /// Small images (CIFAR-style, as timm and kuangliu/pytorch-cifar use):
    /// conv 3×3 stride 1 pad 1 → BN → ReLU, no max ctx.
    Small,
}

impl StemKind {
    /// `imagenet` or `small`.
    pub fn by_name(name: &str) -> Result<Self> {
        match name {
            "imagenet" => Ok(StemKind::ImageNet),
            "small" => Ok(StemKind::Small),
            _ => Err(Error::invalid(
                "stem",
                format!("unknown stem '{name}' (choose imagenet or small)"),
            )),
        }
    }

    /// (kernel, stride, pad) of conv1.
    pub fn conv_geometry(self) -> (usize, usize, usize) {
        match self {
            StemKind::ImageNet => (7, 2, 3),
            StemKind::Small => (3, 1, 1),
        }
    }

    /// Whether the 3×3 stride 2 max ctx follows the ReLU.
    pub fn has_maxpool(self) -> bool {
        self == StemKind::ImageNet
    }
}

pub struct Stem {
    pub kind: StemKind,
    pub conv1: Conv,
    pub bn1: BatchNorm,
    /// Recompute relu(bn1(y)) (the max ctx's input) in backward instead of
    /// keeping it.
    pub recompute_bn_relu: bool,
}

/// What follows conv1 and BN in the saved state, by stem kind.
enum StemTail {
    /// (n, h', w', c) ReLU output: BN's ReLU mask and the max ctx's input
    /// (None: recomputed in backward).
    Pool { a: Option<Tensor> },
    /// (n, h', w', c) bits: ReLU passed. The ReLU output itself is the stage
    /// output, which the next stage keeps.
    Mask { mask: Tensor },
}

/// What `Stem::backward` needs.
pub struct StemSaved {
    x: Tensor,   // (n, h, w, 3)        the images; conv1's weight gradient
    y: Tensor,   // (n, h', w', c)      conv1 output, BN input
    bn: BnStats, // (c)
    tail: StemTail,
}

impl StemSaved {
    /// The images, for a checkpoint; the rest is freed.
    pub fn into_input(self) -> Tensor {
        self.x
    }

    pub fn bytes(&self) -> usize {
        let tail = match &self.tail {
            StemTail::Pool { a } => a.as_ref().map_or(0, |a| a.bytes()),
            StemTail::Mask { mask } => mask.bytes(),
        };
        self.x.bytes() + self.y.bytes() + self.bn.bytes() + tail
    }
}

impl Stem {
    pub fn new(pool: &Pool, rng: &mut ChaCha8Rng, width: usize, kind: StemKind) -> Result<Self> {
        let (k, stride, pad) = kind.conv_geometry();
        Ok(Stem {
            kind,
            conv1: Conv::new(pool, rng, "conv1", 3, width, k, stride, pad)?,
            bn1: BatchNorm::new(pool, "bn1", width, false)?,
            recompute_bn_relu: false,
        })
    }

    fn pool_geom(n: usize, h: usize, w: usize, c: usize) -> PoolGeom {
        PoolGeom {
            n,
            h,
            w,
            c,
            k: 3,
            stride: 2,
            pad: 1,
        }
    }

    /// (h, w, c) of the output for an (h, w) input.
    pub fn out_hwc(&self, h: usize, w: usize) -> (usize, usize, usize) {
        let g = self.conv1.geom(1, h, w);
        if !self.kind.has_maxpool() {
            return (g.oh(), g.ow(), self.conv1.cout);
        }
        let p = Self::pool_geom(1, g.oh(), g.ow(), self.conv1.cout);
        (p.oh(), p.ow(), self.conv1.cout)
    }

    /// `x`: the images, f32 (rounded here under mixed precision) or, when
    /// a checkpoint replays the stem, as the stem stored them.
    pub fn forward(
        &mut self,
        ctx: &Ctx<'_>,
        mut x: Tensor,
        mode: Mode,
    ) -> Result<(Tensor, Option<StemSaved>)> {
        let p = ctx.precision;
        let sp = if mode.saves() { p } else { Precision::F32 };
        if x.dtype() == DType::F32 {
            backend::round(&mut x, p)?;
        }
        let xv = f32_view(ctx, &x)?;
        let y = self.conv1.forward(ctx, &xv, "y")?;
        drop(xv);
        if self.kind == StemKind::Small {
            let (mut a, bn) = self.bn1.forward(ctx, &y, false, mode, "a")?;
            let mut mask = ctx.empty(
                &[a.numel()],
                DType::Bits,
                Category::Activations,
                Tag::fixed("bn1.relu_mask"),
            )?;
            backend::relu_mask_forward(&mut a, &mut mask)?;
            let a = store(ctx, a, p)?;
            let saved = if mode.saves() {
                Some(StemSaved {
                    x: store(ctx, x, sp)?,
                    y: store(ctx, y, sp)?,
                    bn,
                    tail: StemTail::Mask { mask },
                })
            } else {
                None
            };
            return Ok((a, saved));
        }
        let (a, bn) = self.bn1.forward(ctx, &y, true, mode, "a")?;
        let y = store(ctx, y, sp)?;
        let (n, h, w, c) = a.shape().nhwc();
        let g = Self::pool_geom(n, h, w, c);
        g.validate()?;
        let mut out = ctx.empty_f32(
            &[n, g.oh(), g.ow(), c],
            Category::Activations,
            Tag::fixed("maxpool.out"),
        )?;
        // The max of rounded values needs no rounding.
        backend::maxpool_forward(&mut out, &a, &g)?;
        let out = store(ctx, out, p)?;
        let saved = if mode.saves() {
            let a = if self.recompute_bn_relu {
                None
            } else {
                Some(store(ctx, a, sp)?)
            };
            Some(StemSaved {
                x: store(ctx, x, sp)?,
                y,
                bn,
                tail: StemTail::Pool { a },
            })
        } else {
            None
        };
        Ok((out, saved))
    }

    /// The images need no gradient, so this returns nothing.
    pub fn backward(&mut self, ctx: &Ctx<'_>, saved: StemSaved, mut d_out: Tensor) -> Result<()> {
        let StemSaved { x, y, bn, tail } = saved;
        let yv = bf16_or_f32_view(ctx, &y)?;
        let d_y = match tail {
            StemTail::Mask { mask } => {
                backend::relu_mask_backward_inplace(&mut d_out, &mask)?;
                drop(mask);
                let d_y = self.bn1.backward(ctx, &d_out, &yv, &bn, None)?;
                drop(d_out);
                d_y
            }
            StemTail::Pool { a } => {
                let av = match &a {
                    // Max-pool backward reads bf16 only where the device
                    // reads bf16 (the CPU); a GPU's kernel reads f32.
                    Some(a) if ctx.precision.bf16_in_place(a.device().capabilities()) => {
                        bf16_or_f32_view(ctx, a)?
                    }
                    Some(a) => f32_view(ctx, a)?,
                    // In the form the forward kept it (bf16 where read).
                    None => crate::nn::precision::View::Owned(self.bn1.apply_relu_for_conv(
                        ctx,
                        &yv,
                        &bn,
                        Tag::fixed("bn1.a_recomputed"),
                    )?),
                };
                let (n, h, w, c) = av.shape().nhwc();
                let mut d_a =
                    ctx.empty_f32(av.dims(), Category::Activations, Tag::fixed("maxpool.dx"))?;
                backend::maxpool_backward(
                    &mut d_a,
                    &d_out,
                    &av,
                    &Self::pool_geom(n, h, w, c),
                    ctx.precision,
                )?;
                drop(d_out);
                let d_y = self.bn1.backward(ctx, &d_a, &yv, &bn, Some(&av))?;
                drop((d_a, av));
                drop(a);
                d_y
            }
        };
        drop(yv);
        drop(y);
        let xv = f32_view(ctx, &x)?;
        self.conv1.backward(ctx, &d_y, &xv, None)
    }

    /// Closed form of `StemSaved::bytes` for a batch of n (h, w) images.
    pub fn saved_bytes(&self, n: usize, h: usize, w: usize, p: Precision) -> usize {
        let e = p.bytes();
        let g = self.conv1.geom(n, h, w);
        let tail = match self.kind {
            StemKind::ImageNet if self.recompute_bn_relu => 0,
            StemKind::ImageNet => e * g.output_len(),
            StemKind::Small => g.output_len().div_ceil(8),
        };
        e * (g.input_len() + g.output_len()) + tail + self.bn1.stats_bytes()
    }
}
