//! Parameterised layers used by the stages: they own their weights and
//! allocate their outputs and workspaces from the ctx; the math is in `ops`.

use std::sync::Arc;

use rand::rngs::ChaCha8Rng;

use crate::backend::{self, ConvPass};
use crate::error::Result;
use crate::memory::{Category, Pool, Tag};
use crate::nn::precision::{View, f32_view, rounded_weight, store};
use crate::nn::{BnPolicy, Ctx, Mode, Param, Precision, normal, uniform};
use crate::ops::conv2d::ConvGeom;
use crate::tensor::{DType, Tensor};

/// A convolution without bias. Weight layout (kh, kw, cin, cout).
pub struct Conv {
    pub name: Arc<str>,
    pub weight: Param,
    pub cin: usize,
    pub cout: usize,
    pub k: usize,
    pub stride: usize,
    pub pad: usize,
}

impl Conv {
    /// Kaiming normal, fan_out, ReLU gain (torchvision's ResNet init).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        pool: &Pool,
        rng: &mut ChaCha8Rng,
        name: &str,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        pad: usize,
    ) -> Result<Self> {
        let std = (2.0 / (cout * k * k) as f32).sqrt();
        let values = normal(rng, k * k * cin * cout, std);
        Ok(Conv {
            name: name.into(),
            weight: Param::new(pool, &format!("{name}.weight"), &[k, k, cin, cout], &values)?,
            cin,
            cout,
            k,
            stride,
            pad,
        })
    }

    pub fn geom(&self, n: usize, h: usize, w: usize) -> ConvGeom {
        ConvGeom {
            n,
            h,
            w,
            cin: self.cin,
            cout: self.cout,
            kh: self.k,
            kw: self.k,
            stride: self.stride,
            pad: self.pad,
        }
    }

    /// Whether the kernels read `x` as it is stored: f32, or bf16 on a
    /// device whose convolutions read bf16 (`Capabilities::reads_bf16`;
    /// rows of whole words: even `cin`).
    pub fn reads_in_place(&self, x: &Tensor, p: Precision) -> bool {
        match x.dtype() {
            DType::F32 => true,
            DType::BF16 => p.bf16_in_place(backend::capabilities(x)) && self.cin.is_multiple_of(2),
            _ => false,
        }
    }

    /// An f32 copy of `x` when the kernels cannot read it in place.
    fn input_copy<'a>(&self, ctx: &Ctx<'_>, x: &'a Tensor) -> Result<Option<View<'a>>> {
        if self.reads_in_place(x, ctx.precision) {
            return Ok(None);
        }
        f32_view(ctx, x).map(Some)
    }

    /// The kernels' view of `x`: its copy, or `x` itself.
    fn input<'a>(x: &'a Tensor, copy: &'a Option<View<'_>>) -> &'a Tensor {
        copy.as_deref().unwrap_or(x)
    }

    /// `x` is f32 or stored in bf16 (under mixed precision its values are
    /// rounded to the low type either way).
    pub fn forward(&self, ctx: &Ctx<'_>, x: &Tensor, field: &'static str) -> Result<Tensor> {
        let (n, h, w, _) = x.shape().nhwc();
        let g = self.geom(n, h, w);
        g.validate()?;
        let x_copy = self.input_copy(ctx, x)?;
        let mut y = ctx.empty(
            &[n, g.oh(), g.ow(), self.cout],
            self.output_dtype(ctx),
            Category::Activations,
            Tag::new(&self.name, field),
        )?;
        let w_low = self.gemm_weight(ctx)?;
        let xv = Self::input(x, &x_copy);
        let mut ws = self.workspace(ctx, &g, ConvPass::Forward, xv, y.dtype())?;
        backend::conv2d_forward(
            &mut y,
            xv,
            w_low.as_ref().unwrap_or(&self.weight.value),
            &g,
            &mut ws,
            ctx.precision,
        )?;
        // A bf16 convolution returns its output rounded already.
        if ctx.precision != Precision::BF16 {
            backend::round(&mut y, ctx.precision)?;
        }
        Ok(y)
    }

    /// The forward output's storage: bf16 under bf16 where the device
    /// reads bf16 (every reader of a convolution's output, the BN, does),
    /// so no f32 copy of it is made; else f32.
    fn output_dtype(&self, ctx: &Ctx<'_>) -> DType {
        if ctx.precision.bf16_in_place(ctx.device().capabilities()) && self.cout.is_multiple_of(2) {
            DType::BF16
        } else {
            DType::F32
        }
    }

    /// Accumulates the weight gradient; adds the input gradient into `dx`
    /// when given.
    pub fn backward(
        &mut self,
        ctx: &Ctx<'_>,
        dy: &Tensor,
        x: &Tensor,
        dx: Option<&mut Tensor>,
    ) -> Result<()> {
        let (n, h, w, _) = x.shape().nhwc();
        let g = self.geom(n, h, w);
        let x_copy = self.input_copy(ctx, x)?;
        let w_low = self.gemm_weight(ctx)?;
        let xv = Self::input(x, &x_copy);
        let mut ws = self.workspace(ctx, &g, ConvPass::Backward, xv, DType::F32)?;
        let mut dx = dx;
        backend::conv2d_backward(
            dx.as_deref_mut(),
            &mut self.weight.grad,
            dy,
            xv,
            w_low.as_ref().unwrap_or(&self.weight.value),
            &g,
            &mut ws,
            ctx.precision,
        )?;
        // A bf16 convolution returns dx rounded already.
        if let Some(dx) = dx.filter(|_| ctx.precision != Precision::BF16) {
            backend::round(dx, ctx.precision)?;
        }
        Ok(())
    }

    /// The workspace the device asks for this convolution, from the ctx.
    fn workspace(
        &self,
        ctx: &Ctx<'_>,
        g: &ConvGeom,
        pass: ConvPass,
        x: &Tensor,
        out: DType,
    ) -> Result<Tensor> {
        let (dtype, len) =
            backend::conv2d_workspace_for(ctx.device(), g, pass, x.dtype(), out, ctx.precision)?;
        ctx.empty(
            &[len],
            dtype,
            Category::Workspace,
            Tag::new(&self.name, "im2col"),
        )
    }

    /// The weight as the GEMM needs it: a copy rounded to the layer's
    /// precision, or `None` to use the weight itself (fp32, and bf16 with the
    /// native GEMM, which rounds while packing exactly as a copy would be).
    fn gemm_weight(&self, ctx: &Ctx<'_>) -> Result<Option<Tensor>> {
        if ctx
            .precision
            .gemm_rounds_operands(ctx.device().capabilities())
        {
            return Ok(None);
        }
        rounded_weight(
            ctx,
            &self.weight.value,
            ctx.precision,
            Tag::new(&self.name, "weight_low"),
        )
    }

    /// A zeroed tensor shaped like `x`, for input gradients to accumulate in.
    pub fn zeros_like(pool: &Pool, x: &Tensor, tag: Tag) -> Result<Tensor> {
        pool.zeros_f32(x.dims(), Category::Activations, tag)
    }
}

/// Statistics a BN forward used, which its backward needs again.
pub struct BnStats {
    pub mean: Tensor, // (c)
    pub rstd: Tensor, // (c)
    /// The statistics came from the batch (gradient flows through them).
    pub from_batch: bool,
}

impl BnStats {
    pub fn bytes(&self) -> usize {
        self.mean.bytes() + self.rstd.bytes()
    }
}

/// Batch norm 2d (momentum 0.1, eps 1e-5 unless set otherwise).
pub struct BatchNorm {
    pub name: Arc<str>,
    pub weight: Param,
    pub bias: Param,
    pub running_mean: Tensor,
    pub running_var: Tensor,
    pub num_batches_tracked: i64,
    pub c: usize,
    pub eps: f32,
    pub momentum: f32,
}

impl BatchNorm {
    pub fn new(pool: &Pool, name: &str, c: usize, zero_weight: bool) -> Result<Self> {
        let prefix: Arc<str> = name.into();
        let gamma = vec![if zero_weight { 0.0 } else { 1.0 }; c];
        Ok(BatchNorm {
            weight: Param::new(pool, &format!("{name}.weight"), &[c], &gamma)?,
            bias: Param::new(pool, &format!("{name}.bias"), &[c], &vec![0.0; c])?,
            running_mean: pool.zeros_f32(
                &[c],
                Category::Params,
                Tag::new(&prefix, "running_mean"),
            )?,
            running_var: pool.from_f32(
                &[c],
                &vec![1.0; c],
                Category::Params,
                Tag::new(&prefix, "running_var"),
            )?,
            num_batches_tracked: 0,
            name: prefix,
            c,
            eps: 1e-5,
            momentum: 0.1,
        })
    }

    /// Bytes of the statistics a training forward keeps.
    pub fn stats_bytes(&self) -> usize {
        2 * 4 * self.c
    }

    /// Normalise `x` (and ReLU when `relu`). With batch policy, `Train` and
    /// `Recompute` use batch statistics; only `Train` advances the running
    /// ones.
    pub fn forward(
        &mut self,
        ctx: &Ctx<'_>,
        x: &Tensor,
        relu: bool,
        mode: Mode,
        field: &'static str,
    ) -> Result<(Tensor, BnStats)> {
        self.forward_as(ctx, x, relu, mode, field, false)
    }

    /// BN+ReLU whose output feeds a convolution of the same precision:
    /// [`BatchNorm::forward`] with `relu`, but under bf16 on a device that
    /// reads bf16 (`Capabilities::reads_bf16`, and even `c`) the output is
    /// written in bf16 directly —
    /// the form the convolution reads in place and the block keeps — with
    /// the bits `store` would give the f32 output.
    pub fn forward_relu_for_conv(
        &mut self,
        ctx: &Ctx<'_>,
        x: &Tensor,
        mode: Mode,
        field: &'static str,
    ) -> Result<(Tensor, BnStats)> {
        let low = self.out_in_bf16(ctx);
        self.forward_as(ctx, x, true, mode, field, low)
    }

    /// Whether this layer's output is written in bf16: under bf16 where
    /// the device reads bf16 in place (every reader of a BN output, a
    /// convolution or the residual add, then does), with even `c`.
    fn out_in_bf16(&self, ctx: &Ctx<'_>) -> bool {
        ctx.precision.bf16_in_place(ctx.device().capabilities()) && self.c.is_multiple_of(2)
    }

    /// [`BatchNorm::forward`] that consumes `x` and returns it as the
    /// backward keeps it, `store(x, sp)`. Every caller feeds the output to
    /// a convolution (`relu`: a BN+ReLU) or to the residual add (no ReLU),
    /// both of which read bf16, so under bf16 on a device that reads it
    /// ([`BatchNorm::forward_relu_for_conv`]) the output is written in bf16
    /// directly. Under bf16 with an f32 `x` (a convolution's f32 output)
    /// the normalising pass writes the bf16 copy of `x` itself, instead of
    /// `store` reading `x` again.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_storing_input(
        &mut self,
        ctx: &Ctx<'_>,
        x: Tensor,
        relu: bool,
        mode: Mode,
        field: &'static str,
        sp: Precision,
    ) -> Result<(Tensor, BnStats, Tensor)> {
        let bf16_out = self.out_in_bf16(ctx);
        if sp != Precision::BF16 || x.dtype() != DType::F32 {
            let (y, stats) = self.forward_as(ctx, &x, relu, mode, field, bf16_out)?;
            return Ok((y, stats, store(ctx, x, sp)?));
        }
        let stats = self.stats(ctx, &x, mode)?;
        let tag = Tag::new(&self.name, field);
        let mut y = if bf16_out {
            ctx.empty(x.dims(), DType::BF16, Category::Activations, tag)?
        } else {
            ctx.empty_f32(x.dims(), Category::Activations, tag)?
        };
        let (x_tag, x_category) = x.meta();
        let mut x_low = ctx.empty(x.dims(), DType::BF16, x_category, x_tag)?;
        backend::bn_forward_keep_x(
            &mut y,
            &mut x_low,
            &x,
            &stats.mean,
            &stats.rstd,
            &self.weight.value,
            &self.bias.value,
            relu,
            ctx.precision,
        )?;
        Ok((y, stats, x_low))
    }

    fn forward_as(
        &mut self,
        ctx: &Ctx<'_>,
        x: &Tensor,
        relu: bool,
        mode: Mode,
        field: &'static str,
        bf16_out: bool,
    ) -> Result<(Tensor, BnStats)> {
        let stats = self.stats(ctx, x, mode)?;
        let tag = |f| Tag::new(&self.name, f);
        let y = if bf16_out {
            self.apply_bf16(ctx, x, &stats, relu, tag(field))?
        } else {
            self.apply(ctx, x, &stats, relu, tag(field))?
        };
        Ok((y, stats))
    }

    /// The statistics a forward normalises with (batch ones advance the
    /// running statistics in `Train`).
    fn stats(&mut self, ctx: &Ctx<'_>, x: &Tensor, mode: Mode) -> Result<BnStats> {
        let c = self.c;
        let rows = x.numel() / c;
        let tag = |f| Tag::new(&self.name, f);
        let mut mean = ctx.empty_f32(&[c], Category::Activations, tag("mean"))?;
        let mut rstd = ctx.empty_f32(&[c], Category::Activations, tag("rstd"))?;
        let from_batch = mode != Mode::Eval && ctx.bn == BnPolicy::Batch;
        if from_batch {
            let mut var = ctx.empty_f32(&[c], Category::Workspace, tag("var"))?;
            backend::bn_batch_stats(&mut mean, &mut var, &mut rstd, x, self.eps)?;
            if mode == Mode::Train {
                backend::bn_update_running(
                    &mut self.running_mean,
                    &mut self.running_var,
                    &mean,
                    &var,
                    rows,
                    self.momentum,
                )?;
                self.num_batches_tracked += 1;
            }
        } else {
            backend::bn_running_stats(
                &mut mean,
                &mut rstd,
                &self.running_mean,
                &self.running_var,
                self.eps,
            )?;
        }
        Ok(BnStats {
            mean,
            rstd,
            from_batch,
        })
    }

    /// [`BatchNorm::apply`] with the output stored in bf16 (values rounded
    /// as a bf16 BN output is).
    fn apply_bf16(
        &self,
        ctx: &Ctx<'_>,
        x: &Tensor,
        stats: &BnStats,
        relu: bool,
        tag: Tag,
    ) -> Result<Tensor> {
        let mut y = ctx.empty(x.dims(), DType::BF16, Category::Activations, tag)?;
        self.normalise(ctx.precision, &mut y, x, stats, relu)?;
        Ok(y)
    }

    /// `relu(bn(x))` with given statistics as a convolution reads it: in
    /// bf16 where [`BatchNorm::forward_relu_for_conv`] writes bf16, else
    /// f32 — what a backward recomputes instead of keeping, with the bits
    /// the forward kept.
    pub fn apply_relu_for_conv(
        &self,
        ctx: &Ctx<'_>,
        x: &Tensor,
        stats: &BnStats,
        tag: Tag,
    ) -> Result<Tensor> {
        if self.out_in_bf16(ctx) {
            return self.apply_bf16(ctx, x, stats, true, tag);
        }
        self.apply(ctx, x, stats, true, tag)
    }

    /// Normalises `x` with given statistics (and ReLU when `relu`): the
    /// forward's second half, and what a backward runs again to recompute
    /// a BN+ReLU output instead of storing it (bit-identical to the
    /// forward's, as the same kernel sees the same values). `x` is f32 or
    /// bf16, read in place.
    pub fn apply(
        &self,
        ctx: &Ctx<'_>,
        x: &Tensor,
        stats: &BnStats,
        relu: bool,
        tag: Tag,
    ) -> Result<Tensor> {
        let mut y = ctx.empty_f32(x.dims(), Category::Activations, tag)?;
        self.normalise(ctx.precision, &mut y, x, stats, relu)?;
        Ok(y)
    }

    /// `y` (f32 rounded to the layer's precision, or bf16) = BN(x) with
    /// `stats`, then ReLU when `relu`.
    fn normalise(
        &self,
        p: Precision,
        y: &mut Tensor,
        x: &Tensor,
        stats: &BnStats,
        relu: bool,
    ) -> Result<()> {
        backend::bn_forward(
            y,
            x,
            &stats.mean,
            &stats.rstd,
            &self.weight.value,
            &self.bias.value,
            relu,
            p,
        )
    }

    /// Returns dx; accumulates the affine gradients unless frozen. `x` and
    /// `relu_out` are f32 or bf16, read in place.
    pub fn backward(
        &mut self,
        ctx: &Ctx<'_>,
        dy: &Tensor,
        x: &Tensor,
        stats: &BnStats,
        relu_out: Option<&Tensor>,
    ) -> Result<Tensor> {
        let mut dx = ctx.empty_f32(x.dims(), Category::Activations, Tag::new(&self.name, "dx"))?;
        let frozen = ctx.bn == BnPolicy::Frozen;
        let (dgamma, dbeta) = if frozen {
            (None, None)
        } else {
            (Some(&mut self.weight.grad), Some(&mut self.bias.grad))
        };
        backend::bn_backward(
            &mut dx,
            dgamma,
            dbeta,
            dy,
            x,
            &stats.mean,
            &stats.rstd,
            &self.weight.value,
            relu_out,
            stats.from_batch,
            ctx.precision,
        )?;
        Ok(dx)
    }
}

/// Fully connected layer, PyTorch layout: weight (out, in), bias (out).
pub struct Linear {
    pub name: Arc<str>,
    pub weight: Param,
    pub bias: Param,
    pub fin: usize,
    pub fout: usize,
}

impl Linear {
    /// PyTorch's default nn.Linear init: weight and bias uniform in
    /// ±1/sqrt(fan_in).
    pub fn new(
        pool: &Pool,
        rng: &mut ChaCha8Rng,
        name: &str,
        fin: usize,
        fout: usize,
    ) -> Result<Self> {
        let bound = 1.0 / (fin as f32).sqrt();
        let w = uniform(rng, fout * fin, bound);
        let b = uniform(rng, fout, bound);
        Ok(Linear {
            name: name.into(),
            weight: Param::new(pool, &format!("{name}.weight"), &[fout, fin], &w)?,
            bias: Param::new(pool, &format!("{name}.bias"), &[fout], &b)?,
            fin,
            fout,
        })
    }

    pub fn forward(&self, ctx: &Ctx<'_>, x: &Tensor) -> Result<Tensor> {
        let n = x.dims()[0];
        let mut y = ctx.empty_f32(
            &[n, self.fout],
            Category::Activations,
            Tag::new(&self.name, "y"),
        )?;
        let w_low = rounded_weight(
            ctx,
            &self.weight.value,
            ctx.precision,
            Tag::new(&self.name, "weight_low"),
        )?;
        backend::linear_forward(
            &mut y,
            x,
            w_low.as_ref().unwrap_or(&self.weight.value),
            &self.bias.value,
            ctx.precision,
        )?;
        Ok(y)
    }

    pub fn backward(&mut self, ctx: &Ctx<'_>, dy: &Tensor, x: &Tensor) -> Result<Tensor> {
        let mut dx = ctx.empty_f32(x.dims(), Category::Activations, Tag::new(&self.name, "dx"))?;
        let w_low = rounded_weight(
            ctx,
            &self.weight.value,
            ctx.precision,
            Tag::new(&self.name, "weight_low"),
        )?;
        backend::linear_backward(
            &mut dx,
            &mut self.weight.grad,
            &mut self.bias.grad,
            dy,
            x,
            w_low.as_ref().unwrap_or(&self.weight.value),
            ctx.precision,
        )?;
        Ok(dx)
    }
}
