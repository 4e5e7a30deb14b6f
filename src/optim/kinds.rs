//! The optimizer and LR schedule a run asks for by name (the command
//! line's `--optimizer`, `--schedule`), and how they are built.

use super::{AdamW, LrSchedule, Optimizer, Schedule, Sgd};

/// The optimizer a run trains with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    Sgd,
    Adamw,
}

impl OptimizerKind {
    /// The optimizer; `weight_decay` None is 5e-4 for SGD, 0.01 for AdamW
    /// (betas 0.9, 0.999, eps 1e-8; `momentum` and `nesterov` are SGD's).
    pub fn build(
        self,
        lr: f32,
        momentum: f32,
        weight_decay: Option<f32>,
        nesterov: bool,
    ) -> Optimizer {
        match self {
            OptimizerKind::Sgd => Optimizer::Sgd(Sgd::new(
                lr,
                momentum,
                weight_decay.unwrap_or(5e-4),
                nesterov,
            )),
            OptimizerKind::Adamw => Optimizer::AdamW(AdamW::with_params(
                lr,
                (0.9, 0.999),
                1e-8,
                weight_decay.unwrap_or(0.01),
            )),
        }
    }

    /// The name resume fingerprints hold (fixed: saved runs compare it).
    pub fn fingerprint_name(self) -> &'static str {
        match self {
            OptimizerKind::Sgd => "Sgd",
            OptimizerKind::Adamw => "Adamw",
        }
    }
}

/// The shape of a run's learning-rate schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind {
    Constant,
    Step,
    Cosine,
}

impl ScheduleKind {
    /// The name resume fingerprints hold (fixed: saved runs compare it).
    pub fn fingerprint_name(self) -> &'static str {
        match self {
            ScheduleKind::Constant => "Constant",
            ScheduleKind::Step => "Step",
            ScheduleKind::Cosine => "Cosine",
        }
    }
}

/// The LR schedule of a run in optimizer steps: `kind` over `total_steps`
/// (step: times `gamma` every `step_epochs`), after `warmup_epochs` of
/// linear warmup.
pub fn lr_schedule(
    kind: ScheduleKind,
    steps_per_epoch: usize,
    total_steps: usize,
    step_epochs: usize,
    gamma: f32,
    warmup_epochs: usize,
) -> LrSchedule {
    let schedule = match kind {
        ScheduleKind::Constant => Schedule::Constant,
        ScheduleKind::Step => Schedule::Step {
            step_size: step_epochs * steps_per_epoch,
            gamma,
        },
        ScheduleKind::Cosine => Schedule::Cosine {
            total_steps,
            min_lr: 0.0,
        },
    };
    let mut lr_schedule = LrSchedule::new(schedule);
    if warmup_epochs > 0 {
        lr_schedule = lr_schedule.with_warmup(warmup_epochs * steps_per_epoch);
    }
    lr_schedule
}
