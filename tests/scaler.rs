//! Non-finite gradients through the training loop. f16 with the dynamic
//! loss scaler: an injected inf (the test hook `inject_inf_steps`) skips
//! exactly that optimizer step and halves the scale; clean steps grow it
//! after the growth interval; the metrics lines record scale, found_inf and
//! skipped. fp32 without a scaler: `NanPolicy::Stop` stops before the inf
//! reaches the weights, `NanPolicy::Skip` drops the step.

mod common;

use memfit::data::SyntheticGratings;
use memfit::memory::Pool;
use memfit::nn::{BlockKind, Precision, ResNet, ResNetConfig, StateSlot};
use memfit::optim::{GradScaler, LrSchedule, Optimizer, Schedule, Sgd};
use memfit::train::{TrainOptions, fit};

fn options(steps: usize, inject: Vec<usize>, metrics: Option<std::path::PathBuf>) -> TrainOptions {
    TrainOptions {
        epochs: 1,
        max_steps: Some(steps),
        progress: false,
        batch_size: 4,
        micro_batch: Some(2),
        plan: None,
        seed: 1,
        shuffle: false,
        label_smoothing: 0.0,
        base_lr: 0.05,
        schedule: LrSchedule::new(Schedule::Constant),
        clip_grad_norm: Some(1.0),
        eval_every: 1,
        metrics_jsonl: metrics,
        metrics_csv: None,
        log_every: None,
        predicted_peak: None,
        memory_trace: None,
        scaler: Some(GradScaler::new(1024.0, 2)),
        inject_inf_steps: inject,
        workers: 0,
        nan_policy: memfit::train::NanPolicy::Stop,
        saving: None,
        resume_step: 0,
        resume_sums: None,
        stop: None,
    }
}

/// Trains `steps` optimizer steps in f16; returns every parameter's bits.
fn train(steps: usize, inject: Vec<usize>, metrics: Option<std::path::PathBuf>) -> Vec<Vec<u32>> {
    let pool = Pool::new();
    let config = ResNetConfig {
        precision: Precision::F16,
        ..common::tiny_config(BlockKind::Basic, [1, 1, 1, 1], 4, 3)
    };
    let mut model = ResNet::new(&pool, config).unwrap();
    let data = SyntheticGratings::generate(24, 16, 3, 5);
    let val = SyntheticGratings::generate(4, 16, 3, 6);
    let mut opt = Optimizer::Sgd(Sgd::new(0.05, 0.9, 0.0, false));
    fit(
        &mut model,
        &pool,
        &mut opt,
        &data,
        &val,
        &options(steps, inject, metrics),
        |_| {},
    )
    .unwrap();
    let mut out = Vec::new();
    model.visit_params(|p| out.push(p.value.f32().iter().map(|v| v.to_bits()).collect()));
    out
}

#[test]
fn an_injected_inf_skips_the_step_and_backs_off_the_scale() {
    let dir = std::env::temp_dir().join(format!("memfit_scaler_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let metrics = dir.join("m.jsonl");
    let _ = std::fs::remove_file(&metrics);
    // Steps 2 and 3 overflow; with growth interval 2, steps 4 and 5 are
    // clean and the scale grows after step 5.
    train(5, vec![2, 3], Some(metrics.clone()));
    let lines: Vec<String> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("{\"step\""))
        .map(String::from)
        .collect();
    assert_eq!(lines.len(), 5);
    // The scale each step's backward used, and whether it was skipped.
    let want = [
        (1024, false),
        (1024, true), // inf: skip, 1024 -> 512
        (512, true),  // inf again: 512 -> 256
        (256, false),
        (256, false), // second clean step in a row: 256 -> 512
    ];
    for (line, (scale, skipped)) in lines.iter().zip(want) {
        assert!(line.contains(&format!("\"scale\":{scale},")), "{line}");
        assert!(
            line.contains(&format!("\"found_inf\":{skipped},\"skipped\":{skipped}")),
            "{line}"
        );
    }
    // A skipped step leaves the weights alone: two skipped steps after the
    // first are the same weights as one step.
    assert_eq!(train(3, vec![2, 3], None), train(1, vec![], None));
    assert_ne!(train(2, vec![], None), train(1, vec![], None));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_a_scaler_a_non_finite_gradient_stops_or_is_skipped() {
    let run = |policy: memfit::train::NanPolicy, steps: usize, inject: Vec<usize>| {
        let pool = Pool::new();
        let config = common::tiny_config(BlockKind::Basic, [1, 1, 1, 1], 4, 3);
        let mut model = ResNet::new(&pool, config).unwrap();
        let data = SyntheticGratings::generate(24, 16, 3, 5);
        let mut opt = Optimizer::Sgd(Sgd::new(0.05, 0.9, 0.0, false));
        let mut o = options(steps, inject, None);
        o.scaler = None;
        o.nan_policy = policy;
        let r = fit(&mut model, &pool, &mut opt, &data, &data, &o, |_| {});
        // Parameters, BN running statistics and counters: a dropped step
        // must leave none of them changed.
        let mut w = Vec::new();
        model.visit_state(|slot| {
            w.push(match slot {
                StateSlot::Param { param, .. } => param
                    .value
                    .f32()
                    .iter()
                    .map(|v| v.to_bits() as u64)
                    .collect(),
                StateSlot::Buffer { tensor, .. } => {
                    tensor.f32().iter().map(|v| v.to_bits() as u64).collect()
                }
                StateSlot::Count { value, .. } => vec![*value as u64],
            })
        });
        (r.map(|_| ()), w)
    };
    use memfit::train::NanPolicy::{Skip, Stop};
    let (r, w) = run(Stop, 3, vec![2]);
    let err = r.unwrap_err().to_string();
    assert!(err.contains("at optimizer step 2"), "{err}");
    assert_eq!(
        w,
        run(Stop, 1, vec![]).1,
        "the inf never reached the weights"
    );
    let (r, w) = run(Skip, 2, vec![2]);
    r.unwrap();
    assert_eq!(w, run(Stop, 1, vec![]).1, "step 2 was skipped");
}

/// Clipping sees unscaled gradients: the gradient norm a step reports (the
/// one clipping compares with its maximum) does not depend on the loss
/// scale, up to f16 rounding. Clipping the scaled gradients would make it
/// grow with the scale (here 16×).
#[test]
fn clipping_happens_after_unscaling() {
    let dir = std::env::temp_dir().join(format!("memfit_clip_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let norm_at = |scale: f32| -> f64 {
        let path = dir.join(format!("m{scale}.jsonl"));
        let _ = std::fs::remove_file(&path);
        let pool = Pool::new();
        let config = ResNetConfig {
            precision: Precision::F16,
            ..common::tiny_config(BlockKind::Basic, [1, 1, 1, 1], 4, 3)
        };
        let mut model = ResNet::new(&pool, config).unwrap();
        let data = SyntheticGratings::generate(8, 16, 3, 5);
        let mut opt = Optimizer::Sgd(Sgd::new(0.05, 0.9, 0.0, false));
        let mut o = options(1, vec![], Some(path.clone()));
        o.scaler = Some(GradScaler::new(scale, 2000));
        fit(&mut model, &pool, &mut opt, &data, &data, &o, |_| {}).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let line = text.lines().find(|l| l.starts_with("{\"step\"")).unwrap();
        let v = line.split("\"grad_norm\":").nth(1).unwrap();
        v[..v.find(',').unwrap()].parse().unwrap()
    };
    let (a, b) = (norm_at(64.0), norm_at(1024.0));
    assert!(
        a > 0.0 && (a - b).abs() <= 0.02 * a,
        "grad norm {a} at scale 64 vs {b} at 1024"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
