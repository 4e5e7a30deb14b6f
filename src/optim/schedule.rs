//! Learning-rate schedules, evaluated in closed form per optimizer step.
//!
//! `step` counts OPTIMIZER steps from 0 (the lr used by the first
//! `optimizer.step()` is `lr_at(base, 0)`); with gradient accumulation the
//! schedule advances once per optimizer step, not per micro-batch. This is
//! PyTorch's convention of reading `param_groups[0]["lr"]` before
//! `optimizer.step()` and calling `scheduler.step()` after it.
//!
//! Formulas (computed in f64 from the decimal values of the f32 inputs, the
//! way PyTorch's Python floats hold them, then rounded to f32):
//!
//! * `Constant`: `base`.
//! * `Step`: `base · gamma^⌊k / step_size⌋` (`StepLR`).
//! * `Cosine`: `min + (base - min)·(1 + cos(π·k/T))/2` with
//!   `T = total_steps` (`CosineAnnealingLR(T_max=T, eta_min=min)`); for
//!   `k ≥ T` it stays at `min` (PyTorch's cosine would rise again).
//!
//! [`LrSchedule`] adds a linear warmup of `W = warmup_steps` steps, exactly
//! `SequentialLR([LinearLR(start_factor=s, end_factor=1, total_iters=W), main],
//! milestones=[W])`: for `t < W` the lr is `base·(s + (1 - s)·t/W)` (so it
//! starts at `s·base` and would reach `base` at `t = W`); for `t ≥ W` it is the
//! main schedule at `k = t - W`. `s` defaults to `1/W`. With warmup, the
//! cosine's `total_steps` counts the whole run, warmup included:
//! `T = total_steps - W` (`CosineAnnealingLR(T_max=total-W)`), so the lr
//! reaches `min_lr` at `t = total_steps`. `Step`'s `step_size` counts steps
//! after the warmup.

use super::widen;

/// The main schedule, as a function of steps `k` since it started.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Schedule {
    Constant,
    Step { step_size: usize, gamma: f32 },
    Cosine { total_steps: usize, min_lr: f32 },
}

impl Schedule {
    /// The lr of optimizer step `step` (from 0), no warmup.
    pub fn lr_at(&self, base_lr: f32, step: usize) -> f32 {
        self.lr_f64(widen(base_lr), step, 0) as f32
    }

    /// `offset` steps of the run were spent before this schedule started
    /// (warmup); they shorten the cosine.
    fn lr_f64(&self, base: f64, k: usize, offset: usize) -> f64 {
        match *self {
            Schedule::Constant => base,
            Schedule::Step { step_size, gamma } => {
                let e = k / step_size.max(1);
                base * widen(gamma).powi(i32::try_from(e).unwrap_or(i32::MAX))
            }
            Schedule::Cosine {
                total_steps,
                min_lr,
            } => {
                let min = widen(min_lr);
                let t_max = total_steps.saturating_sub(offset);
                if k >= t_max {
                    return min;
                }
                let c = (std::f64::consts::PI * k as f64 / t_max as f64).cos();
                min + (base - min) * (1.0 + c) / 2.0
            }
        }
    }
}

/// A [`Schedule`] with an optional linear warmup (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub schedule: Schedule,
    pub warmup_steps: usize,
    /// LinearLR's `start_factor`; `None` = `1/warmup_steps`.
    pub warmup_start_factor: Option<f32>,
}

impl LrSchedule {
    pub fn new(schedule: Schedule) -> Self {
        LrSchedule {
            schedule,
            warmup_steps: 0,
            warmup_start_factor: None,
        }
    }

    pub fn with_warmup(mut self, warmup_steps: usize) -> Self {
        self.warmup_steps = warmup_steps;
        self
    }

    /// The lr of optimizer step `step` (from 0).
    pub fn lr_at(&self, base_lr: f32, step: usize) -> f32 {
        let base = widen(base_lr);
        let w = self.warmup_steps;
        if step < w {
            let s = self.warmup_start_factor.map_or(1.0 / w as f64, widen);
            return (base * (s + (1.0 - s) * step as f64 / w as f64)) as f32;
        }
        self.schedule.lr_f64(base, step - w, w) as f32
    }
}

impl From<Schedule> for LrSchedule {
    fn from(s: Schedule) -> Self {
        LrSchedule::new(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_forms() {
        assert_eq!(Schedule::Constant.lr_at(0.1, 7), 0.1);
        let s = Schedule::Step {
            step_size: 5,
            gamma: 0.5,
        };
        assert_eq!(s.lr_at(0.1, 4), 0.1);
        assert_eq!(s.lr_at(0.1, 5), 0.05);
        assert_eq!(s.lr_at(0.1, 10), 0.025);
        let c = Schedule::Cosine {
            total_steps: 10,
            min_lr: 0.0,
        };
        assert_eq!(c.lr_at(1.0, 0), 1.0);
        assert!((c.lr_at(1.0, 5) - 0.5).abs() < 1e-7);
        assert_eq!(c.lr_at(1.0, 10), 0.0);
        assert_eq!(c.lr_at(1.0, 15), 0.0);
        let w = LrSchedule::new(c).with_warmup(4);
        assert_eq!(w.lr_at(1.0, 0), 0.25);
        assert_eq!(w.lr_at(1.0, 3), 1.0 * (0.25 + 0.75 * 0.75));
        assert_eq!(w.lr_at(1.0, 4), 1.0);
        assert!((w.lr_at(1.0, 7) - 0.5).abs() < 1e-7); // T = 10 - 4 = 6, k = 3
        assert_eq!(w.lr_at(1.0, 10), 0.0);
    }
}
