//! The classifier head: global average pool, then the fully connected layer.

use rand::rngs::ChaCha8Rng;

use crate::backend;
use crate::error::Result;
use crate::memory::{Category, Pool, Tag};
use crate::nn::precision::{f32_view, store};
use crate::nn::{Linear, Mode, Precision};
use crate::tensor::Tensor;

pub struct Head {
    pub fc: Linear,
    /// Storage type of the pooled features; the logits stay f32 for the
    /// loss (rounded to this type, as a low-type linear outputs them).
    pub precision: Precision,
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
            precision: Precision::F32,
        })
    }

    pub fn forward(
        &mut self,
        pool: &Pool,
        x: Tensor,
        mode: Mode,
    ) -> Result<(Tensor, Option<HeadSaved>)> {
        let (n, h, w, c) = x.shape().nhwc();
        let mut pooled =
            pool.empty_f32(&[n, c], Category::Activations, Tag::fixed("avgpool.out"))?;
        let xv = f32_view(pool, &x)?;
        backend::avgpool_forward(&mut pooled, &xv, self.precision)?;
        drop(xv);
        drop(x);
        let logits = self.fc.forward(pool, &pooled)?;
        let saved = if mode.saves() {
            Some(HeadSaved {
                pooled: store(pool, pooled, self.precision)?,
                input_dims: [n, h, w, c],
            })
        } else {
            None
        };
        Ok((logits, saved))
    }

    pub fn backward(&mut self, pool: &Pool, s: HeadSaved, d_logits: Tensor) -> Result<Tensor> {
        let pooled = f32_view(pool, &s.pooled)?;
        let d_pooled = self.fc.backward(pool, &d_logits, &pooled)?;
        drop(pooled);
        drop((d_logits, s.pooled));
        let [n, h, w, c] = s.input_dims;
        let mut dx = pool.empty_f32(
            &[n, h, w, c],
            Category::Activations,
            Tag::fixed("avgpool.dx"),
        )?;
        backend::avgpool_backward(&mut dx, &d_pooled, self.precision)?;
        Ok(dx)
    }

    pub fn saved_bytes(&self, n: usize) -> usize {
        self.precision.bytes() * n * self.fc.fin
    }
}
