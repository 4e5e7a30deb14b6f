//! Residual blocks in the torchvision v1.5 layout: the stride sits on the
//! 3×3 convolution, and a 1×1 conv + BN downsample joins the residual when
//! the shape changes.

use std::sync::Arc;

use rand::rngs::ChaCha8Rng;

use crate::backend;
use crate::error::Result;
use crate::memory::{Category, Pool, Tag};
use crate::nn::precision::{View, bf16_or_f32_view, f32_view, store, store_grad};
use crate::nn::{BatchNorm, BnStats, Conv, Ctx, Mode, Precision};
use crate::tensor::{DType, Tensor};

/// What a block keeps of a BN+ReLU output for its backward: the tensor
/// (stored in the activation precision), or nothing when the plan
/// recomputes it from the BN input and statistics, which are kept anyway.
fn keep_bn_relu(ctx: &Ctx<'_>, a: Tensor, p: Precision, recompute: bool) -> Result<Option<Tensor>> {
    if recompute {
        return Ok(None);
    }
    store(ctx, a, p).map(Some)
}

/// The BN+ReLU output a backward needs: the kept tensor (read in place
/// when f32 or bf16), or `relu(bn(y))` recomputed with the forward's
/// statistics, in the form the forward kept.
fn bn_relu_view<'a>(
    ctx: &Ctx<'_>,
    kept: &'a Option<Tensor>,
    bn: &BatchNorm,
    y: &Tensor,
    stats: &BnStats,
) -> Result<View<'a>> {
    match kept {
        Some(a) => bf16_or_f32_view(ctx, a),
        None => Ok(View::Owned(bn.apply_relu_for_conv(
            ctx,
            y,
            stats,
            Tag::new(&bn.name, "a_recomputed"),
        )?)),
    }
}

/// The block input as its readers take it: `None` when the convolutions
/// read `x` in place (f32, or bf16 with the native bf16 GEMM; the residual
/// add reads either), else an f32 copy.
fn block_input<'a>(ctx: &Ctx<'_>, x: &'a Tensor, conv: &Conv) -> Result<Option<View<'a>>> {
    if conv.reads_in_place(x, ctx.precision) {
        return Ok(None);
    }
    f32_view(ctx, x).map(Some)
}

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

    /// `x` is the block input (f32, or bf16 its convolution reads in
    /// place); `sp` the precision to store in.
    fn forward(
        &mut self,
        ctx: &Ctx<'_>,
        x: &Tensor,
        mode: Mode,
        sp: Precision,
    ) -> Result<(Tensor, DownsampleSaved)> {
        let y = self.conv.forward(ctx, x, "y")?;
        let (out, bn, y) = self
            .bn
            .forward_storing_input(ctx, y, false, mode, "out", sp)?;
        Ok((out, DownsampleSaved { y, bn }))
    }

    fn backward(
        &mut self,
        ctx: &Ctx<'_>,
        s: DownsampleSaved,
        d_out: &Tensor,
        x: &Tensor,
        dx: &mut Tensor,
    ) -> Result<()> {
        let y = bf16_or_f32_view(ctx, &s.y)?;
        let d_y = self.bn.backward(ctx, d_out, &y, &s.bn, None)?;
        drop(y);
        drop(s);
        self.conv.backward(ctx, &d_y, x, Some(dx))
    }
}

/// Adds the block output `z` to its residual and applies the final ReLU in
/// place, returning the mask (one bit per element) the backward needs.
fn join_residual(
    ctx: &Ctx<'_>,
    name: &Arc<str>,
    z: &mut Tensor,
    residual: &Tensor,
    p: Precision,
) -> Result<Tensor> {
    let mut mask = ctx.empty(
        &[z.numel()],
        DType::Bits,
        Category::Activations,
        Tag::new(name, "relu_mask"),
    )?;
    backend::add_relu_forward(z, residual, &mut mask, p)?;
    Ok(mask)
}

/// The end of a block's forward: the residual (the input `x`, or its
/// downsample) joins `z` with the final ReLU, the f32 copy of the input (if
/// any) is released, and the output is stored in the block's precision `p` (`sp`:
/// the precision of what the backward keeps). Returns (output, ReLU mask,
/// what the downsample's backward needs).
#[allow(clippy::too_many_arguments)]
fn finish_block(
    ctx: &Ctx<'_>,
    name: &Arc<str>,
    downsample: Option<&mut Downsample>,
    mut z: Tensor,
    x: &Tensor,
    x_copy: Option<View<'_>>,
    mode: Mode,
    sp: Precision,
    p: Precision,
) -> Result<(Tensor, Tensor, Option<DownsampleSaved>)> {
    let xv = x_copy.as_deref().unwrap_or(x);
    let (mask, down) = match downsample {
        Some(ds) => {
            let (identity, saved) = ds.forward(ctx, xv, mode, sp)?;
            (join_residual(ctx, name, &mut z, &identity, p)?, Some(saved))
        }
        None => (join_residual(ctx, name, &mut z, xv, p)?, None),
    };
    drop(x_copy);
    Ok((store(ctx, z, p)?, mask, down))
}

/// The residual gradient of a block: `d_z` through the downsample when
/// there is one, else added as is; then `d_x` is rounded as a low-type
/// gradient would be.
fn join_residual_backward(
    ctx: &Ctx<'_>,
    down: Option<(&mut Downsample, DownsampleSaved)>,
    d_z: &Tensor,
    x: &Tensor,
    d_x: &mut Tensor,
    p: Precision,
) -> Result<()> {
    match down {
        Some((ds, saved)) => {
            // The downsample's dgrad leaves d_x rounded to `p` (it runs in
            // the step's precision), so no rounding pass follows.
            ds.backward(ctx, saved, d_z, x, d_x)?;
        }
        None => backend::add_assign(d_x, d_z, p)?,
    }
    Ok(())
}

/// Two 3×3 convolutions (ResNet-18/34).
pub struct BasicBlock {
    pub name: Arc<str>,
    pub conv1: Conv,
    pub bn1: BatchNorm,
    pub conv2: Conv,
    pub bn2: BatchNorm,
    pub downsample: Option<Downsample>,
    /// Recompute relu(bn1(y1)) in backward instead of keeping it.
    pub recompute_bn_relu: bool,
}

/// What `BasicBlock::backward` needs. Tensors are stored in the block's
/// precision.
pub struct BasicSaved {
    x: Tensor,  // (n, h, w, cin)      block input and residual
    y1: Tensor, // (n, h', w', c)      conv1 out
    bn1: BnStats,
    a1: Option<Tensor>, // (n, h', w', c) relu(bn1(y1)), conv2 input; None: recomputed
    y2: Tensor,         // (n, h', w', c)      conv2 out
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
        [&self.x, &self.y1, &self.y2, &self.mask]
            .iter()
            .map(|t| t.bytes())
            .sum::<usize>()
            + self.a1.as_ref().map_or(0, |t| t.bytes())
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
            recompute_bn_relu: false,
        })
    }

    pub fn out_hwc(&self, h: usize, w: usize) -> (usize, usize, usize) {
        let g = self.conv1.geom(1, h, w);
        (g.oh(), g.ow(), self.conv2.cout)
    }

    /// `x` may be f32 or the block's precision; the output is stored in
    /// the block's precision.
    pub fn forward(
        &mut self,
        ctx: &Ctx<'_>,
        x: Tensor,
        mode: Mode,
    ) -> Result<(Tensor, Option<BasicSaved>)> {
        let p = ctx.precision;
        // Eval keeps nothing past the block, so converting would be waste.
        let sp = if mode.saves() { p } else { Precision::F32 };
        let x_copy = block_input(ctx, &x, &self.conv1)?;
        let y1 = self
            .conv1
            .forward(ctx, x_copy.as_deref().unwrap_or(&x), "y")?;
        let (a1, bn1, y1) = self
            .bn1
            .forward_storing_input(ctx, y1, true, mode, "a", sp)?;
        let y2 = self.conv2.forward(ctx, &a1, "y")?;
        let a1 = keep_bn_relu(ctx, a1, sp, self.recompute_bn_relu)?;
        let (z, bn2, y2) = self
            .bn2
            .forward_storing_input(ctx, y2, false, mode, "out", sp)?;
        let (z, mask, down) = finish_block(
            ctx,
            &self.name,
            self.downsample.as_mut(),
            z,
            &x,
            x_copy,
            mode,
            sp,
            p,
        )?;
        let saved = if mode.saves() {
            Some(BasicSaved {
                x: store(ctx, x, sp)?,
                y1,
                bn1,
                a1,
                y2,
                bn2,
                down,
                mask,
            })
        } else {
            None
        };
        Ok((z, saved))
    }

    pub fn backward(&mut self, ctx: &Ctx<'_>, s: BasicSaved, mut d_out: Tensor) -> Result<Tensor> {
        let p = ctx.precision;
        backend::relu_mask_backward_inplace(&mut d_out, &s.mask)?;
        let d_z = d_out;
        let y2 = bf16_or_f32_view(ctx, &s.y2)?;
        let d_y2 = self.bn2.backward(ctx, &d_z, &y2, &s.bn2, None)?;
        drop(y2);
        drop((s.y2, s.bn2));
        let y1 = bf16_or_f32_view(ctx, &s.y1)?;
        let a1 = bn_relu_view(ctx, &s.a1, &self.bn1, &y1, &s.bn1)?;
        let mut d_a1 = Conv::zeros_like(ctx, &a1, Tag::new(&self.name, "d_a1"))?;
        self.conv2.backward(ctx, &d_y2, &a1, Some(&mut d_a1))?;
        drop(d_y2);
        let d_y1 = self.bn1.backward(ctx, &d_a1, &y1, &s.bn1, Some(&a1))?;
        drop((d_a1, a1, y1));
        drop((s.a1, s.y1, s.bn1));
        let x_copy = block_input(ctx, &s.x, &self.conv1)?;
        let x = x_copy.as_deref().unwrap_or(&s.x);
        let mut d_x = Conv::zeros_like(ctx, x, Tag::new(&self.name, "dx"))?;
        self.conv1.backward(ctx, &d_y1, x, Some(&mut d_x))?;
        drop(d_y1);
        let down = self.downsample.as_mut().zip(s.down);
        join_residual_backward(ctx, down, &d_z, x, &mut d_x, p)?;
        drop((d_z, x_copy));
        store_grad(ctx, d_x, p)
    }

    pub fn saved_bytes(&self, n: usize, h: usize, w: usize, p: Precision) -> usize {
        let e = p.bytes();
        let g1 = self.conv1.geom(n, h, w);
        let out = g1.output_len(); // every inner tensor has the output's size
        let inner = if self.recompute_bn_relu { 2 } else { 3 };
        let mut b = e * (g1.input_len() + inner * out) + out.div_ceil(8);
        b += self.bn1.stats_bytes() + self.bn2.stats_bytes();
        if let Some(ds) = &self.downsample {
            b += e * out + ds.bn.stats_bytes();
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
    /// Recompute relu(bn1(y1)) and relu(bn2(y2)) in backward instead of
    /// keeping them.
    pub recompute_bn_relu: bool,
}

/// What `Bottleneck::backward` needs. Tensors are stored in the block's
/// precision.
pub struct BottleneckSaved {
    x: Tensor,  // (n, h, w, cin)       block input and residual
    y1: Tensor, // (n, h, w, m)         conv1 out
    bn1: BnStats,
    a1: Option<Tensor>, // (n, h, w, m)   conv2 input; None: recomputed
    y2: Tensor,         // (n, h', w', m)       conv2 out (stride here)
    bn2: BnStats,
    a2: Option<Tensor>, // (n, h', w', m) conv3 input; None: recomputed
    y3: Tensor,         // (n, h', w', 4m)      conv3 out
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
        [&self.x, &self.y1, &self.y2, &self.y3, &self.mask]
            .iter()
            .map(|t| t.bytes())
            .sum::<usize>()
            + [&self.a1, &self.a2]
                .iter()
                .map(|t| t.as_ref().map_or(0, |t| t.bytes()))
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
            recompute_bn_relu: false,
        })
    }

    pub fn out_hwc(&self, h: usize, w: usize) -> (usize, usize, usize) {
        let g = self.conv2.geom(1, h, w);
        (g.oh(), g.ow(), self.conv3.cout)
    }

    /// `x` may be f32 or the block's precision; the output is stored in
    /// the block's precision.
    pub fn forward(
        &mut self,
        ctx: &Ctx<'_>,
        x: Tensor,
        mode: Mode,
    ) -> Result<(Tensor, Option<BottleneckSaved>)> {
        let p = ctx.precision;
        // Eval keeps nothing past the block, so converting would be waste.
        let sp = if mode.saves() { p } else { Precision::F32 };
        let cheap = self.recompute_bn_relu;
        let x_copy = block_input(ctx, &x, &self.conv1)?;
        let y1 = self
            .conv1
            .forward(ctx, x_copy.as_deref().unwrap_or(&x), "y")?;
        let (a1, bn1, y1) = self
            .bn1
            .forward_storing_input(ctx, y1, true, mode, "a", sp)?;
        let y2 = self.conv2.forward(ctx, &a1, "y")?;
        let a1 = keep_bn_relu(ctx, a1, sp, cheap)?;
        let (a2, bn2, y2) = self
            .bn2
            .forward_storing_input(ctx, y2, true, mode, "a", sp)?;
        let y3 = self.conv3.forward(ctx, &a2, "y")?;
        let a2 = keep_bn_relu(ctx, a2, sp, cheap)?;
        let (z, bn3, y3) = self
            .bn3
            .forward_storing_input(ctx, y3, false, mode, "out", sp)?;
        let (z, mask, down) = finish_block(
            ctx,
            &self.name,
            self.downsample.as_mut(),
            z,
            &x,
            x_copy,
            mode,
            sp,
            p,
        )?;
        let saved = if mode.saves() {
            Some(BottleneckSaved {
                x: store(ctx, x, sp)?,
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
            })
        } else {
            None
        };
        Ok((z, saved))
    }

    pub fn backward(
        &mut self,
        ctx: &Ctx<'_>,
        s: BottleneckSaved,
        mut d_out: Tensor,
    ) -> Result<Tensor> {
        let p = ctx.precision;
        backend::relu_mask_backward_inplace(&mut d_out, &s.mask)?;
        let d_z = d_out;
        let y3 = bf16_or_f32_view(ctx, &s.y3)?;
        let d_y3 = self.bn3.backward(ctx, &d_z, &y3, &s.bn3, None)?;
        drop(y3);
        drop((s.y3, s.bn3));
        let y2 = bf16_or_f32_view(ctx, &s.y2)?;
        let a2 = bn_relu_view(ctx, &s.a2, &self.bn2, &y2, &s.bn2)?;
        let mut d_a2 = Conv::zeros_like(ctx, &a2, Tag::new(&self.name, "d_a2"))?;
        self.conv3.backward(ctx, &d_y3, &a2, Some(&mut d_a2))?;
        drop(d_y3);
        let d_y2 = self.bn2.backward(ctx, &d_a2, &y2, &s.bn2, Some(&a2))?;
        drop((d_a2, a2, y2));
        drop((s.a2, s.y2, s.bn2));
        let y1 = bf16_or_f32_view(ctx, &s.y1)?;
        let a1 = bn_relu_view(ctx, &s.a1, &self.bn1, &y1, &s.bn1)?;
        let mut d_a1 = Conv::zeros_like(ctx, &a1, Tag::new(&self.name, "d_a1"))?;
        self.conv2.backward(ctx, &d_y2, &a1, Some(&mut d_a1))?;
        drop(d_y2);
        let d_y1 = self.bn1.backward(ctx, &d_a1, &y1, &s.bn1, Some(&a1))?;
        drop((d_a1, a1, y1));
        drop((s.a1, s.y1, s.bn1));
        let x_copy = block_input(ctx, &s.x, &self.conv1)?;
        let x = x_copy.as_deref().unwrap_or(&s.x);
        let mut d_x = Conv::zeros_like(ctx, x, Tag::new(&self.name, "dx"))?;
        self.conv1.backward(ctx, &d_y1, x, Some(&mut d_x))?;
        drop(d_y1);
        let down = self.downsample.as_mut().zip(s.down);
        join_residual_backward(ctx, down, &d_z, x, &mut d_x, p)?;
        drop((d_z, x_copy));
        store_grad(ctx, d_x, p)
    }

    pub fn saved_bytes(&self, n: usize, h: usize, w: usize, p: Precision) -> usize {
        let e = p.bytes();
        let g1 = self.conv1.geom(n, h, w);
        let g2 = self.conv2.geom(n, h, w);
        let out = g2.rows() * self.conv3.cout;
        let per_inner = if self.recompute_bn_relu { 1 } else { 2 };
        let mut b = e * (g1.input_len() + per_inner * (g1.output_len() + g2.output_len()) + out)
            + out.div_ceil(8);
        b += self.bn1.stats_bytes() + self.bn2.stats_bytes() + self.bn3.stats_bytes();
        if let Some(ds) = &self.downsample {
            b += e * out + ds.bn.stats_bytes();
        }
        b
    }
}
