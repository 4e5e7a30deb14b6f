//! Per-machine time model: each stage's forward, timed on this machine.
//!
//! The planner trades memory for recomputed forward time, so what it needs
//! is the real forward seconds of every stage at the planned micro-batch.
//! FLOPs alone mislead once the kernels are fast: the stem's 7×7 conv on
//! three channels, layer1's memory-bound BN and ReLU on large maps and
//! layer4's compute-bound GEMMs run at very different GFLOP/s, so a plan
//! that recomputes fewer modelled FLOPs can be slower (measured: auto at
//! 50% of the no-plan peak ran 4–9% slower than segments:4 with the FLOPs
//! model). Timing is cheap: one untimed and [`TIMED_PASSES`] timed forwards
//! of the chain, the minimum per stage.
//!
//! The forwards run in [`Mode::Recompute`], the mode a recomputed segment
//! replays in, on a fresh model of the same configuration and a pool of its
//! own; nothing of the real model changes. That pool is held to the run's
//! budget: its peak (parameters plus one stage's forward) is below the
//! training peak, which holds parameters and at least one stage's forward.

use std::str::FromStr;
use std::time::Instant;

use crate::backend;
use crate::data::SyntheticGratings;
use crate::error::{Error, Result};
use crate::memory::{Category, Pool, Tag};
use crate::nn::{BnPolicy, Mode, ResNet, ResNetConfig};

/// Timed passes over the chain after one untimed warm-up pass.
pub const TIMED_PASSES: usize = 2;

/// Where the planner's stage times come from (`--time-model`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TimeModel {
    /// Forward of every stage timed on this machine at the planned
    /// micro-batch (about one forward of the model per pass).
    #[default]
    Measured,
    /// FLOPs and saved bytes at fixed rates: no run, the same plan on every
    /// machine.
    Flops,
}

impl FromStr for TimeModel {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "measured" => Ok(TimeModel::Measured),
            "flops" => Ok(TimeModel::Flops),
            _ => Err(Error::invalid(
                "--time-model",
                format!("unknown time model '{s}' (choose measured or flops)"),
            )),
        }
    }
}

/// Forward seconds of every stage of a fresh `config` model for a
/// micro-batch of `micro_batch` synthetic images of `image_size`², in chain
/// order, the minimum over [`TIMED_PASSES`] timed passes.
pub fn stage_forward_seconds(
    config: &ResNetConfig,
    bn: BnPolicy,
    micro_batch: usize,
    image_size: usize,
    budget: Option<usize>,
) -> Result<Vec<f64>> {
    if micro_batch == 0 {
        return Err(Error::invalid("plan", "micro-batch must be at least 1"));
    }
    let pool = Pool::on(config.target.into());
    pool.set_budget(budget);
    let mut model = ResNet::new(&pool, config.clone())?;
    model.set_bn_policy(bn);
    model.check_image_size(image_size, image_size)?;
    let data = SyntheticGratings::generate(
        micro_batch,
        image_size,
        config.num_classes.clamp(1, 1000),
        1,
    );
    let ctx = model.ctx(&pool);
    let mut best = vec![f64::INFINITY; model.stages.len()];
    for pass in 0..=TIMED_PASSES {
        let mut x = pool.from_f32(
            &[micro_batch, image_size, image_size, 3],
            &data.images,
            Category::Data,
            Tag::fixed("calibrate.images"),
        )?;
        for (stage, best) in model.stages.iter_mut().zip(&mut best) {
            // A device that queues kernels must finish the stage before
            // the clock is read (the CPU runs them as they are called).
            backend::synchronize(pool.device())?;
            let t = Instant::now();
            let (y, saved) = stage.forward(&ctx, x, Mode::Recompute)?;
            drop(saved);
            backend::synchronize(pool.device())?;
            let seconds = t.elapsed().as_secs_f64();
            if pass > 0 {
                *best = best.min(seconds);
            }
            x = y;
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_two_models_and_rejects_others() {
        assert_eq!(
            "measured".parse::<TimeModel>().unwrap(),
            TimeModel::Measured
        );
        assert_eq!("flops".parse::<TimeModel>().unwrap(), TimeModel::Flops);
        assert!("fast".parse::<TimeModel>().is_err());
    }

    #[test]
    fn times_every_stage_in_chain_order() {
        let mut config = ResNetConfig::by_name("resnet18").unwrap();
        config.base_width = 8;
        config.num_classes = 10;
        let t = stage_forward_seconds(&config, BnPolicy::Batch, 2, 32, None).unwrap();
        assert_eq!(t.len(), 10, "stem + 8 blocks + head");
        assert!(t.iter().all(|s| s.is_finite() && *s > 0.0), "{t:?}");
    }

    #[test]
    fn is_held_to_the_budget() {
        let mut config = ResNetConfig::by_name("resnet18").unwrap();
        config.base_width = 8;
        let err = stage_forward_seconds(&config, BnPolicy::Batch, 2, 32, Some(1024)).unwrap_err();
        assert!(matches!(err, Error::OutOfBudget(_)), "{err}");
    }
}
