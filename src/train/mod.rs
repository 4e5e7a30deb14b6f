//! The training loop over an in-memory dataset: shuffled mini-batches, SGD,
//! evaluation after every epoch. (Accumulation, schedules, real data and
//! metrics files come with the training issue.)

use rand::{SeedableRng, rngs::ChaCha8Rng, seq::SliceRandom};

use crate::data::InMemoryDataset;
use crate::error::{Error, Result};
use crate::exec::{LossOptions, Plan, argmax_rows, forward_backward, forward_eval};
use crate::memory::{Category, MemoryStats, Pool, Tag};
use crate::nn::ResNet;
use crate::optim::Sgd;
use crate::tensor::Tensor;

pub struct TrainOptions {
    pub epochs: usize,
    pub batch_size: usize,
    pub seed: u64,
    pub label_smoothing: f32,
}

/// One epoch's summary.
#[derive(Clone, Debug)]
pub struct EpochReport {
    pub epoch: usize,
    pub train_loss: f64,
    pub train_top1: f64,
    pub val_top1: f64,
    pub img_per_s: f64,
    pub memory: MemoryStats,
}

fn gather(pool: &Pool, data: &InMemoryDataset, idx: &[usize]) -> Result<(Tensor, Vec<usize>)> {
    let sz = data.h * data.w * 3;
    let mut t = pool.empty_f32(
        &[idx.len(), data.h, data.w, 3],
        Category::Data,
        Tag::fixed("batch.images"),
    )?;
    for (dst, &i) in t.f32_mut().chunks_exact_mut(sz).zip(idx) {
        dst.copy_from_slice(data.image(i));
    }
    Ok((t, idx.iter().map(|&i| data.labels[i]).collect()))
}

/// Top-1 accuracy with running BN statistics.
pub fn evaluate(
    model: &mut ResNet,
    pool: &Pool,
    data: &InMemoryDataset,
    batch_size: usize,
) -> Result<f64> {
    let mut correct = 0;
    let order: Vec<usize> = (0..data.len()).collect();
    for idx in order.chunks(batch_size) {
        let (images, labels) = gather(pool, data, idx)?;
        let logits = forward_eval(model, pool, images)?;
        let pred = argmax_rows(logits.f32(), model.config.num_classes);
        correct += pred.iter().zip(&labels).filter(|(p, l)| p == l).count();
    }
    Ok(correct as f64 / data.len().max(1) as f64)
}

/// Trains `model` and calls `on_epoch` after each epoch.
pub fn fit(
    model: &mut ResNet,
    pool: &Pool,
    sgd: &mut Sgd,
    train: &InMemoryDataset,
    val: &InMemoryDataset,
    opts: &TrainOptions,
    mut on_epoch: impl FnMut(&EpochReport),
) -> Result<Vec<EpochReport>> {
    if opts.batch_size == 0 {
        return Err(Error::invalid("train", "batch size must be at least 1"));
    }
    if train.is_empty() {
        return Err(Error::invalid("train", "the training set is empty"));
    }
    let plan = Plan::keep_all(model);
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let mut reports = Vec::new();
    let mut step = 0;
    for epoch in 1..=opts.epochs {
        let mut order: Vec<usize> = (0..train.len()).collect();
        order.shuffle(&mut rng);
        let start = std::time::Instant::now();
        let (mut loss_sum, mut correct, mut seen) = (0.0, 0, 0);
        for idx in order.chunks(opts.batch_size) {
            let (images, labels) = gather(pool, train, idx)?;
            model.zero_grad();
            let out = forward_backward(
                model,
                pool,
                &plan,
                images,
                &labels,
                LossOptions {
                    label_smoothing: opts.label_smoothing,
                },
            )?;
            step += 1;
            if !out.loss.is_finite() {
                return Err(Error::NonFiniteLoss {
                    step,
                    loss: out.loss as f32,
                });
            }
            sgd.step(pool, model)?;
            loss_sum += out.loss * idx.len() as f64;
            correct += out.correct;
            seen += idx.len();
        }
        let secs = start.elapsed().as_secs_f64();
        let report = EpochReport {
            epoch,
            train_loss: loss_sum / seen as f64,
            train_top1: correct as f64 / seen as f64,
            val_top1: evaluate(model, pool, val, opts.batch_size)?,
            img_per_s: seen as f64 / secs,
            memory: pool.stats(),
        };
        on_epoch(&report);
        reports.push(report);
    }
    Ok(reports)
}
