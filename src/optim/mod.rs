//! Optimizers over the model's parameters, with fp32 master weights.

use crate::error::Result;
use crate::memory::{Category, Pool, Tag};
use crate::nn::ResNet;
use crate::tensor::Tensor;

/// SGD with PyTorch's exact update:
/// `g = grad + wd·p`; `buf = g` on the first step, else `buf = μ·buf + g`
/// (dampening 0); `g = g + μ·buf` if Nesterov else `buf`; `p -= lr·g`.
pub struct Sgd {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    pub nesterov: bool,
    buffers: Vec<Tensor>, // one per parameter, in visit order; created on the first step
}

impl Sgd {
    pub fn new(lr: f32, momentum: f32, weight_decay: f32, nesterov: bool) -> Self {
        Sgd {
            lr,
            momentum,
            weight_decay,
            nesterov,
            buffers: Vec::new(),
        }
    }

    pub fn step(&mut self, pool: &Pool, model: &mut ResNet) -> Result<()> {
        let first = self.buffers.is_empty() && self.momentum != 0.0;
        let mut err = None;
        let mut i = 0;
        let (lr, mu, wd, nesterov) = (self.lr, self.momentum, self.weight_decay, self.nesterov);
        let buffers = &mut self.buffers;
        model.visit_params(|p| {
            if err.is_some() {
                return;
            }
            if first {
                match pool.zeros_f32(
                    p.value.dims(),
                    Category::Optimizer,
                    Tag::fixed("sgd.momentum"),
                ) {
                    Ok(t) => buffers.push(t),
                    Err(e) => {
                        err = Some(e);
                        return;
                    }
                }
            }
            let grad = p.grad.f32();
            let value = p.value.f32_mut();
            if mu == 0.0 {
                for (w, &g) in value.iter_mut().zip(grad) {
                    *w -= lr * (g + wd * *w);
                }
            } else {
                let buf = buffers[i].f32_mut();
                for ((w, &g), b) in value.iter_mut().zip(grad).zip(buf.iter_mut()) {
                    let g = g + wd * *w;
                    *b = if first { g } else { mu * *b + g };
                    let step = if nesterov { g + mu * *b } else { *b };
                    *w -= lr * step;
                }
            }
            i += 1;
        });
        err.map_or(Ok(()), Err)
    }
}
