//! The whole run on a shapes-only pool: what `memfit plan` prints, what
//! `memfit train` compares its tracked peak with, and what `auto`'s plans
//! are checked by. The meta pool lays out the arena's blocks as the real
//! pool does, so the prediction covers reserved bytes (fragmentation
//! included), not only live ones.

use crate::device::Device;
use crate::error::Result;
use crate::exec::{BnRollback, LossOptions, Plan, forward_backward};
use crate::memory::{Category, MemoryStats, Pool, Tag};
use crate::nn::{BnPolicy, ResNet, ResNetConfig};
use crate::optim::{GradBuckets, Optimizer, uses_loss_scaler};
use crate::plan::{eval_batch, train_config};

/// One simulated run: two optimizer steps of one micro-batch each (the
/// optimizer state appears after the first) and, unless `training_only`,
/// one evaluation batch.
pub struct Simulation<'a> {
    pub config: &'a ResNetConfig,
    pub bn: BnPolicy,
    pub optimizer: &'a Optimizer,
    pub plan: &'a Plan,
    pub micro_batch: usize,
    pub image_size: usize,
    /// Training steps only (`memfit bench step`), no evaluation batch.
    pub training_only: bool,
    /// Processes of a data-parallel run: with more than one, the gradient
    /// all-reduce buckets are live from the first step's end, as
    /// `train::dist::GradSync` allocates them.
    pub processes: usize,
    /// The run's `--memory-budget`: the arena's segments are shaped by it
    /// from the first allocation, as the real run's pool is (one segment
    /// of the budget), so `reserved_peak` is the real one. Nothing is
    /// refused at the budget: the statistics say how far the run goes over.
    pub budget: Option<usize>,
}

impl<'a> Simulation<'a> {
    /// A single-process run with evaluation and no budget.
    pub fn new(
        config: &'a ResNetConfig,
        bn: BnPolicy,
        optimizer: &'a Optimizer,
        plan: &'a Plan,
        micro_batch: usize,
        image_size: usize,
    ) -> Self {
        Simulation {
            config,
            bn,
            optimizer,
            plan,
            micro_batch,
            image_size,
            training_only: false,
            processes: 1,
            budget: None,
        }
    }

    /// The run's statistics: the predicted peak per category and the
    /// reserved peak, exactly as the real run will allocate.
    pub fn run(&self) -> Result<MemoryStats> {
        let config = self.config;
        let pool = Pool::on(Device::Meta(config.target));
        pool.record_peak_buffers(true);
        // As `memfit train` and `bench step` shape their pools.
        pool.shape_segments_by(self.budget);
        let mut model = ResNet::new(&pool, train_config(config))?;
        model.set_bn_policy(self.bn);
        model.check_image_size(self.image_size, self.image_size)?;
        let mut opt = self.optimizer.fresh();
        // As `train::TrainStep`, before the first forward.
        opt.allocate_state(&pool, &mut model)?;
        let labels = vec![0; self.micro_batch];
        let mut buckets = None;
        // As `train::TrainStep`: without a loss scaler the step holds a
        // roll-back copy of the BN statistics (pool bytes on a GPU) until
        // its finite checks pass.
        let mut rollback = BnRollback::default();
        let rolls_back = !uses_loss_scaler(config.precision);
        for _ in 0..2 {
            model.zero_grad();
            if rolls_back {
                rollback.save(&pool, &mut model)?;
            }
            let images = pool.empty_f32(
                &[self.micro_batch, self.image_size, self.image_size, 3],
                Category::Data,
                Tag::fixed("batch.images"),
            )?;
            forward_backward(
                &mut model,
                &pool,
                self.plan,
                images,
                &labels,
                LossOptions::default(),
            )?;
            rollback.release();
            if self.processes > 1 && buckets.is_none() {
                buckets = Some(GradBuckets::new(&pool, model.trainable_count())?);
            }
            opt.step(&pool, &mut model)?;
        }
        if !self.training_only {
            eval_batch(&mut model, &pool, self.micro_batch, self.image_size)?;
        }
        drop(buckets);
        Ok(pool.stats())
    }
}

/// [`Simulation::run`] of a single-process run with evaluation, no budget.
pub fn simulate(
    config: &ResNetConfig,
    bn: BnPolicy,
    optimizer: &Optimizer,
    plan: &Plan,
    micro_batch: usize,
    image_size: usize,
) -> Result<MemoryStats> {
    Simulation::new(config, bn, optimizer, plan, micro_batch, image_size).run()
}

/// [`simulate`] without the evaluation batch: what `memfit bench step`
/// (training steps only) allocates.
pub fn simulate_training(
    config: &ResNetConfig,
    bn: BnPolicy,
    optimizer: &Optimizer,
    plan: &Plan,
    micro_batch: usize,
    image_size: usize,
) -> Result<MemoryStats> {
    Simulation {
        training_only: true,
        ..Simulation::new(config, bn, optimizer, plan, micro_batch, image_size)
    }
    .run()
}
