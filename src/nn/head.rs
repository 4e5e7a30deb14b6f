//! The classifier head: global average pool, then the fully connected layer.

use rand::rngs::ChaCha8Rng;

use crate::error::Result;
use crate::memory::{Category, Pool, Tag};
use crate::nn::{Linear, Mode};
use crate::ops::avgpool;
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
        pool: &Pool,
        x: Tensor,
        mode: Mode,
    ) -> Result<(Tensor, Option<HeadSaved>)> {
        let (n, h, w, c) = x.shape().nhwc();
        let mut pooled =
            pool.empty_f32(&[n, c], Category::Activations, Tag::fixed("avgpool.out"))?;
        if pool.computes() {
            avgpool::avgpool_forward(pooled.f32_mut(), x.f32(), h * w, c);
        }
        drop(x);
        let logits = self.fc.forward(pool, &pooled)?;
        let saved = mode.saves().then_some(HeadSaved {
            pooled,
            input_dims: [n, h, w, c],
        });
        Ok((logits, saved))
    }

    pub fn backward(&mut self, pool: &Pool, s: HeadSaved, d_logits: Tensor) -> Result<Tensor> {
        let d_pooled = self.fc.backward(pool, &d_logits, &s.pooled)?;
        drop((d_logits, s.pooled));
        let [n, h, w, c] = s.input_dims;
        let mut dx = pool.empty_f32(
            &[n, h, w, c],
            Category::Activations,
            Tag::fixed("avgpool.dx"),
        )?;
        if pool.computes() {
            avgpool::avgpool_backward(dx.f32_mut(), d_pooled.f32(), h * w, c);
        }
        Ok(dx)
    }

    pub fn saved_bytes(&self, n: usize) -> usize {
        4 * n * self.fc.fin
    }
}
