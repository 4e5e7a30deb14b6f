//! The `memfit` command line.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

use memfit::data::SyntheticGratings;
use memfit::exec::{LossOptions, Plan, forward_backward};
use memfit::memory::{Category, MemoryStats, Pool, Tag, fmt_bytes, parse_bytes};
use memfit::nn::{ResNet, ResNetConfig};
use memfit::optim::Sgd;
use memfit::train::{TrainOptions, fit};

#[derive(Parser)]
#[command(
    name = "memfit",
    version,
    about = "Train ResNet image classifiers inside a memory budget"
)]
struct Cli {
    /// Worker threads (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train on the built-in dataset (synthetic oriented gratings).
    Train(TrainArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Time forward + backward + SGD steps on synthetic data and report the
    /// tracked memory peak per category.
    Step(StepArgs),
}

#[derive(Args)]
struct ModelArgs {
    /// resnet18, resnet34, resnet50, resnet101 or resnet152.
    #[arg(long, default_value = "resnet50")]
    model: String,
    /// Channels of the stem and layer1 (torchvision: 64).
    #[arg(long, default_value_t = 64)]
    base_width: usize,
    #[arg(long, default_value_t = 1000)]
    num_classes: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Args)]
struct StepArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 224)]
    image_size: usize,
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Untimed steps first (buffers are allocated in the first one).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Refuse to hold more than this many bytes (e.g. 4GiB, 512MB).
    #[arg(long)]
    memory_budget: Option<String>,
}

#[derive(Args)]
struct TrainArgs {
    #[arg(long, default_value = "resnet18")]
    model: String,
    #[arg(long, default_value_t = 16)]
    base_width: usize,
    #[arg(long, default_value_t = 32)]
    image_size: usize,
    /// Classes (orientations) of the synthetic gratings.
    #[arg(long, default_value_t = 6)]
    classes: usize,
    #[arg(long, default_value_t = 3072)]
    train_size: usize,
    #[arg(long, default_value_t = 768)]
    val_size: usize,
    #[arg(long, default_value_t = 4)]
    epochs: usize,
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    #[arg(long, default_value_t = 0.05)]
    lr: f32,
    #[arg(long, default_value_t = 0.9)]
    momentum: f32,
    #[arg(long, default_value_t = 5e-4)]
    weight_decay: f32,
    #[arg(long, default_value_t = 0.0)]
    label_smoothing: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Refuse to hold more than this many bytes (e.g. 4GiB, 512MB).
    #[arg(long)]
    memory_budget: Option<String>,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    if let Some(t) = cli.threads {
        if t == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .context("starting the thread pool")?;
    }
    match cli.command {
        Command::Train(a) => train(a),
        Command::Bench(BenchCommand::Step(a)) => bench_step(a),
    }
}

fn pool_for(budget: &Option<String>) -> Result<Pool> {
    Ok(match budget {
        Some(b) => Pool::with_budget(parse_bytes(b).context("--memory-budget")?),
        None => Pool::new(),
    })
}

/// Peak resident set size of this process, from /proc (Linux only).
fn peak_rss_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn print_memory(stats: &MemoryStats) {
    println!(
        "tracked peak: {} (reserved now {})",
        fmt_bytes(stats.peak_total),
        fmt_bytes(stats.reserved)
    );
    println!("  {:<12} {:>12} {:>12}", "category", "at peak", "own peak");
    for c in Category::ALL {
        println!(
            "  {:<12} {:>12} {:>12}",
            c.name(),
            fmt_bytes(stats.at_peak.get(c)),
            fmt_bytes(stats.peak.get(c))
        );
    }
    if let Some(rss) = peak_rss_bytes() {
        println!("process peak RSS: {}", fmt_bytes(rss));
    }
}

fn bench_step(a: StepArgs) -> Result<()> {
    if a.batch_size == 0 || a.steps == 0 {
        bail!("--batch-size and --steps must be at least 1");
    }
    let pool = pool_for(&a.memory_budget)?;
    let mut config = ResNetConfig::by_name(&a.model.model)?;
    config.base_width = a.model.base_width;
    config.num_classes = a.model.num_classes;
    config.seed = a.model.seed;
    let mut model = ResNet::new(&pool, config)?;
    model.check_image_size(a.image_size, a.image_size)?;
    let params = model.param_count();
    let (n, s) = (a.batch_size, a.image_size);
    println!(
        "{} (base width {}), {params} parameters, batch {n} at {s}x{s}, {} threads",
        a.model.model,
        a.model.base_width,
        rayon::current_num_threads()
    );
    let predicted_saved: usize = model.saved_bytes_per_stage(n, s, s).iter().sum();
    println!(
        "saved activations (closed form): {}",
        fmt_bytes(predicted_saved)
    );

    // A fixed synthetic batch, as the PyTorch baseline uses.
    let data = SyntheticGratings::generate(n, s, a.model.num_classes.min(1000), 1);
    let labels = data.labels.clone();
    let mut sgd = Sgd::new(0.1, 0.9, 0.0, false);
    let plan = Plan::keep_all(&model);
    let mut times = Vec::new();
    for i in 0..a.warmup + a.steps {
        if i == a.warmup {
            pool.reset_peak();
        }
        let images = pool.from_f32(
            &[n, s, s, 3],
            &data.images,
            Category::Data,
            Tag::fixed("batch.images"),
        )?;
        let t = Instant::now();
        model.zero_grad();
        let out = forward_backward(
            &mut model,
            &pool,
            &plan,
            images,
            &labels,
            LossOptions::default(),
        )?;
        sgd.step(&pool, &mut model)?;
        let secs = t.elapsed().as_secs_f64();
        let kind = if i < a.warmup { "warm-up" } else { "step" };
        println!("{kind} {}: loss {:.4}, {secs:.3} s", i + 1, out.loss);
        if i >= a.warmup {
            times.push(secs);
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!("median {median:.3} s/step, {:.2} img/s", n as f64 / median);
    print_memory(&pool.stats());
    Ok(())
}

fn train(a: TrainArgs) -> Result<()> {
    if a.classes < 2 {
        bail!("--classes must be at least 2");
    }
    let pool = pool_for(&a.memory_budget)?;
    let mut config = ResNetConfig::by_name(&a.model)?;
    config.base_width = a.base_width;
    config.num_classes = a.classes;
    config.seed = a.seed;
    let mut model = ResNet::new(&pool, config)?;
    model.check_image_size(a.image_size, a.image_size)?;
    println!(
        "training {} (base width {}, {} parameters) on synthetic gratings: {} classes, {} train / {} val images at {}x{}",
        a.model,
        a.base_width,
        model.param_count(),
        a.classes,
        a.train_size,
        a.val_size,
        a.image_size,
        a.image_size
    );
    let train_set = SyntheticGratings::generate(
        a.train_size,
        a.image_size,
        a.classes,
        a.seed.wrapping_mul(2).wrapping_add(1),
    );
    let val_set = SyntheticGratings::generate(
        a.val_size,
        a.image_size,
        a.classes,
        a.seed.wrapping_mul(2).wrapping_add(2),
    );
    let mut sgd = Sgd::new(a.lr, a.momentum, a.weight_decay, false);
    let opts = TrainOptions {
        epochs: a.epochs,
        batch_size: a.batch_size,
        seed: a.seed,
        label_smoothing: a.label_smoothing,
    };
    let reports = fit(
        &mut model,
        &pool,
        &mut sgd,
        &train_set,
        &val_set,
        &opts,
        |r| {
            println!(
                "epoch {}: train loss {:.4}, train top-1 {:.1}%, val top-1 {:.1}%, {:.0} img/s, tracked peak {}",
                r.epoch,
                r.train_loss,
                100.0 * r.train_top1,
                100.0 * r.val_top1,
                r.img_per_s,
                fmt_bytes(r.memory.peak_total)
            );
        },
    )?;
    if let Some(last) = reports.last() {
        print_memory(&last.memory);
    }
    Ok(())
}
