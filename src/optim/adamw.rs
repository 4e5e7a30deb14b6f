//! AdamW (`torch.optim.AdamW`, decoupled weight decay, `amsgrad=False`).

use super::zeros_like_params;
use crate::backend;
use crate::error::Result;
use crate::memory::Pool;
use crate::nn::ResNet;
use crate::tensor::Tensor;

/// `torch.optim.AdamW` over every model parameter (visit order). The first
/// and second moments are allocated from the pool as [`Category::Optimizer`]
/// on the first step (2× the parameter bytes).
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub(crate) t: u64,
    pub(crate) exp_avg: Vec<Tensor>,
    pub(crate) exp_avg_sq: Vec<Tensor>,
}

impl AdamW {
    /// PyTorch's defaults: betas (0.9, 0.999), eps 1e-8, weight_decay 0.01.
    pub fn new(lr: f32) -> Self {
        Self::with_params(lr, (0.9, 0.999), 1e-8, 0.01)
    }

    pub fn with_params(lr: f32, betas: (f32, f32), eps: f32, weight_decay: f32) -> Self {
        AdamW {
            lr,
            beta1: betas.0,
            beta2: betas.1,
            eps,
            weight_decay,
            t: 0,
            exp_avg: Vec::new(),
            exp_avg_sq: Vec::new(),
        }
    }

    /// Learning rate of the next [`step`](Self::step).
    pub fn set_lr(&mut self, lr: f32) {
        self.lr = lr;
    }

    /// Optimizer steps taken so far (PyTorch's `state['step']`).
    pub fn steps_taken(&self) -> u64 {
        self.t
    }

    /// The moments (zeros), if they are not there yet
    /// ([`Optimizer::allocate_state`](super::Optimizer::allocate_state)).
    pub(crate) fn allocate_state(&mut self, pool: &Pool, model: &mut ResNet) -> Result<()> {
        if self.exp_avg.is_empty() {
            self.exp_avg = zeros_like_params(pool, model, "adamw.exp_avg")?;
            self.exp_avg_sq = zeros_like_params(pool, model, "adamw.exp_avg_sq")?;
        }
        Ok(())
    }

    pub fn step(&mut self, pool: &Pool, model: &mut ResNet) -> Result<()> {
        let first = self.t == 0;
        if let Err(e) = self.allocate_state(pool, model) {
            self.exp_avg.clear();
            return Err(e);
        }
        let mut err = None;
        let mut i = 0;
        let t = self.t + 1;
        let (lr, b1, b2, eps, wd) = (self.lr, self.beta1, self.beta2, self.eps, self.weight_decay);
        let (ms, vs) = (&mut self.exp_avg, &mut self.exp_avg_sq);
        model.visit_params(|p| {
            if err.is_some() {
                return;
            }
            if p.frozen {
                i += 1;
                return;
            }
            if let Err(e) = backend::adamw_update(
                &mut p.value,
                &p.grad,
                &mut ms[i],
                &mut vs[i],
                t,
                lr,
                b1,
                b2,
                eps,
                wd,
            ) {
                err = Some(e);
                return;
            }
            i += 1;
        });
        if let Some(e) = err {
            // A failed first step leaves no partial state behind.
            if first {
                self.exp_avg.clear();
                self.exp_avg_sq.clear();
            }
            return Err(e);
        }
        self.t = t;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Category;
    use crate::nn::ResNetConfig;
    use crate::ops::optim_update::adamw_update;

    #[test]
    fn first_step_moves_by_about_lr() {
        // Step 1: mhat = g, vhat = g², so the update is lr·sign(g) (eps aside).
        let mut w = [1.0f32, -1.0, 0.5];
        let (mut m, mut v) = ([0.0f32; 3], [0.0f32; 3]);
        adamw_update(
            &mut w,
            &[3.0, -0.2, 1e-3],
            &mut m,
            &mut v,
            1,
            0.1,
            0.9,
            0.999,
            1e-8,
            0.0,
        );
        for (got, want) in w.iter().zip([0.9f32, -0.9, 0.4]) {
            assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        }
    }

    #[test]
    fn model_step_matches_slice_update_and_uses_optimizer_pool() {
        let pool = Pool::new();
        let mut cfg = ResNetConfig::resnet18();
        cfg.base_width = 4;
        cfg.num_classes = 3;
        let mut model = ResNet::new(&pool, cfg).unwrap();
        let mut k = 0u32;
        model.visit_params(|p| {
            for g in p.grad.f32_mut() {
                k = k.wrapping_mul(1664525).wrapping_add(1013904223);
                *g = (k >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
            }
        });
        let mut expect = Vec::new();
        model.visit_params(|p| expect.push((p.value.f32().to_vec(), p.grad.f32().to_vec())));
        let before = pool.stats().live.get(Category::Optimizer);
        let mut opt = AdamW::new(0.01);
        opt.step(&pool, &mut model).unwrap();
        opt.step(&pool, &mut model).unwrap();
        assert_eq!(opt.steps_taken(), 2);
        let mut bytes = 0;
        let mut j = 0;
        model.visit_params(|p| {
            let (w, g) = &mut expect[j];
            let (mut m, mut v) = (vec![0.0; w.len()], vec![0.0; w.len()]);
            for t in 1..=2 {
                adamw_update(w, g, &mut m, &mut v, t, 0.01, 0.9, 0.999, 1e-8, 0.01);
            }
            assert_eq!(p.value.f32(), &w[..], "{}", p.name);
            bytes += 2 * 4 * w.len();
            j += 1;
        });
        assert_eq!(pool.stats().live.get(Category::Optimizer) - before, bytes);
    }
}
