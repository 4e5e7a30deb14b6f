//! Optimizers over the model's parameters, with fp32 master weights, plus
//! learning-rate schedules ([`schedule`]) and gradient-norm clipping
//! ([`clip`]). Every update follows PyTorch's single-tensor (CPU, `foreach`
//! off) code path, operation by operation.
//!
//! The learning rate of an optimizer is a public field (`lr`) and can also be
//! set with `set_lr`; a training loop sets it once per optimizer step from
//! [`LrSchedule::lr_at`] (not per micro-batch).

pub mod adamw;
pub mod buckets;
pub mod clip;
pub mod kinds;
pub mod scaler;
pub mod schedule;

pub(crate) use crate::ops::optim_update::widen;
pub use crate::ops::optim_update::{adamw_update, sgd_update};
pub use adamw::AdamW;
pub use buckets::GradBuckets;
pub use clip::{
    clip_grad_norm, clip_grad_norm_slices, clip_to, grad_norm, grad_sum_squares_into, norm_of,
};
pub use kinds::{OptimizerKind, ScheduleKind, lr_schedule};
pub use scaler::{GradScaler, ScalerStep, uses_loss_scaler};
pub use schedule::{LrSchedule, Schedule};

use crate::backend;
use crate::error::Result;
use crate::memory::{Category, Pool, Tag};
use crate::nn::ResNet;
use crate::tensor::Tensor;

/// The optimizers a run can use.
pub enum Optimizer {
    Sgd(Sgd),
    AdamW(AdamW),
}

impl Optimizer {
    pub fn set_lr(&mut self, lr: f32) {
        match self {
            Optimizer::Sgd(o) => o.set_lr(lr),
            Optimizer::AdamW(o) => o.set_lr(lr),
        }
    }

    pub fn step(&mut self, pool: &Pool, model: &mut ResNet) -> Result<()> {
        match self {
            Optimizer::Sgd(o) => o.step(pool, model),
            Optimizer::AdamW(o) => o.step(pool, model),
        }
    }

    /// Allocates the state buffers (zeros) now, if they are not there
    /// yet; the first step then finds them. A training loop calls this
    /// before its first forward: allocated at the first step instead, they
    /// land in the space the backward just freed, and the next step's
    /// activations no longer fit the free blocks they had (the pool grew
    /// for a few steps). The updates are unchanged: the first SGD step
    /// still sets `buf = g`, and AdamW's moments start at zero either way.
    pub fn allocate_state(&mut self, pool: &Pool, model: &mut ResNet) -> Result<()> {
        match self {
            Optimizer::Sgd(o) => o.allocate_state(pool, model),
            Optimizer::AdamW(o) => o.allocate_state(pool, model),
        }
    }

    /// The state a resumed run needs: every buffer, named
    /// `optimizer.<kind>.<index>` (index = parameter visit order), and the
    /// step count (AdamW's bias correction; 0 for SGD).
    pub fn state(&self) -> (Vec<(String, &Tensor)>, u64) {
        match self {
            // Buffers allocated before the first step hold nothing yet:
            // saved as none, as before they existed.
            Optimizer::Sgd(o) if o.first_pending => (Vec::new(), 0),
            Optimizer::AdamW(o) if o.t == 0 => (Vec::new(), 0),
            Optimizer::Sgd(o) => (
                o.buffers
                    .iter()
                    .enumerate()
                    .map(|(i, t)| (format!("optimizer.momentum.{i}"), t))
                    .collect(),
                0,
            ),
            Optimizer::AdamW(o) => {
                let mut v: Vec<(String, &Tensor)> = Vec::new();
                for (i, t) in o.exp_avg.iter().enumerate() {
                    v.push((format!("optimizer.exp_avg.{i}"), t));
                }
                for (i, t) in o.exp_avg_sq.iter().enumerate() {
                    v.push((format!("optimizer.exp_avg_sq.{i}"), t));
                }
                (v, o.t)
            }
        }
    }

    /// Restores [`state`](Self::state): `get(name)` returns a buffer's
    /// values (None when absent: a run saved before its first step has
    /// none). Buffers are shaped like the parameters, in visit order.
    pub fn load_state(
        &mut self,
        pool: &Pool,
        model: &mut ResNet,
        steps: u64,
        mut get: impl FnMut(&str) -> Option<Vec<f32>>,
    ) -> Result<()> {
        let mut dims = Vec::new();
        model.visit_params(|p| dims.push(p.value.dims().to_vec()));
        let mut restore = |kind: &str, tag: &'static str| -> Result<Vec<Tensor>> {
            let mut out = Vec::new();
            for (i, d) in dims.iter().enumerate() {
                let name = format!("optimizer.{kind}.{i}");
                let Some(values) = get(&name) else {
                    if i == 0 {
                        return Ok(Vec::new());
                    }
                    return Err(crate::error::Error::invalid(
                        "checkpoint",
                        format!("{name} is missing"),
                    ));
                };
                out.push(pool.from_f32(d, &values, Category::Optimizer, Tag::fixed(tag))?);
            }
            Ok(out)
        };
        match self {
            Optimizer::Sgd(o) => o.buffers = restore("momentum", "sgd.momentum")?,
            Optimizer::AdamW(o) => {
                o.exp_avg = restore("exp_avg", "adamw.exp_avg")?;
                o.exp_avg_sq = restore("exp_avg_sq", "adamw.exp_avg_sq")?;
                o.t = steps;
            }
        }
        Ok(())
    }

    /// The same hyper-parameters with no state yet (what the planner
    /// simulates: state buffers appear on the first step).
    pub fn fresh(&self) -> Optimizer {
        match self {
            Optimizer::Sgd(o) => {
                Optimizer::Sgd(Sgd::new(o.lr, o.momentum, o.weight_decay, o.nesterov))
            }
            Optimizer::AdamW(o) => Optimizer::AdamW(AdamW::with_params(
                o.lr,
                (o.beta1, o.beta2),
                o.eps,
                o.weight_decay,
            )),
        }
    }
}

/// A zero f32 tensor shaped like each parameter, in visit order, from the
/// pool as [`Category::Optimizer`] under `tag`: an optimizer's state.
pub(crate) fn zeros_like_params(
    pool: &Pool,
    model: &mut ResNet,
    tag: &'static str,
) -> Result<Vec<Tensor>> {
    let mut dims = Vec::new();
    model.visit_params(|p| dims.push(p.value.dims().to_vec()));
    dims.iter()
        .map(|d| pool.zeros_f32(d, Category::Optimizer, Tag::fixed(tag)))
        .collect()
}

/// SGD with PyTorch's exact update:
/// `g = grad + wd·p`; `buf = g` on the first step, else `buf = μ·buf + g`
/// (dampening 0); `g = g + μ·buf` if Nesterov else `buf`; `p -= lr·g`.
/// Momentum buffers come from the pool as [`Category::Optimizer`].
pub struct Sgd {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    pub nesterov: bool,
    pub(crate) buffers: Vec<Tensor>, // one per parameter, in visit order; created on the first step
    /// The buffers exist ([`Optimizer::allocate_state`]) but no step has
    /// run: the next one sets `buf = g`.
    first_pending: bool,
}

impl Sgd {
    pub fn new(lr: f32, momentum: f32, weight_decay: f32, nesterov: bool) -> Self {
        Sgd {
            lr,
            momentum,
            weight_decay,
            nesterov,
            buffers: Vec::new(),
            first_pending: false,
        }
    }

    /// Learning rate of the next [`step`](Self::step).
    pub fn set_lr(&mut self, lr: f32) {
        self.lr = lr;
    }

    /// The momentum buffers, if momentum is on and they are not there yet
    /// ([`Optimizer::allocate_state`]).
    fn allocate_state(&mut self, pool: &Pool, model: &mut ResNet) -> Result<()> {
        if self.momentum != 0.0 && self.buffers.is_empty() {
            self.buffers = zeros_like_params(pool, model, "sgd.momentum")?;
            self.first_pending = true;
        }
        Ok(())
    }

    pub fn step(&mut self, pool: &Pool, model: &mut ResNet) -> Result<()> {
        self.allocate_state(pool, model)?;
        let first = self.first_pending;
        let mut err = None;
        let mut i = 0;
        let (lr, mu, wd, nesterov) = (self.lr, self.momentum, self.weight_decay, self.nesterov);
        let buffers = &mut self.buffers;
        model.visit_params(|p| {
            if err.is_some() {
                return;
            }
            if p.frozen {
                i += 1;
                return;
            }
            let buf = if mu == 0.0 {
                None
            } else {
                Some(&mut buffers[i])
            };
            if let Err(e) =
                backend::sgd_update(&mut p.value, &p.grad, buf, first, lr, mu, wd, nesterov)
            {
                err = Some(e);
                return;
            }
            i += 1;
        });
        if err.is_none() {
            self.first_pending = false;
        }
        err.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widen_keeps_decimal_value() {
        assert_eq!(widen(0.9), 0.9f64);
        assert_eq!(widen(1e-8), 1e-8f64);
        assert_eq!(widen(0.999), 0.999f64);
    }

    #[test]
    fn sgd_update_momentum_by_hand() {
        let mut w = [1.0f32, -2.0];
        let mut b = [0.0f32; 2];
        sgd_update(
            &mut w,
            &[0.5, 1.0],
            Some(&mut b),
            true,
            0.1,
            0.9,
            0.0,
            false,
        );
        assert_eq!(b, [0.5, 1.0]);
        assert!((w[0] - 0.95).abs() < 1e-7 && (w[1] + 2.1).abs() < 1e-7);
        sgd_update(
            &mut w,
            &[0.5, 1.0],
            Some(&mut b),
            false,
            0.1,
            0.9,
            0.0,
            true,
        );
        // buf = 0.9*0.5+0.5 = 0.95; step = 0.5 + 0.9*0.95 = 1.355
        assert!((b[0] - 0.95).abs() < 1e-7);
        assert!((w[0] - (0.95 - 0.1355)).abs() < 1e-6, "{}", w[0]);
        let mut w = [1.0f32];
        sgd_update(&mut w, &[1.0], None, false, 0.5, 0.0, 0.1, false);
        assert!((w[0] - (1.0 - 0.5 * 1.1)).abs() < 1e-7);
    }
}
