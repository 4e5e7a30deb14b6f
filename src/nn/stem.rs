//! The ImageNet stem: conv 7×7 stride 2 → BN → ReLU → max pool 3×3 stride 2.

use rand::rngs::ChaCha8Rng;

use crate::error::Result;
use crate::memory::{Category, Pool, Tag};
use crate::nn::{BatchNorm, BnStats, Conv, Mode};
use crate::ops::maxpool::{self, PoolGeom};
use crate::tensor::Tensor;

pub struct Stem {
    pub conv1: Conv,
    pub bn1: BatchNorm,
}

/// What `Stem::backward` needs.
pub struct StemSaved {
    x: Tensor,   // (n, h, w, 3)        the images; conv1's weight gradient
    y: Tensor,   // (n, h/2, w/2, c)    conv1 output, BN input
    bn: BnStats, // (c)
    a: Tensor,   // (n, h/2, w/2, c)    ReLU output: BN mask and pool input
}

impl StemSaved {
    /// The images, for a checkpoint; the rest is freed.
    pub fn into_input(self) -> Tensor {
        self.x
    }

    pub fn bytes(&self) -> usize {
        self.x.bytes() + self.y.bytes() + self.bn.bytes() + self.a.bytes()
    }
}

impl Stem {
    pub fn new(pool: &Pool, rng: &mut ChaCha8Rng, width: usize) -> Result<Self> {
        Ok(Stem {
            conv1: Conv::new(pool, rng, "conv1", 3, width, 7, 2, 3)?,
            bn1: BatchNorm::new(pool, "bn1", width, false)?,
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
        let p = Self::pool_geom(1, g.oh(), g.ow(), self.conv1.cout);
        (p.oh(), p.ow(), self.conv1.cout)
    }

    pub fn forward(
        &mut self,
        pool: &Pool,
        x: Tensor,
        mode: Mode,
    ) -> Result<(Tensor, Option<StemSaved>)> {
        let y = self.conv1.forward(pool, &x, "y")?;
        let (a, bn) = self.bn1.forward(pool, &y, true, mode, "a")?;
        let (n, h, w, c) = a.shape().nhwc();
        let g = Self::pool_geom(n, h, w, c);
        g.validate()?;
        let mut out = pool.empty_f32(
            &[n, g.oh(), g.ow(), c],
            Category::Activations,
            Tag::fixed("maxpool.out"),
        )?;
        if pool.computes() {
            maxpool::maxpool_forward(out.f32_mut(), a.f32(), &g);
        }
        let saved = mode.saves().then_some(StemSaved { x, y, bn, a });
        Ok((out, saved))
    }

    /// The images need no gradient, so this returns nothing.
    pub fn backward(&mut self, pool: &Pool, saved: StemSaved, d_out: Tensor) -> Result<()> {
        let StemSaved { x, y, bn, a } = saved;
        let (n, h, w, c) = a.shape().nhwc();
        let mut d_a = pool.empty_f32(a.dims(), Category::Activations, Tag::fixed("maxpool.dx"))?;
        if pool.computes() {
            maxpool::maxpool_backward(
                d_a.f32_mut(),
                d_out.f32(),
                a.f32(),
                &Self::pool_geom(n, h, w, c),
            );
        }
        drop(d_out);
        let d_y = self.bn1.backward(pool, &d_a, &y, &bn, Some(&a))?;
        drop((d_a, a));
        self.conv1.backward(pool, &d_y, &x, None)
    }

    /// Closed form of `StemSaved::bytes` for a batch of n (h, w) images.
    pub fn saved_bytes(&self, n: usize, h: usize, w: usize) -> usize {
        let g = self.conv1.geom(n, h, w);
        4 * (g.input_len() + 2 * g.output_len()) + self.bn1.stats_bytes()
    }
}
