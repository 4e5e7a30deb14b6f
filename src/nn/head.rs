//! The classifier head: global average ctx, then the fully connected layer.

use rand::rngs::ChaCha8Rng;

use crate::backend;
use crate::error::Result;
use crate::memory::{Category, Pool, Tag};
use crate::nn::precision::{f32_view, store};
use crate::nn::{Ctx, Linear, Mode, Precision};
use crate::tensor::Tensor;

pub struct Head {
    pub fc: Linear,
}

/// What `Head::backward` needs: the pooled features (for fc's weight
/// gradient) and the input's shape (average pooling needs no values).
pub struct HeadSaved {
    pooled: Tensor, // (n, c)
    input_dims: [usize; 4],
}

impl HeadSaved {
    pub fn bytes(&self) -> usize {
        self.pooled.bytes()
    }
}

impl Head {
    pub fn new(pool: &Pool, rng: &mut ChaCha8Rng, features: usize, classes: usize) -> Result<Self> {
        Ok(Head {
            fc: Linear::new(pool, rng, "fc", features, classes)?,
        })
    }

    pub fn forward(
        &mut self,
        ctx: &Ctx<'_>,
        x: Tensor,
        mode: Mode,
    ) -> Result<(Tensor, Option<HeadSaved>)> {
        let (n, h, w, c) = x.shape().nhwc();
        let mut pooled =
            ctx.empty_f32(&[n, c], Category::Activations, Tag::fixed("avgpool.out"))?;
        let xv = f32_view(ctx, &x)?;
        backend::avgpool_forward(&mut pooled, &xv, ctx.precision)?;
        drop(xv);
        drop(x);
        let logits = self.fc.forward(ctx, &pooled)?;
        let saved = if mode.saves() {
            Some(HeadSaved {
                pooled: store(ctx, pooled, ctx.precision)?,
                input_dims: [n, h, w, c],
            })
        } else {
            None
        };
        Ok((logits, saved))
    }

    pub fn backward(&mut self, ctx: &Ctx<'_>, s: HeadSaved, d_logits: Tensor) -> Result<Tensor> {
        let pooled = f32_view(ctx, &s.pooled)?;
        let d_pooled = self.fc.backward(ctx, &d_logits, &pooled)?;
        drop(pooled);
        drop((d_logits, s.pooled));
        let [n, h, w, c] = s.input_dims;
        let mut dx = ctx.empty_f32(
            &[n, h, w, c],
            Category::Activations,
            Tag::fixed("avgpool.dx"),
        )?;
        backend::avgpool_backward(&mut dx, &d_pooled, ctx.precision)?;
        Ok(dx)
    }

    pub fn saved_bytes(&self, n: usize, p: Precision) -> usize {
        p.bytes() * n * self.fc.fin
    }
}
