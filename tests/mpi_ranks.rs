//! Data-parallel training on MPI (feature `mpi`), run by `.ci/run` under
//! `mpirun -np 2` and `-np 3` (no test harness: MPI is initialised once per
//! process; every rank runs this `main`). A tiny ResNet trains a few steps
//! on 30 images in global batches of 12 (windows 12, 12 and an uneven 6):
//! - every rank ends with bitwise the same weights, BN running statistics
//!   and epoch reports;
//! - the weights equal one process doing gradient accumulation over the
//!   same shards (one micro-batch per shard, each with its own BN batch
//!   statistics): bitwise with 2 ranks, within 1e-5 relative with 3 (see
//!   [`steps`]).
//!
//! - a configuration that differs on one rank is refused on every rank.
//!
//! Every check is agreed on by all ranks before any of them exits, so a
//! failure ends every rank (exit code 1) rather than leaving one waiting.
//! Run alone (`cargo test --features mpi --test mpi_ranks`), it is a world
//! of one.

mod common;

use memfit::data::{Dataset, Loader, SyntheticGratings};
use memfit::dist::shard;
use memfit::exec::Plan;
use memfit::memory::Pool;
use memfit::nn::{BlockKind, ResNet, StateSlot};
use memfit::optim::{LrSchedule, Optimizer, Schedule, Sgd};
use memfit::train::dist::any_rank;
use memfit::train::step::{StepPolicy, TrainStep};
use memfit::train::{NanPolicy, TrainOptions, fit_distributed};

const N: usize = 30;
const BATCH: usize = 12;
const LR: f32 = 0.05;
/// Optimizer steps compared with one process: with 2 ranks both epochs
/// (6 steps), bitwise; with 3, the first epoch (3 steps, the uneven window
/// included): the 3-term sum rounds in another order than accumulation
/// (6e-8 relative after one step) and BN over small shards amplifies that
/// step by step (1e-6 after 3 steps, 2e-2 after 6).
fn steps(size: usize) -> usize {
    if size <= 2 { 6 } else { 3 }
}

fn options(shuffle: bool, epochs: usize) -> TrainOptions {
    TrainOptions {
        epochs,
        max_steps: None,
        progress: false,
        batch_size: BATCH,
        micro_batch: None,
        plan: None,
        seed: 3,
        shuffle,
        label_smoothing: 0.1,
        base_lr: LR,
        schedule: LrSchedule::new(Schedule::Constant),
        clip_grad_norm: Some(1.0),
        eval_every: 1,
        metrics_jsonl: None,
        metrics_csv: None,
        log_every: None,
        predicted_peak: None,
        memory_trace: None,
        scaler: None,
        inject_inf_steps: Vec::new(),
        workers: 0,
        nan_policy: NanPolicy::Stop,
        saving: None,
        resume_step: 0,
        resume_sums: None,
        stop: None,
    }
}

fn model(pool: &Pool, seed: u64) -> ResNet {
    let mut config = common::tiny_config(BlockKind::Basic, [1, 1, 1, 1], 4, 3);
    config.seed = seed;
    ResNet::new(pool, config).unwrap()
}

fn sgd() -> Optimizer {
    Optimizer::Sgd(Sgd::new(LR, 0.9, 1e-4, false))
}

/// Parameters (and with `buffers`, BN running statistics and counters).
fn state(model: &mut ResNet, buffers: bool) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    model.visit_state(|slot| match slot {
        StateSlot::Param { param, .. } => out.push(param.value.f32().to_vec()),
        StateSlot::Buffer { tensor, .. } if buffers => out.push(tensor.f32().to_vec()),
        StateSlot::Count { value, .. } if buffers => out.push(vec![*value as f32]),
        _ => {}
    });
    out
}

fn hash(v: &[Vec<f32>]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for x in v.iter().flatten() {
        for b in x.to_bits().to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
    }
    h
}

/// One process: gradient accumulation over the shards of every window, one
/// micro-batch per shard, unshuffled.
fn reference(size: usize, data: &dyn Dataset, epochs: usize) -> Vec<Vec<f32>> {
    let pool = Pool::new();
    let mut m = model(&pool, 7);
    let mut opt = sgd();
    let mut trainer = TrainStep::new(
        StepPolicy {
            plan: Plan::keep_all(&m),
            micro_batch: BATCH,
            label_smoothing: 0.1,
            clip_grad_norm: Some(1.0),
            nan_policy: NanPolicy::Stop,
        },
        None,
    );
    let loader = Loader {
        data,
        batch_size: BATCH,
        workers: 0,
    };
    let mut step = 0;
    std::thread::scope(|scope| {
        for epoch in 1..=epochs {
            for batch in loader.epoch(scope, (0..data.len()).collect(), epoch) {
                let b = batch.unwrap();
                let n = b.labels.len();
                // The shards are equal-sized chunks of the window (the
                // windows here are chosen so that they are).
                let first = shard(n, 0, size).len();
                assert!((0..size).all(|r| shard(n, r, size).len() == first || r == size - 1));
                trainer.policy.micro_batch = first;
                if step == steps(size) {
                    break;
                }
                step += 1;
                opt.set_lr(LR);
                trainer
                    .run(
                        &mut m,
                        &pool,
                        &mut opt,
                        &b.images,
                        data.image_hw(),
                        &b.labels,
                        b.labels.len(),
                        step,
                        false,
                    )
                    .unwrap();
            }
        }
    });
    state(&mut m, false)
}

fn main() {
    let comm = memfit::dist::world().unwrap();
    let (rank, size) = (comm.rank(), comm.size());
    let data = SyntheticGratings::generate(N, 16, 3, 5);
    let val = SyntheticGratings::generate(4, 16, 3, 6);
    let mut failures = Vec::new();

    // 1. Shuffled, two epochs, each rank from a different initial model
    //    (rank 0's is broadcast): every rank ends bitwise equal.
    let pool = Pool::new();
    let mut m = model(&pool, 7 + rank as u64);
    let mut opt = sgd();
    let reports = fit_distributed(
        &mut m,
        &pool,
        &mut opt,
        &data,
        &val,
        &options(true, 2),
        comm.clone(),
        |_| {},
    )
    .unwrap();
    let s = state(&mut m, true);
    if !comm.all_equal(hash(&s)).unwrap() {
        failures.push("ranks' weights or BN statistics differ".to_string());
    }
    let r_hash = reports
        .iter()
        .map(|r| r.train_loss.to_bits() ^ r.train_top1.to_bits().rotate_left(17))
        .fold(0u64, |a, b| a.rotate_left(5) ^ b);
    if !comm.all_equal(r_hash).unwrap() {
        failures.push("ranks' epoch reports differ".to_string());
    }

    // 2. Unshuffled: equal to one process accumulating over the shards.
    let pool = Pool::new();
    let mut m = model(&pool, 7);
    let mut opt = sgd();
    let mut o = options(false, 2);
    o.max_steps = Some(steps(size));
    fit_distributed(
        &mut m,
        &pool,
        &mut opt,
        &data,
        &val,
        &o,
        comm.clone(),
        |_| {},
    )
    .unwrap();
    let got = state(&mut m, false);
    let want = reference(size, &data, 2);
    let mut worst = 0.0f64;
    let mut bitwise = true;
    for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
        bitwise &= g.to_bits() == w.to_bits();
        let rel = ((g - w).abs() as f64) / (w.abs() as f64).max(1e-3);
        worst = worst.max(rel);
    }
    let bad = if size <= 2 { !bitwise } else { worst > 1e-5 };
    if any_rank(comm.as_ref(), bad).unwrap() {
        failures.push(format!(
            "{size} ranks vs one process accumulating: bitwise {bitwise}, worst relative {worst:e}"
        ));
    }

    // 3. The startup check: the same configuration passes on every rank; a
    //    different one on any rank fails on every rank (no hang).
    if memfit::dist::check_same_config(comm.as_ref(), "batch_size=12").is_err() {
        failures.push("equal configurations were refused".to_string());
    }
    let differs = format!("batch_size={}", if rank + 1 == size { 13 } else { 12 });
    let r = memfit::dist::check_same_config(comm.as_ref(), &differs);
    if size > 1
        && !r
            .as_ref()
            .is_err_and(|e| e.to_string().contains("different configurations"))
    {
        failures.push(format!("a mismatched configuration was not refused: {r:?}"));
    }

    let failed = any_rank(comm.as_ref(), !failures.is_empty()).unwrap();
    for f in &failures {
        eprintln!("mpi_ranks: rank {rank} of {size}: FAILED: {f}");
    }
    if rank == 0 {
        println!(
            "mpi_ranks: {size} rank(s): {} (vs accumulation: bitwise {bitwise}, worst relative {worst:e})",
            if failed { "FAILED" } else { "ok" }
        );
    }
    comm.barrier().unwrap();
    drop(comm);
    if failed {
        std::process::exit(1);
    }
}
