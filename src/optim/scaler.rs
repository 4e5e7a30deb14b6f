//! Dynamic loss scaling for f16, with the semantics of PyTorch's
//! `torch.amp.GradScaler`: the loss is multiplied by `scale` before the
//! backward, the gradients are unscaled exactly once per optimizer step
//! (before clipping), a step whose gradients hold an inf or NaN is skipped
//! and the scale halves, and after `growth_interval` consecutive clean steps
//! the scale doubles (`_amp_update_scale_`).

use crate::backend::{self, StepTotals};
use crate::error::Result;
use crate::nn::ResNet;
use crate::tensor::Precision;

/// Whether training in `p` scales its loss: f16 does (its range
/// underflows small gradients), fp32 and bf16 do not. Training and the
/// planner's simulation both ask here (without a scaler a step keeps a
/// roll-back copy of the BN statistics).
pub fn uses_loss_scaler(p: Precision) -> bool {
    p == Precision::F16
}

/// PyTorch's defaults.
pub const DEFAULT_INIT_SCALE: f32 = 65536.0;
pub const DEFAULT_GROWTH_INTERVAL: u32 = 2000;

#[derive(Clone, Debug, PartialEq)]
pub struct GradScaler {
    pub scale: f32,
    pub growth_factor: f32,
    pub backoff_factor: f32,
    pub growth_interval: u32,
    /// Consecutive clean steps since the last change of scale.
    pub growth_tracker: u32,
}

/// What one optimizer step did with the scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalerStep {
    /// The scale the step's backward used.
    pub scale: f32,
    /// Some gradient was inf or NaN after unscaling.
    pub found_inf: bool,
    /// The optimizer step was skipped (as `found_inf`).
    pub skipped: bool,
}

impl Default for GradScaler {
    fn default() -> Self {
        GradScaler::new(DEFAULT_INIT_SCALE, DEFAULT_GROWTH_INTERVAL)
    }
}

impl GradScaler {
    pub fn new(init_scale: f32, growth_interval: u32) -> Self {
        GradScaler {
            scale: init_scale,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: growth_interval.max(1),
            growth_tracker: 0,
        }
    }

    /// Multiplies every trainable gradient by 1/scale (PyTorch computes the
    /// reciprocal in double, then rounds it to float), noting in `totals`
    /// whether any unscaled value is inf or NaN: one flag for the whole
    /// model, read with the step's other totals (PyTorch's
    /// `found_inf.item()`, once per optimizer step).
    pub fn unscale_into(&self, model: &mut ResNet, totals: &mut StepTotals) -> Result<()> {
        let inv = (1.0 / self.scale as f64) as f32;
        let mut err = None;
        model.visit_params(|p| {
            if p.frozen || err.is_some() {
                return;
            }
            if let Err(e) = backend::unscale_add(totals, &mut p.grad, inv) {
                err = Some(e);
            }
        });
        err.map_or(Ok(()), Err)
    }

    /// `_amp_update_scale_`: back off on inf, else count a clean step and
    /// grow after `growth_interval` of them (only to a finite scale).
    pub fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.scale *= self.backoff_factor;
            self.growth_tracker = 0;
            return;
        }
        let successful = self.growth_tracker + 1;
        if successful == self.growth_interval {
            let grown = self.scale * self.growth_factor;
            if grown.is_finite() {
                self.scale = grown;
            }
            self.growth_tracker = 0;
        } else {
            self.growth_tracker = successful;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rules of torch/amp/grad_scaler.py and `_amp_update_scale_`,
    /// written out as a trace: (found_inf, scale after, tracker after).
    #[test]
    fn update_follows_pytorchs_state_machine() {
        let mut s = GradScaler::new(65536.0, 3);
        let trace = [
            (false, 65536.0, 1),
            (false, 65536.0, 2),
            (false, 131072.0, 0), // third clean step: grow, reset
            (true, 65536.0, 0),   // inf: back off, reset
            (false, 65536.0, 1),
            (true, 32768.0, 0), // an inf also resets a partial count
            (true, 16384.0, 0),
            (false, 16384.0, 1),
            (false, 16384.0, 2),
            (false, 32768.0, 0),
        ];
        for (i, (inf, scale, tracker)) in trace.into_iter().enumerate() {
            s.update(inf);
            assert_eq!((s.scale, s.growth_tracker), (scale, tracker), "step {i}");
        }
        // Growth never overflows the scale to inf.
        let mut s = GradScaler::new(f32::MAX, 1);
        s.update(false);
        assert_eq!(s.scale, f32::MAX);
        assert_eq!(s.growth_tracker, 0);
    }
}
