//! `memfit bench step`: warm-up and timed training steps (forward,
//! backward, SGD) of one model on one fixed synthetic batch, under a memory
//! plan, with the tracked peak per category and the prediction beside it.

use std::io::Write;
use std::rc::Rc;
use std::time::Instant;

use super::outln;
use crate::data::SyntheticGratings;
use crate::dist::{Collective, Single};
use crate::error::{Error, Result};
use crate::memory::{MemoryStats, Pool, fmt_bytes};
use crate::nn::{BnPolicy, Precision, ResNet};
use crate::optim::Sgd;
use crate::plan::{PlanRequest, Simulation, resolve};
use crate::setup::{ModelSpec, bf16_emulation_note, gpu_memory_line, parse_precision, pick_device};
use crate::train::step::{StepPolicy, TrainStep};
use crate::train::{NanPolicy, Optimizer};

/// What to time. The plan, time model and precision are the flags' text
/// (`segments:4`, `flops`, `auto`), parsed where the step reaches them.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOptions {
    pub model: ModelSpec,
    pub image_size: usize,
    pub batch_size: usize,
    /// Timed steps.
    pub steps: usize,
    /// Untimed steps first (buffers are allocated in the first one).
    pub warmup: usize,
    /// The pool's hard budget, bytes.
    pub memory_budget: Option<usize>,
    /// none, segments:K, stages:..., auto.
    pub checkpoint: String,
    /// Stage times for `auto`: measured or flops.
    pub time_model: String,
    /// Samples per forward/backward (gradients accumulate over the batch).
    pub micro_batch: Option<usize>,
    /// fp32, bf16, f16 or auto.
    pub precision: String,
    pub recompute_bn_relu: bool,
    /// Time per op family too ([`format_profile`]).
    pub profile: bool,
    /// `--device`: cpu, cuda, cuda:N or auto.
    pub device: String,
    /// `--strict-fp32`: no TF32 in fp32 convolutions on a GPU.
    pub strict_fp32: bool,
}

/// What one `bench step` measured.
#[derive(Clone, Debug)]
pub struct StepResult {
    pub plan: String,
    /// Forward FLOPs the plan recomputes over the FLOPs of a plain step
    /// (forward + backward = 3 forwards).
    pub recompute_fraction: f64,
    pub precision: Precision,
    pub micro_batch: usize,
    pub median_seconds: f64,
    pub measured: MemoryStats,
    pub predicted: usize,
    /// The simulation's reserved peak (what the system holds for the pool).
    pub predicted_reserved: usize,
    /// Processes of the run (1 without MPI).
    pub processes: usize,
    /// Median seconds per step rank 0 spent summing gradients, with more
    /// than one process.
    pub allreduce_seconds: Option<f64>,
}

/// Runs warm-up + timed steps of `a` on a fixed synthetic batch, reporting
/// the model, plan, (with `verbose`) every step, allocations and the
/// median time to `out`.
pub fn measure_steps(a: &StepOptions, verbose: bool, out: &mut dyn Write) -> Result<StepResult> {
    measure_steps_on(a, verbose, out, Rc::new(Single))
}

/// [`measure_steps`] as one process of a data-parallel run over `comm`
/// (`mpirun -np N memfit bench step`): `--batch-size` is the global
/// batch, each process trains on its shard and the gradients are summed
/// as in `train`. Images per second are the whole batch's; the time spent
/// summing gradients is reported beside the step time. Only rank 0
/// writes to `out`.
pub fn measure_steps_on(
    a: &StepOptions,
    verbose: bool,
    out: &mut dyn Write,
    comm: Rc<dyn Collective>,
) -> Result<StepResult> {
    if a.batch_size == 0 || a.steps == 0 {
        return Err(Error::Usage(
            "--batch-size and --steps must be at least 1".into(),
        ));
    }
    let (rank, processes) = (comm.rank(), comm.size());
    if a.batch_size < processes {
        return Err(Error::Usage(format!(
            "--batch-size {} is smaller than the {processes} processes: each needs at least one sample",
            a.batch_size
        )));
    }
    let mut sink = std::io::sink();
    let out: &mut dyn Write = if comm.is_root() { out } else { &mut sink };
    let budget = a.memory_budget;
    let device = crate::setup::per_process_device(&a.device, processes);
    let pool = Pool::on(pick_device(
        &device,
        comm.is_root() && verbose,
        a.strict_fp32,
    )?);
    if processes > 1 && pool.device() != crate::device::Device::Cpu && !cfg!(feature = "nccl") {
        return Err(Error::Usage(
            "data-parallel steps on GPUs need NCCL: rebuild with --features nccl, or use --device cpu"
                .into(),
        ));
    }
    // As `memfit train` and the simulation: one segment of the budget from
    // the first allocation.
    pool.shape_segments_by(budget);
    let mut config = a.model.config()?;
    config.target = pool.device().target();
    let fixed_precision = parse_precision(&a.precision)?;
    config.precision = fixed_precision.unwrap_or_default();
    config.recompute_bn_relu = a.recompute_bn_relu;
    let mut model = ResNet::new(&pool, config)?;
    model.check_image_size(a.image_size, a.image_size)?;
    let params = model.param_count();
    let (n, s) = (a.batch_size, a.image_size);
    // This process's samples of the batch, and the most any process has
    // (rank 0's), which the plan is made for.
    let part = crate::dist::shard(n, rank, processes);
    let planned = n.div_ceil(processes);
    outln!(
        out,
        "{} (base width {}, {:?} stem), {params} parameters, batch {n} at {s}x{s}, {} threads{}",
        a.model.name,
        a.model.base_width,
        a.model.stem,
        rayon::current_num_threads(),
        if processes > 1 {
            format!(" per process, {processes} processes ({planned} images each)")
        } else {
            String::new()
        }
    );
    let predicted_saved: usize = model.saved_bytes_per_stage(planned, s, s).iter().sum();
    outln!(
        out,
        "saved activations (closed form): {}",
        fmt_bytes(predicted_saved)
    );

    // A fixed synthetic batch, as the PyTorch baseline uses.
    let data = SyntheticGratings::generate(n, s, a.model.num_classes.min(1000), 1);
    let px = s * s * 3;
    let images = &data.images[part.start * px..part.end * px];
    let labels = data.labels[part.clone()].to_vec();
    let resolved = resolve(&PlanRequest {
        config: &model.config,
        bn: BnPolicy::Batch,
        optimizer: &Optimizer::Sgd(Sgd::new(0.1, 0.9, 0.0, false)),
        batch: planned,
        micro_batch: a.micro_batch,
        image_size: s,
        budget,
        strategy: a.checkpoint.parse()?,
        auto_precision: fixed_precision.is_none(),
        time_model: a.time_model.parse()?,
        processes,
    })?;
    model.set_precision(resolved.precision);
    let (plan, micro) = (resolved.plan.clone(), resolved.micro_batch);
    // The bench runs training steps only: predict those, without evaluation.
    let sgd = Optimizer::Sgd(Sgd::new(0.1, 0.9, 0.0, false));
    let simulated = Simulation {
        training_only: true,
        processes,
        budget,
        ..Simulation::new(&model.config, BnPolicy::Batch, &sgd, &plan, micro, s)
    }
    .run()?;
    let predicted = simulated.peak_total;
    outln!(
        out,
        "plan {plan} at micro-batch {micro}, {}{}; predicted peak {}",
        resolved.precision,
        if resolved.recompute_bn_relu {
            ", BN+ReLU recomputed"
        } else {
            ""
        },
        fmt_bytes(predicted)
    );
    if let Some(why) = &resolved.precision_choice {
        outln!(out, "{why}");
    }
    // On a GPU, the cuDNN algorithm and exact workspace chosen per
    // convolution geometry (planning asked cuDNN for each one), before the
    // steps run: a step that fails still leaves them in the log.
    #[cfg(any(feature = "cuda", feature = "cuda-12"))]
    if a.profile && matches!(pool.device(), crate::device::Device::Cuda(_)) {
        for line in crate::backend::cuda::dnn::conv_choice_lines() {
            outln!(out, "{line}");
        }
    }
    if resolved.precision == Precision::BF16 && pool.device() == crate::device::Device::Cpu {
        outln!(
            out,
            "cpu bf16 arithmetic: {}",
            crate::device::cpu::bf16_path_report()
        );
    }
    if let Some(note) = bf16_emulation_note(resolved.precision).filter(|_| comm.is_root()) {
        eprintln!("{note}");
    }
    pool.set_budget(budget);
    // The training step `train` runs (its NaN checks included), with SGD.
    let mut sgd = Optimizer::Sgd(Sgd::new(0.1, 0.9, 0.0, false));
    let mut trainer = TrainStep::new(
        StepPolicy {
            plan: plan.clone(),
            micro_batch: micro,
            label_smoothing: 0.0,
            clip_grad_norm: None,
            nan_policy: NanPolicy::Stop,
        },
        // As `train` and the simulator: f16 trains with the loss scaler.
        crate::optim::uses_loss_scaler(resolved.precision).then(crate::optim::GradScaler::default),
    )
    .distributed(comm.clone());
    let mut times = Vec::new();
    let mut sync_times = Vec::new();
    let mut timed_from = pool.stats();
    let mut reads_from = crate::backend::host_reads();
    for i in 0..a.warmup + a.steps {
        if i == a.warmup {
            pool.reset_peak();
            timed_from = pool.stats();
            reads_from = crate::backend::host_reads();
            crate::profile::enable(a.profile);
        }
        let t = Instant::now();
        let loss = trainer
            .run(
                &mut model,
                &pool,
                &mut sgd,
                images,
                (s, s),
                &labels,
                n,
                i + 1,
                false,
            )?
            .loss;
        // On a GPU the step returns once its optimizer update is queued:
        // each timed step includes its own update, not the one before.
        crate::backend::synchronize(pool.device())?;
        let secs = t.elapsed().as_secs_f64();
        let kind = if i < a.warmup { "warm-up" } else { "step" };
        if verbose {
            outln!(out, "{kind} {}: loss {loss:.4}, {secs:.3} s", i + 1);
        }
        if i >= a.warmup {
            times.push(secs);
            sync_times.push(trainer.dist.as_ref().map_or(0.0, |d| d.last_sync_secs));
        }
    }
    let total: f64 = times.iter().sum();
    // Memory the cache could not serve: fresh pages cost faults and zeroing.
    let now = pool.stats();
    let fresh = now.system_alloc_bytes - timed_from.system_alloc_bytes;
    let (fresh_n, reused) = (
        now.system_allocs - timed_from.system_allocs,
        now.reuses - timed_from.reuses,
    );
    outln!(
        out,
        "system allocations per timed step: {:.1} ({}); {reused} of {} requests served from the cache",
        fresh_n as f64 / a.steps as f64,
        fmt_bytes(fresh / a.steps),
        reused + fresh_n
    );
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    outln!(
        out,
        "median {median:.3} s/step, {:.2} img/s",
        n as f64 / median
    );
    if let Some(line) = gpu_memory_line(&pool) {
        outln!(out, "{line}");
        // Each read from the device waits for the work queued before it.
        outln!(
            out,
            "reads from the device per timed step: {:.1}",
            (crate::backend::host_reads() - reads_from) as f64 / a.steps as f64
        );
    }
    let sync = if processes > 1 {
        sync_times.sort_by(f64::total_cmp);
        let sync = sync_times[sync_times.len() / 2];
        outln!(
            out,
            "gradient all-reduce (rank 0): median {sync:.3} s/step ({:.0}% of the step), {} in buckets of up to {}",
            100.0 * sync / median.max(1e-12),
            fmt_bytes(4 * model.trainable_count()),
            fmt_bytes(crate::dist::BUCKET_BYTES)
        );
        Some(sync)
    } else {
        None
    };
    if a.profile {
        let totals = crate::profile::totals();
        crate::profile::enable(false);
        // Off the CPU the backend's calls only enqueue work: their host time.
        let host_time = pool.device() != crate::device::Device::Cpu;
        write!(
            out,
            "{}",
            format_profile(&totals, total, a.steps, host_time)
        )
        .map_err(Error::Output)?;
    }
    let stages = &resolved.costs.stages;
    let forward: f64 = stages.iter().map(|st| st.forward_flops).sum();
    let recomputed: f64 = plan
        .segments
        .iter()
        .filter(|seg| seg.recompute)
        .flat_map(|seg| seg.start..seg.end)
        .map(|i| stages[i].forward_flops)
        .sum();
    Ok(StepResult {
        plan: plan.to_string(),
        recompute_fraction: recomputed / (3.0 * forward).max(1.0),
        precision: resolved.precision,
        micro_batch: micro,
        median_seconds: median,
        measured: pool.stats(),
        predicted,
        predicted_reserved: simulated.reserved_peak,
        processes,
        allreduce_seconds: sync,
    })
}

/// The `--profile` table, one line per op family. On the CPU
/// (`host_time` false): seconds per step of the four timed families, share
/// of the step, GFLOP/s where the family does FLOPs, and the untimed rest.
/// On a GPU (`host_time` true): the host time per step every family's
/// calls took to enqueue their work (no synchronisation per op, so launch
/// overhead is what shows), calls per step and microseconds per call; the
/// rest of the step is the wait for the device and host code outside the
/// backend.
pub fn format_profile(
    totals: &[crate::profile::FamilyTotal],
    total: f64,
    steps: usize,
    host_time: bool,
) -> String {
    use crate::profile::Family;
    use std::fmt::Write as _;
    let per = |x: f64| x / steps.max(1) as f64;
    let share = |x: f64| 100.0 * x / total.max(1e-12);
    let mut accounted = 0.0;
    let mut s = String::new();
    if host_time {
        s.push_str(
            "host time per op family (the calls that enqueue the work, no synchronisation per op)\n\
             | op family | host ms/step | share | calls/step | us/call |\n|---|---|---|---|---|\n",
        );
        for t in totals {
            accounted += t.seconds;
            let us = if t.calls > 0 {
                format!("{:.1}", 1e6 * t.seconds / t.calls as f64)
            } else {
                "-".into()
            };
            let _ = writeln!(
                s,
                "| {} | {:.3} | {:.0}% | {:.1} | {us} |",
                t.family.name(),
                1e3 * per(t.seconds),
                share(t.seconds),
                per(t.calls as f64)
            );
        }
        let rest = (total - accounted).max(0.0);
        let _ = writeln!(
            s,
            "| rest (waiting on the device, host code outside the backend) | {:.3} | {:.0}% | - | - |",
            1e3 * per(rest),
            share(rest)
        );
        return s;
    }
    s.push_str("| op family | s/step | share | GFLOP/s |\n|---|---|---|---|\n");
    for t in totals.iter().filter(|t| Family::CPU.contains(&t.family)) {
        accounted += t.seconds;
        let rate = if t.flops > 0.0 && t.seconds > 0.0 {
            format!("{:.1}", t.flops / t.seconds / 1e9)
        } else {
            "-".into()
        };
        let _ = writeln!(
            s,
            "| {} | {:.3} | {:.0}% | {rate} |",
            t.family.name(),
            per(t.seconds),
            share(t.seconds)
        );
    }
    let rest = (total - accounted).max(0.0);
    let _ = writeln!(
        s,
        "| other (ReLU, pooling, add, loss, conversions, optimizer) | {:.3} | {:.0}% | - |",
        per(rest),
        share(rest)
    );
    s
}

#[cfg(test)]
mod tests {
    use super::format_profile;
    use crate::profile::{Family, FamilyTotal};

    fn totals() -> Vec<FamilyTotal> {
        Family::ALL
            .iter()
            .map(|&family| FamilyTotal {
                family,
                seconds: match family {
                    Family::ConvForward => 0.2,
                    Family::Relu => 0.01,
                    Family::DeviceReads => 0.1,
                    _ => 0.0,
                },
                flops: if family == Family::ConvForward {
                    4e9
                } else {
                    0.0
                },
                calls: match family {
                    Family::ConvForward => 100,
                    Family::Relu => 50,
                    Family::DeviceReads => 2,
                    _ => 0,
                },
            })
            .collect()
    }

    /// The CPU's table is unchanged: its four families and the rest.
    #[test]
    fn the_cpu_table_times_its_four_families() {
        let t = format_profile(&totals(), 1.0, 2, false);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 2 + 4 + 1, "{t}");
        assert_eq!(lines[2], "| conv fwd | 0.100 | 20% | 20.0 |");
        assert!(!t.contains("relu |"), "{t}");
        // The rest holds everything the four did not (ReLU's 0.01 too).
        assert_eq!(
            lines[6],
            "| other (ReLU, pooling, add, loss, conversions, optimizer) | 0.400 | 80% | - |"
        );
    }

    /// On a GPU every family is a row of host time, calls and time per
    /// call, and the rest is the wait for the device.
    #[test]
    fn the_gpu_table_shows_host_time_and_calls_per_family() {
        let t = format_profile(&totals(), 1.0, 2, true);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3 + 12 + 1, "{t}");
        assert!(lines[0].starts_with("host time per op family"), "{t}");
        assert_eq!(lines[3], "| conv fwd | 100.000 | 20% | 50.0 | 2000.0 |");
        assert!(t.contains("| relu | 5.000 | 1% | 25.0 | 200.0 |"), "{t}");
        assert!(t.contains("| pool | 0.000 | 0% | 0.0 | - |"), "{t}");
        assert!(
            t.contains("| device reads (wait) | 50.000 | 10% | 1.0 | 50000.0 |"),
            "{t}"
        );
        assert_eq!(
            lines[15],
            "| rest (waiting on the device, host code outside the backend) | 345.000 | 69% | - | - |"
        );
    }
}
