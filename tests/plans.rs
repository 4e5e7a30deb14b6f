//! Checkpoint plans: recomputation is exact (bit-identical gradients, BN
//! buffers advanced once), the shapes-only simulation and the composed cost
//! model predict the measured peak, and the budget DP beats uniform plans.

mod common;

use memfit::exec::{LossOptions, Plan, Segment, forward_backward, forward_eval};
use memfit::memory::{Category, MemoryStats, Pool, Tag};
use memfit::nn::{BlockKind, BnPolicy, Precision, ResNet, ResNetConfig, StateSlot, StemKind};
use memfit::optim::{Optimizer, Sgd};
use memfit::plan::{
    CostModel, Simulation, Strategy, TimeModel, segments_plan, simulate, stages_plan,
};

/// Every state_dict entry and every gradient, as raw bits.
fn snapshot(model: &mut ResNet) -> Vec<(String, Vec<u32>)> {
    let mut out = Vec::new();
    model.visit_state(|slot| match slot {
        StateSlot::Param { param, .. } => {
            out.push((
                param.name.clone(),
                param.value.f32().iter().map(|v| v.to_bits()).collect(),
            ));
            out.push((
                format!("{}.grad", param.name),
                param.grad.f32().iter().map(|v| v.to_bits()).collect(),
            ));
        }
        StateSlot::Buffer { name, tensor } => {
            let data = tensor.f32();
            out.push((name, data.iter().map(|v| v.to_bits()).collect()))
        }
        StateSlot::Count { name, value } => out.push((name, vec![*value as u32])),
    });
    out
}

/// Two forward/backward passes (so running stats advance twice) under
/// `plan`; returns the losses and the snapshot.
fn run(config: &ResNetConfig, plan: &Plan) -> (Vec<f64>, Vec<(String, Vec<u32>)>) {
    let pool = Pool::new();
    let mut model = ResNet::new(&pool, config.clone()).unwrap();
    let mut losses = Vec::new();
    for seed in [3, 4] {
        let (images, labels) = common::batch(&pool, seed, 3, 32, 32, 10);
        let out = forward_backward(
            &mut model,
            &pool,
            plan,
            images,
            &labels,
            LossOptions::default(),
        )
        .unwrap();
        losses.push(out.loss);
    }
    (losses, snapshot(&mut model))
}

fn stage_names(config: &ResNetConfig) -> Vec<String> {
    let pool = Pool::shapes_only();
    let model = ResNet::new(&pool, config.clone()).unwrap();
    model.stages.iter().map(|s| s.name()).collect()
}

fn sgd() -> Optimizer {
    Optimizer::Sgd(Sgd::new(0.1, 0.9, 5e-4, false))
}

fn plans_for(config: &ResNetConfig, micro: usize) -> Vec<(String, Plan)> {
    let names = stage_names(config);
    let n = names.len();
    let costs = CostModel::measure(config, BnPolicy::Batch, &sgd(), micro, 32).unwrap();
    let mut plans = vec![(
        "none".to_string(),
        Plan::from_flags(&vec![false; n], &vec![false; n]),
    )];
    for k in [2, 3, 4] {
        plans.push((format!("segments:{k}"), segments_plan(&costs, k)));
    }
    let stage_lists: &[&[&str]] = &[&["layer1", "layer3"], &["stem", "layer2.0"], &["layer4"]];
    for list in stage_lists {
        let wanted: Vec<String> = list.iter().map(|s| s.to_string()).collect();
        plans.push((
            format!("stages:{}", list.join(",")),
            stages_plan(&names, &wanted).unwrap(),
        ));
    }
    // Every stage but the head its own recomputed segment, and one segment
    // for everything but the head.
    let mut starts = vec![true; n];
    starts[n - 1] = false;
    let mut rec = vec![true; n];
    rec[n - 1] = false;
    plans.push(("singletons".into(), Plan::from_flags(&rec, &starts)));
    let mut one = vec![false; n];
    one[0] = true;
    plans.push(("one segment".into(), Plan::from_flags(&rec, &one)));
    plans
}

fn configs() -> Vec<ResNetConfig> {
    vec![
        common::tiny_config(BlockKind::Bottleneck, [2, 1, 2, 1], 8, 10),
        common::tiny_config(BlockKind::Basic, [1, 2, 1, 1], 8, 10),
        ResNetConfig {
            stem: StemKind::Small,
            ..common::tiny_config(BlockKind::Basic, [1, 1, 1, 1], 4, 10)
        },
        // Mixed precision and BN+ReLU recompute: recomputation stays exact
        // and the prediction exact under every storage setting.
        ResNetConfig {
            precision: Precision::BF16,
            ..common::tiny_config(BlockKind::Bottleneck, [1, 2, 1, 1], 8, 10)
        },
        ResNetConfig {
            precision: Precision::F16,
            recompute_bn_relu: true,
            ..common::tiny_config(BlockKind::Basic, [1, 1, 2, 1], 8, 10)
        },
        ResNetConfig {
            recompute_bn_relu: true,
            ..common::tiny_config(BlockKind::Bottleneck, [2, 1, 1, 1], 8, 10)
        },
    ]
}

#[test]
fn every_plan_gives_bit_identical_gradients_and_bn_buffers() {
    for config in configs() {
        let (want_loss, want) = run(&config, &Plan::keep_all_len(stage_names(&config).len()));
        for (name, plan) in plans_for(&config, 3) {
            let (loss, got) = run(&config, &plan);
            assert_eq!(loss, want_loss, "{name}: loss");
            assert_eq!(got.len(), want.len());
            for ((gn, g), (wn, w)) in got.iter().zip(&want) {
                assert_eq!(gn, wn);
                assert!(
                    g == w,
                    "{name} ({plan}): {gn} differs from the plan-free run"
                );
            }
            // Two forwards: num_batches_tracked is 2, never more.
            let count = got
                .iter()
                .find(|(n, _)| n == "bn1.num_batches_tracked")
                .unwrap();
            assert_eq!(count.1, vec![2], "{name}");
        }
    }
}

/// The real run that `simulate` claims to predict: two optimizer steps of
/// one micro-batch each, then one evaluation batch.
fn measured_peak(config: &ResNetConfig, plan: &Plan, micro: usize, size: usize) -> usize {
    measured_stats(config, plan, micro, size, None).peak_total
}

/// [`measured_peak`]'s run with its statistics, its arena shaped by
/// `budget` from the start and the budget enforced from after the model is
/// built (as `memfit train` does).
fn measured_stats(
    config: &ResNetConfig,
    plan: &Plan,
    micro: usize,
    size: usize,
    budget: Option<usize>,
) -> MemoryStats {
    let pool = Pool::new();
    pool.shape_segments_by(budget);
    let mut model = ResNet::new(&pool, config.clone()).unwrap();
    pool.set_budget(budget);
    let mut opt = sgd();
    for seed in [1, 2] {
        model.zero_grad();
        let (images, labels) = common::batch(&pool, seed, micro, size, size, 10);
        forward_backward(
            &mut model,
            &pool,
            plan,
            images,
            &labels,
            LossOptions::default(),
        )
        .unwrap();
        opt.step(&pool, &mut model).unwrap();
    }
    let (images, _) = common::batch(&pool, 9, micro, size, size, 10);
    let logits = forward_eval(&mut model, &pool, images).unwrap();
    let scratch = pool
        .empty_f32(
            logits.dims(),
            Category::Workspace,
            Tag::fixed("eval.d_logits"),
        )
        .unwrap();
    drop((logits, scratch));
    pool.stats()
}

#[test]
fn simulation_and_cost_model_predict_the_measured_peak_exactly() {
    for config in configs() {
        for (micro, size) in [(3, 32), (2, 40)] {
            let costs = CostModel::measure(&config, BnPolicy::Batch, &sgd(), micro, size).unwrap();
            for (name, plan) in plans_for(&config, micro) {
                let measured = measured_peak(&config, &plan, micro, size);
                let simulated = simulate(&config, BnPolicy::Batch, &sgd(), &plan, micro, size)
                    .unwrap()
                    .peak_total;
                let composed = costs.predict(&plan);
                assert_eq!(
                    simulated, measured,
                    "{name} micro {micro} size {size}: simulation"
                );
                assert_eq!(
                    composed, measured,
                    "{name} micro {micro} size {size}: cost model"
                );
            }
        }
    }
}

/// The simulator lays out the arena's blocks as the real pool does. A
/// ResNet-50 on small images under a budget at its live peak: its one
/// segment leaves no slack, so fragmentation takes segments beyond it, and
/// the reserved peak and the segments asked of the system must be the real
/// run's.
#[test]
fn simulation_predicts_the_reserved_memory_and_its_fragmentation() {
    let config = ResNetConfig::resnet50();
    let (micro, size) = (2, 32);
    let n = stage_names(&config).len();
    let costs = CostModel::measure(&config, BnPolicy::Batch, &sgd(), micro, size).unwrap();
    let mut over = 0;
    for plan in [Plan::keep_all_len(n), segments_plan(&costs, 3)] {
        let unbounded = simulate(&config, BnPolicy::Batch, &sgd(), &plan, micro, size).unwrap();
        for budget in [None, Some(unbounded.peak_total)] {
            let measured = measured_stats(&config, &plan, micro, size, budget);
            let simulated = Simulation {
                budget,
                ..Simulation::new(&config, BnPolicy::Batch, &sgd(), &plan, micro, size)
            }
            .run()
            .unwrap();
            assert_eq!(
                (simulated.reserved_peak, simulated.system_allocs),
                (measured.reserved_peak, measured.system_allocs),
                "{plan} budget {budget:?}: reserved peak and segments"
            );
            assert_eq!(simulated.peak_total, measured.peak_total, "{plan}");
            over += usize::from(budget.is_some_and(|b| measured.reserved_peak > b));
        }
    }
    assert!(over > 0, "no run went over its budget's reserve");
}

#[test]
fn recompute_plans_lower_the_peak() {
    let config = common::tiny_config(BlockKind::Bottleneck, [2, 2, 2, 2], 8, 10);
    // Large enough images that activations, not the stem's im2col
    // workspace, decide the peak.
    let costs = CostModel::measure(&config, BnPolicy::Batch, &sgd(), 8, 96).unwrap();
    let none = costs.predict(&segments_plan(&costs, 1));
    let two = costs.predict(&segments_plan(&costs, 2));
    let four = costs.predict(&segments_plan(&costs, 4));
    assert!(two < none, "segments:2 {two} vs none {none}");
    assert!(four < none, "segments:4 {four} vs none {none}");
}

#[test]
fn dp_is_never_worse_than_uniform_segments_and_monotone_in_budget() {
    let config = common::tiny_config(BlockKind::Bottleneck, [2, 2, 3, 2], 8, 10);
    let costs = CostModel::measure(&config, BnPolicy::Batch, &sgd(), 4, 32).unwrap();
    for k in 1..=6 {
        let uniform = segments_plan(&costs, k);
        let budget = costs.predict(&uniform);
        let best = costs
            .best_plan(budget)
            .expect("the uniform plan itself fits");
        assert!(best.peak <= budget, "k={k}: {} > {budget}", best.peak);
        assert!(
            best.recompute_seconds <= costs.recompute_seconds(&uniform) + 1e-12,
            "k={k}: dp {} s vs uniform {} s",
            best.recompute_seconds,
            costs.recompute_seconds(&uniform)
        );
    }
    let min = costs.min_peak();
    assert!(costs.best_plan(min).is_some());
    assert!(costs.best_plan(min - 1).is_none());
    let none = costs.predict(&segments_plan(&costs, 1));
    let mut last = f64::INFINITY;
    for i in 0..=10 {
        let budget = min + (none - min) * i / 10;
        let c = costs.best_plan(budget).unwrap();
        assert!(c.peak <= budget);
        assert!(c.recompute_seconds <= last + 1e-12, "budget {budget}");
        last = c.recompute_seconds;
    }
    assert_eq!(last, 0.0, "the plan-free peak needs no recomputation");
}

#[test]
fn a_budget_below_the_smallest_plan_is_refused_with_the_size_that_fits() {
    let config = common::tiny_config(BlockKind::Basic, [1, 1, 1, 1], 8, 10);
    let auto = |budget, time| {
        memfit::plan::auto_plan(&config, BnPolicy::Batch, &sgd(), 8, None, 32, budget, time)
    };
    let err = auto(1000, TimeModel::Flops).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("too small") && msg.contains("smallest plan needs"),
        "{msg}"
    );
    let memfit::Error::BudgetTooSmall { needed, .. } = err else {
        panic!("{msg}")
    };
    for time in [TimeModel::Flops, TimeModel::Measured] {
        let (ok, costs) = auto(needed, time).unwrap();
        assert!(ok.peak <= needed);
        assert_eq!(ok.micro_batch, 1);
        // Timing runs a real forward held to the budget; it fits, since
        // the training peak holds the same parameters and a stage forward.
        assert_eq!(costs.is_calibrated(), time == TimeModel::Measured);
    }
}

/// Every plan of a chain of `n` stages: each split of the chain into
/// segments, each segment kept or recomputed, the last stage (the head)
/// never recomputed.
fn all_plans(n: usize) -> Vec<Plan> {
    let mut plans = Vec::new();
    for cuts in 0u32..1 << (n - 1) {
        let mut bounds = vec![0];
        bounds.extend((1..n).filter(|i| cuts & (1 << (i - 1)) != 0));
        bounds.push(n);
        let segs = bounds.len() - 1;
        for flags in 0u32..1 << segs {
            let segments: Vec<Segment> = (0..segs)
                .map(|j| Segment {
                    start: bounds[j],
                    end: bounds[j + 1],
                    recompute: flags & (1 << j) != 0,
                })
                .collect();
            if segments.last().is_some_and(|s| s.recompute) {
                continue;
            }
            plans.push(Plan { segments });
        }
    }
    plans
}

/// With measured stage times (here: arbitrary ones, as a machine may give)
/// the DP still finds the fastest plan that fits, checked against every
/// plan of the chain, at every budget between the smallest and no plan.
#[test]
fn dp_with_any_stage_times_matches_brute_force() {
    let config = common::tiny_config(BlockKind::Basic, [1, 2, 1, 1], 8, 10);
    let mut costs = CostModel::measure(&config, BnPolicy::Batch, &sgd(), 4, 32).unwrap();
    let n = costs.stages.len();
    let plans = all_plans(n);
    assert!(plans.len() > 100, "{} plans", plans.len());
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..6 {
        let times: Vec<f64> = (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                1e-3 * (1 + state % 1000) as f64
            })
            .collect();
        costs.set_measured_seconds(&times).unwrap();
        let min = costs.min_peak();
        let none = costs.predict(&Plan::keep_all_len(n));
        for i in 0..=8 {
            let budget = min + (none - min) * i / 8;
            let best = costs.best_plan(budget).expect("min_peak fits");
            let brute = plans
                .iter()
                .filter(|p| costs.predict(p) <= budget)
                .map(|p| costs.recompute_seconds(p))
                .fold(f64::INFINITY, f64::min);
            assert!(best.peak <= budget);
            assert!(
                (best.recompute_seconds - brute).abs() < 1e-9,
                "round {round} budget {budget}: dp {} s, best plan {brute} s",
                best.recompute_seconds
            );
        }
    }
    assert!(costs.set_measured_seconds(&[1.0]).is_err());
}

#[test]
fn strategies_parse_and_bad_ones_are_explained() {
    assert_eq!("none".parse::<Strategy>().unwrap(), Strategy::None);
    assert_eq!("auto".parse::<Strategy>().unwrap(), Strategy::Auto);
    assert_eq!(
        "segments:4".parse::<Strategy>().unwrap(),
        Strategy::Segments(4)
    );
    assert_eq!(
        "stages:layer1, layer3.2".parse::<Strategy>().unwrap(),
        Strategy::Stages(vec!["layer1".into(), "layer3.2".into()])
    );
    for bad in ["segments:0", "segments:x", "stages:", "sometimes"] {
        let msg = bad.parse::<Strategy>().unwrap_err().to_string();
        assert!(msg.contains(bad) && msg.contains("segments:K"), "{msg}");
    }
    let names = stage_names(&configs()[0]);
    let msg = stages_plan(&names, &["layer9".into()])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("layer9") && msg.contains("layer1.0-1"),
        "{msg}"
    );
    let msg = stages_plan(&names, &["head".into()])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("head"), "{msg}");
    let msg = stages_plan(&names, &["layer1".into(), "layer1.0".into()])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("overlaps"), "{msg}");
}

#[test]
fn plans_are_validated() {
    let n = stage_names(&configs()[1]).len();
    let gap = Plan {
        segments: vec![Segment {
            start: 0,
            end: n - 1,
            recompute: false,
        }],
    };
    assert!(gap.validate(n).is_err());
    let head = Plan {
        segments: vec![Segment {
            start: 0,
            end: n,
            recompute: true,
        }],
    };
    assert!(head.validate(n).unwrap_err().to_string().contains("head"));
}

/// With frozen BN, k micro-batches normalised by the window's sample count
/// give the gradients of one batch of all the samples, uneven splits too.
#[test]
fn accumulation_over_micro_batches_equals_one_batch_with_frozen_bn() {
    let config = common::tiny_config(BlockKind::Basic, [1, 1, 1, 1], 8, 10);
    let grads = |splits: &[usize]| {
        let pool = Pool::new();
        let mut model = ResNet::new(&pool, config.clone()).unwrap();
        model.set_bn_policy(BnPolicy::Frozen);
        let (images, labels) = common::batch(&pool, 5, 5, 32, 32, 10);
        let per = 32 * 32 * 3;
        let plan = Plan::keep_all(&model);
        let mut start = 0;
        let mut loss = 0.0;
        for &m in splits {
            let x = pool
                .from_f32(
                    &[m, 32, 32, 3],
                    &images.f32()[start * per..(start + m) * per],
                    Category::Data,
                    Tag::fixed("micro"),
                )
                .unwrap();
            let out = forward_backward(
                &mut model,
                &pool,
                &plan,
                x,
                &labels[start..start + m],
                LossOptions {
                    label_smoothing: 0.1,
                    window_samples: Some(5),
                    scale: None,
                },
            )
            .unwrap();
            loss += out.loss * m as f64 / 5.0;
            start += m;
        }
        let mut g = Vec::new();
        model.visit_params(|p| g.extend_from_slice(p.grad.f32()));
        (loss, g)
    };
    let (want_loss, want) = grads(&[5]);
    for splits in [&[2, 2, 1][..], &[1, 4], &[3, 2]] {
        let (loss, got) = grads(splits);
        assert!(
            (loss - want_loss).abs() < 1e-6,
            "{splits:?}: {loss} vs {want_loss}"
        );
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            worst <= 1e-5 * scale,
            "{splits:?}: worst {worst} (scale {scale})"
        );
    }
}

#[test]
fn frozen_bn_affine_parameters_are_not_updated() {
    let pool = Pool::new();
    let config = common::tiny_config(BlockKind::Basic, [1, 1, 1, 1], 8, 10);
    let mut model = ResNet::new(&pool, config).unwrap();
    model.set_bn_policy(BnPolicy::Frozen);
    let (images, labels) = common::batch(&pool, 5, 2, 32, 32, 10);
    let plan = Plan::keep_all(&model);
    forward_backward(
        &mut model,
        &pool,
        &plan,
        images,
        &labels,
        LossOptions::default(),
    )
    .unwrap();
    let before = snapshot(&mut model);
    sgd().step(&pool, &mut model).unwrap();
    let after = snapshot(&mut model);
    for ((name, b), (_, a)) in before.iter().zip(&after) {
        let bn_affine =
            name.contains("bn") && !name.contains("running") && !name.contains("num_batches");
        if bn_affine {
            assert!(a == b, "{name} changed");
        } else if name == "conv1.weight" || name == "fc.weight" {
            assert!(a != b, "{name} did not change");
        }
    }
}

/// Closed-form saved bytes of a whole model for 3 images of 32×32.
fn saved(c: &ResNetConfig) -> usize {
    ResNet::new(&Pool::shapes_only(), c.clone())
        .unwrap()
        .saved_bytes_per_stage(3, 32, 32)
        .iter()
        .sum()
}

/// Recomputing BN+ReLU outputs in backward runs the forward's kernel on the
/// forward's inputs, so gradients and buffers are bit-identical to keeping
/// them, at every precision; the saved bytes drop by the BN+ReLU outputs.
#[test]
fn bn_relu_recompute_is_exact_and_saves_its_outputs() {
    for block in [BlockKind::Basic, BlockKind::Bottleneck] {
        for precision in Precision::ALL {
            let keep = ResNetConfig {
                precision,
                ..common::tiny_config(block, [1, 1, 1, 1], 8, 10)
            };
            let cheap = ResNetConfig {
                recompute_bn_relu: true,
                ..keep.clone()
            };
            let n = stage_names(&keep).len();
            let (lk, sk) = run(&keep, &Plan::keep_all_len(n));
            let (lc, sc) = run(&cheap, &Plan::keep_all_len(n));
            assert_eq!(lk, lc, "{block:?} {precision}: loss");
            assert!(sk == sc, "{block:?} {precision}: state differs");
            assert!(
                saved(&cheap) < saved(&keep),
                "{block:?} {precision}: nothing saved"
            );
        }
    }
}

/// Forward + backward of one batch with running BN statistics (a smooth
/// function of the input: batch statistics of 3 images at 1×1 resolution
/// amplify any rounding chaotically, which says nothing about precision).
fn run_frozen_bn(config: &ResNetConfig) -> Vec<(String, Vec<u32>)> {
    let pool = Pool::new();
    let mut model = ResNet::new(&pool, config.clone()).unwrap();
    model.set_bn_policy(BnPolicy::Frozen);
    let (images, labels) = common::batch(&pool, 3, 4, 32, 32, 10);
    let plan = Plan::keep_all_len(model.stages.len());
    forward_backward(
        &mut model,
        &pool,
        &plan,
        images,
        &labels,
        LossOptions::default(),
    )
    .unwrap();
    snapshot(&mut model)
}

/// Mixed precision stores what the backward needs in two bytes per value
/// (the closed form says so), and its gradients differ from fp32's by
/// rounding of the low type's size: the error is small where the backward
/// starts (fc), grows through the chain (d_logits sums to zero, so every
/// later gradient is a cancelling sum of rounded terms, as in PyTorch's
/// autocast), and scales with the mantissa: f16 (11 bits) is several times
/// closer than bf16 (8 bits). A wrong computation would not track that.
#[test]
fn low_precision_halves_saved_activations_and_tracks_fp32_gradients() {
    let base = common::tiny_config(BlockKind::Bottleneck, [1, 1, 1, 1], 8, 10);
    let want = run_frozen_bn(&base);
    let bits = |v: &[u32]| {
        v.iter()
            .map(|&b| f32::from_bits(b) as f64)
            .collect::<Vec<_>>()
    };
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    // (precision, max fc.weight error, max overall conv error)
    let mut overall = Vec::new();
    for (precision, fc_tol, conv_tol) in
        [(Precision::BF16, 0.02, 0.25), (Precision::F16, 0.005, 0.06)]
    {
        let config = ResNetConfig {
            precision,
            ..base.clone()
        };
        // Only the BN statistics (f32) and the ReLU masks (bits) stay.
        let (lo, hi) = (saved(&config), saved(&base));
        assert!(
            lo * 2 > hi && (lo as f64) < 0.52 * hi as f64,
            "{precision}: saved {lo} vs fp32 {hi}"
        );
        let got = run_frozen_bn(&config);
        let (mut d2, mut w2) = (0.0, 0.0);
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            if !name.ends_with("weight.grad") {
                continue;
            }
            let (g, w) = (bits(g), bits(w));
            let diff: Vec<f64> = g.iter().zip(&w).map(|(a, b)| a - b).collect();
            let rel = norm(&diff) / norm(&w).max(1e-30);
            if name == "fc.weight.grad" {
                assert!(rel < fc_tol && rel > 0.0, "{precision} fc: {rel}");
            } else if norm(&w) > 0.0 && name.contains("conv") {
                d2 += norm(&diff).powi(2);
                w2 += norm(&w).powi(2);
            }
        }
        let rel = (d2 / w2).sqrt();
        assert!(rel < conv_tol && rel > 0.0, "{precision} convs: {rel}");
        overall.push(rel);
    }
    assert!(
        overall[1] * 3.0 < overall[0],
        "f16 error {} should be well below bf16's {}",
        overall[1],
        overall[0]
    );
}

/// The optimizer's state is allocated before the first forward
/// (`Optimizer::allocate_state`, as `train::TrainStep` does): after the
/// first step the pool asks the system for nothing more. ResNet-50 bf16 at
/// 224², batch 16, on the meta device (the same blocks as on the CPU).
/// With SGD's momentum allocated lazily at the first step instead, it took
/// the space the backward had just freed, and the pool grew by a segment in
/// a later step.
#[test]
fn after_the_first_step_the_pool_asks_the_system_for_nothing() {
    let config = ResNetConfig {
        precision: Precision::BF16,
        ..ResNetConfig::resnet50()
    };
    let pool = Pool::shapes_only();
    let mut model = ResNet::new(&pool, config).unwrap();
    let plan = Plan::keep_all(&model);
    let mut opt = sgd();
    let mut after_first = None;
    for step in 0..5 {
        opt.allocate_state(&pool, &mut model).unwrap();
        model.zero_grad();
        let images = pool
            .empty_f32(&[16, 224, 224, 3], Category::Data, Tag::fixed("images"))
            .unwrap();
        forward_backward(
            &mut model,
            &pool,
            &plan,
            images,
            &[0; 16],
            LossOptions::default(),
        )
        .unwrap();
        opt.step(&pool, &mut model).unwrap();
        let allocs = pool.stats().system_allocs;
        let first = *after_first.get_or_insert(allocs);
        assert_eq!(allocs, first, "step {step} asked the system again");
    }
}

/// Allocating the optimizer's state before the first step changes no bit:
/// the first SGD step still sets `buf = g`, AdamW's moments start at zero.
#[test]
fn optimizer_state_allocated_early_gives_the_same_weights() {
    let config = configs().remove(0);
    let adamw = || {
        Optimizer::AdamW(memfit::optim::AdamW::with_params(
            1e-3,
            (0.9, 0.999),
            1e-8,
            0.01,
        ))
    };
    for make in [sgd as fn() -> Optimizer, adamw] {
        let train = |early: bool| {
            let pool = Pool::new();
            let mut model = ResNet::new(&pool, config.clone()).unwrap();
            let plan = Plan::keep_all(&model);
            let mut opt = make();
            for seed in [5, 6] {
                if early {
                    opt.allocate_state(&pool, &mut model).unwrap();
                }
                model.zero_grad();
                let (images, labels) = common::batch(&pool, seed, 3, 32, 32, 10);
                forward_backward(
                    &mut model,
                    &pool,
                    &plan,
                    images,
                    &labels,
                    LossOptions::default(),
                )
                .unwrap();
                opt.step(&pool, &mut model).unwrap();
            }
            snapshot(&mut model)
        };
        assert_eq!(train(true), train(false));
    }
}
