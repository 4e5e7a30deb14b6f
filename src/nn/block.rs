//! Residual blocks in the torchvision v1.5 layout: the stride sits on the
//! 3×3 convolution, and a 1×1 conv + BN downsample joins the residual when
//! the shape changes.

use std::sync::Arc;

use rand::rngs::ChaCha8Rng;

use crate::error::Result;
use crate::memory::{Category, Pool, Tag};
use crate::nn::{BatchNorm, BnStats, Conv, Mode};
use crate::ops::{add, relu};
use crate::tensor::{DType, Tensor};

/// The 1×1 conv + BN on the residual path of a shape-changing block.
pub struct Downsample {
    pub conv: Conv,
    pub bn: BatchNorm,
}

struct DownsampleSaved {
    y: Tensor, // conv output, BN input
    bn: BnStats,
}

impl Downsample {
    fn new(
        pool: &Pool,
        rng: &mut ChaCha8Rng,
        name: &str,
        cin: usize,
        cout: usize,
        stride: usize,
    ) -> Result<Self> {
        Ok(Downsample {
            conv: Conv::new(
                pool,
                rng,
                &format!("{name}.downsample.0"),
                cin,
                cout,
                1,
                stride,
                0,
            )?,
            bn: BatchNorm::new(pool, &format!("{name}.downsample.1"), cout, false)?,
        })
    }

    fn forward(
        &mut self,
        pool: &Pool,
        x: &Tensor,
        mode: Mode,
    ) -> Result<(Tensor, DownsampleSaved)> {
        let y = self.conv.forward(pool, x, "y")?;
        let (out, bn) = self.bn.forward(pool, &y, false, mode, "out")?;
        Ok((out, DownsampleSaved { y, bn }))
    }

    fn backward(
        &mut self,
        pool: &Pool,
        s: DownsampleSaved,
        d_out: &Tensor,
        x: &Tensor,
        dx: &mut Tensor,
    ) -> Result<()> {
        let d_y = self.bn.backward(pool, d_out, &s.y, &s.bn, None)?;
        drop(s);
        self.conv.backward(pool, &d_y, x, Some(dx))
    }
}

/// Adds the block output `z` to its residual and applies the final ReLU in
/// place, returning the mask (one bit per element) the backward needs.
fn join_residual(
    pool: &Pool,
    name: &Arc<str>,
    z: &mut Tensor,
    residual: &Tensor,
) -> Result<Tensor> {
    let mut mask = pool.empty(
        &[z.numel()],
        DType::Bits,
        Category::Activations,
        Tag::new(name, "relu_mask"),
    )?;
    if pool.computes() {
        relu::add_relu_forward(z.f32_mut(), residual.f32(), mask.bits_mut());
    }
    Ok(mask)
}

/// Two 3×3 convolutions (ResNet-18/34).
pub struct BasicBlock {
    pub name: Arc<str>,
    pub conv1: Conv,
    pub bn1: BatchNorm,
    pub conv2: Conv,
    pub bn2: BatchNorm,
    pub downsample: Option<Downsample>,
}

/// What `BasicBlock::backward` needs.
pub struct BasicSaved {
    x: Tensor,  // (n, h, w, cin)      block input and residual
    y1: Tensor, // (n, h', w', c)      conv1 out
    bn1: BnStats,
    a1: Tensor, // (n, h', w', c)      relu(bn1(y1)), conv2 input
    y2: Tensor, // (n, h', w', c)      conv2 out
    bn2: BnStats,
    down: Option<DownsampleSaved>,
    mask: Tensor, // (n, h', w', c) bits: final ReLU passed
}

impl BasicSaved {
    /// The block input, for a checkpoint; the rest is freed.
    pub fn into_input(self) -> Tensor {
        self.x
    }

    pub fn bytes(&self) -> usize {
        [&self.x, &self.y1, &self.a1, &self.y2, &self.mask]
            .iter()
            .map(|t| t.bytes())
            .sum::<usize>()
            + self.bn1.bytes()
            + self.bn2.bytes()
            + self.down.as_ref().map_or(0, |d| d.y.bytes() + d.bn.bytes())
    }
}

impl BasicBlock {
    pub const EXPANSION: usize = 1;

    pub fn new(
        pool: &Pool,
        rng: &mut ChaCha8Rng,
        name: &str,
        cin: usize,
        planes: usize,
        stride: usize,
        zero_init_last_bn: bool,
    ) -> Result<Self> {
        let downsample = if stride != 1 || cin != planes {
            Some(Downsample::new(pool, rng, name, cin, planes, stride)?)
        } else {
            None
        };
        Ok(BasicBlock {
            name: name.into(),
            conv1: Conv::new(
                pool,
                rng,
                &format!("{name}.conv1"),
                cin,
                planes,
                3,
                stride,
                1,
            )?,
            bn1: BatchNorm::new(pool, &format!("{name}.bn1"), planes, false)?,
            conv2: Conv::new(pool, rng, &format!("{name}.conv2"), planes, planes, 3, 1, 1)?,
            bn2: BatchNorm::new(pool, &format!("{name}.bn2"), planes, zero_init_last_bn)?,
            downsample,
        })
    }

    pub fn out_hwc(&self, h: usize, w: usize) -> (usize, usize, usize) {
        let g = self.conv1.geom(1, h, w);
        (g.oh(), g.ow(), self.conv2.cout)
    }

    pub fn forward(
        &mut self,
        pool: &Pool,
        x: Tensor,
        mode: Mode,
    ) -> Result<(Tensor, Option<BasicSaved>)> {
        let y1 = self.conv1.forward(pool, &x, "y")?;
        let (a1, bn1) = self.bn1.forward(pool, &y1, true, mode, "a")?;
        let y2 = self.conv2.forward(pool, &a1, "y")?;
        let (mut z, bn2) = self.bn2.forward(pool, &y2, false, mode, "out")?;
        let (mask, down) = match self.downsample.as_mut() {
            Some(ds) => {
                let (identity, saved) = ds.forward(pool, &x, mode)?;
                (
                    join_residual(pool, &self.name, &mut z, &identity)?,
                    Some(saved),
                )
            }
            None => (join_residual(pool, &self.name, &mut z, &x)?, None),
        };
        let saved = mode.saves().then_some(BasicSaved {
            x,
            y1,
            bn1,
            a1,
            y2,
            bn2,
            down,
            mask,
        });
        Ok((z, saved))
    }

    pub fn backward(&mut self, pool: &Pool, s: BasicSaved, mut d_out: Tensor) -> Result<Tensor> {
        if pool.computes() {
            relu::relu_mask_backward_inplace(d_out.f32_mut(), s.mask.bits());
        }
        let d_z = d_out;
        let d_y2 = self.bn2.backward(pool, &d_z, &s.y2, &s.bn2, None)?;
        drop((s.y2, s.bn2));
        let mut d_a1 = Conv::zeros_like(pool, &s.a1, Tag::new(&self.name, "d_a1"))?;
        self.conv2.backward(pool, &d_y2, &s.a1, Some(&mut d_a1))?;
        drop(d_y2);
        let d_y1 = self.bn1.backward(pool, &d_a1, &s.y1, &s.bn1, Some(&s.a1))?;
        drop((d_a1, s.a1, s.y1, s.bn1));
        let mut d_x = Conv::zeros_like(pool, &s.x, Tag::new(&self.name, "dx"))?;
        self.conv1.backward(pool, &d_y1, &s.x, Some(&mut d_x))?;
        drop(d_y1);
        match (self.downsample.as_mut(), s.down) {
            (Some(ds), Some(saved)) => ds.backward(pool, saved, &d_z, &s.x, &mut d_x)?,
            _ if pool.computes() => add::add_assign(d_x.f32_mut(), d_z.f32()),
            _ => {}
        }
        Ok(d_x)
    }

    pub fn saved_bytes(&self, n: usize, h: usize, w: usize) -> usize {
        let g1 = self.conv1.geom(n, h, w);
        let out = g1.output_len(); // every inner tensor has the output's size
        let mut b = 4 * (g1.input_len() + 3 * out) + out.div_ceil(8);
        b += self.bn1.stats_bytes() + self.bn2.stats_bytes();
        if let Some(ds) = &self.downsample {
            b += 4 * out + ds.bn.stats_bytes();
        }
        b
    }
}

/// 1×1 reduce, 3×3, 1×1 expand (ResNet-50/101/152).
pub struct Bottleneck {
    pub name: Arc<str>,
    pub conv1: Conv,
    pub bn1: BatchNorm,
    pub conv2: Conv,
    pub bn2: BatchNorm,
    pub conv3: Conv,
    pub bn3: BatchNorm,
    pub downsample: Option<Downsample>,
}

/// What `Bottleneck::backward` needs.
pub struct BottleneckSaved {
    x: Tensor,  // (n, h, w, cin)       block input and residual
    y1: Tensor, // (n, h, w, m)         conv1 out
    bn1: BnStats,
    a1: Tensor, // (n, h, w, m)         conv2 input
    y2: Tensor, // (n, h', w', m)       conv2 out (stride here)
    bn2: BnStats,
    a2: Tensor, // (n, h', w', m)       conv3 input
    y3: Tensor, // (n, h', w', 4m)      conv3 out
    bn3: BnStats,
    down: Option<DownsampleSaved>,
    mask: Tensor, // (n, h', w', 4m) bits: final ReLU passed
}

impl BottleneckSaved {
    /// The block input, for a checkpoint; the rest is freed.
    pub fn into_input(self) -> Tensor {
        self.x
    }

    pub fn bytes(&self) -> usize {
        [
            &self.x, &self.y1, &self.a1, &self.y2, &self.a2, &self.y3, &self.mask,
        ]
        .iter()
        .map(|t| t.bytes())
        .sum::<usize>()
            + self.bn1.bytes()
            + self.bn2.bytes()
            + self.bn3.bytes()
            + self.down.as_ref().map_or(0, |d| d.y.bytes() + d.bn.bytes())
    }
}

impl Bottleneck {
    pub const EXPANSION: usize = 4;

    pub fn new(
        pool: &Pool,
        rng: &mut ChaCha8Rng,
        name: &str,
        cin: usize,
        planes: usize,
        stride: usize,
        zero_init_last_bn: bool,
    ) -> Result<Self> {
        let cout = planes * Self::EXPANSION;
        let downsample = if stride != 1 || cin != cout {
            Some(Downsample::new(pool, rng, name, cin, cout, stride)?)
        } else {
            None
        };
        Ok(Bottleneck {
            name: name.into(),
            conv1: Conv::new(pool, rng, &format!("{name}.conv1"), cin, planes, 1, 1, 0)?,
            bn1: BatchNorm::new(pool, &format!("{name}.bn1"), planes, false)?,
            conv2: Conv::new(
                pool,
                rng,
                &format!("{name}.conv2"),
                planes,
                planes,
                3,
                stride,
                1,
            )?,
            bn2: BatchNorm::new(pool, &format!("{name}.bn2"), planes, false)?,
            conv3: Conv::new(pool, rng, &format!("{name}.conv3"), planes, cout, 1, 1, 0)?,
            bn3: BatchNorm::new(pool, &format!("{name}.bn3"), cout, zero_init_last_bn)?,
            downsample,
        })
    }

    pub fn out_hwc(&self, h: usize, w: usize) -> (usize, usize, usize) {
        let g = self.conv2.geom(1, h, w);
        (g.oh(), g.ow(), self.conv3.cout)
    }

    pub fn forward(
        &mut self,
        pool: &Pool,
        x: Tensor,
        mode: Mode,
    ) -> Result<(Tensor, Option<BottleneckSaved>)> {
        let y1 = self.conv1.forward(pool, &x, "y")?;
        let (a1, bn1) = self.bn1.forward(pool, &y1, true, mode, "a")?;
        let y2 = self.conv2.forward(pool, &a1, "y")?;
        let (a2, bn2) = self.bn2.forward(pool, &y2, true, mode, "a")?;
        let y3 = self.conv3.forward(pool, &a2, "y")?;
        let (mut z, bn3) = self.bn3.forward(pool, &y3, false, mode, "out")?;
        let (mask, down) = match self.downsample.as_mut() {
            Some(ds) => {
                let (identity, saved) = ds.forward(pool, &x, mode)?;
                (
                    join_residual(pool, &self.name, &mut z, &identity)?,
                    Some(saved),
                )
            }
            None => (join_residual(pool, &self.name, &mut z, &x)?, None),
        };
        let saved = mode.saves().then_some(BottleneckSaved {
            x,
            y1,
            bn1,
            a1,
            y2,
            bn2,
            a2,
            y3,
            bn3,
            down,
            mask,
        });
        Ok((z, saved))
    }

    pub fn backward(
        &mut self,
        pool: &Pool,
        s: BottleneckSaved,
        mut d_out: Tensor,
    ) -> Result<Tensor> {
        if pool.computes() {
            relu::relu_mask_backward_inplace(d_out.f32_mut(), s.mask.bits());
        }
        let d_z = d_out;
        let d_y3 = self.bn3.backward(pool, &d_z, &s.y3, &s.bn3, None)?;
        drop((s.y3, s.bn3));
        let mut d_a2 = Conv::zeros_like(pool, &s.a2, Tag::new(&self.name, "d_a2"))?;
        self.conv3.backward(pool, &d_y3, &s.a2, Some(&mut d_a2))?;
        drop(d_y3);
        let d_y2 = self.bn2.backward(pool, &d_a2, &s.y2, &s.bn2, Some(&s.a2))?;
        drop((d_a2, s.a2, s.y2, s.bn2));
        let mut d_a1 = Conv::zeros_like(pool, &s.a1, Tag::new(&self.name, "d_a1"))?;
        self.conv2.backward(pool, &d_y2, &s.a1, Some(&mut d_a1))?;
        drop(d_y2);
        let d_y1 = self.bn1.backward(pool, &d_a1, &s.y1, &s.bn1, Some(&s.a1))?;
        drop((d_a1, s.a1, s.y1, s.bn1));
        let mut d_x = Conv::zeros_like(pool, &s.x, Tag::new(&self.name, "dx"))?;
        self.conv1.backward(pool, &d_y1, &s.x, Some(&mut d_x))?;
        drop(d_y1);
        match (self.downsample.as_mut(), s.down) {
            (Some(ds), Some(saved)) => ds.backward(pool, saved, &d_z, &s.x, &mut d_x)?,
            _ if pool.computes() => add::add_assign(d_x.f32_mut(), d_z.f32()),
            _ => {}
        }
        Ok(d_x)
    }

    pub fn saved_bytes(&self, n: usize, h: usize, w: usize) -> usize {
        let g1 = self.conv1.geom(n, h, w);
        let g2 = self.conv2.geom(n, h, w);
        let out = g2.rows() * self.conv3.cout;
        let mut b = 4 * (g1.input_len() + 2 * g1.output_len() + 2 * g2.output_len() + out)
            + out.div_ceil(8);
        b += self.bn1.stats_bytes() + self.bn2.stats_bytes() + self.bn3.stats_bytes();
        if let Some(ds) = &self.downsample {
            b += 4 * out + ds.bn.stats_bytes();
        }
        b
    }
}
