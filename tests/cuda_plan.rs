//! Planning for a CUDA device on a machine that may have none: the meta
//! device standing for `Target::Cuda(0)` answers capabilities and workspace
//! sizes (from the probe, or from the documented default when the probe
//! fails), and the simulator runs a whole step on it. Runs here, on the CPU.

#![cfg(any(feature = "cuda", feature = "cuda-12"))]

mod common;

use memfit::device::cuda::{DEFAULT_COMPUTE_CAPABILITY, device_facts};
use memfit::device::{Capabilities, Device, Target};
use memfit::exec::Plan;
use memfit::memory::Category;
use memfit::nn::{BlockKind, BnPolicy};
use memfit::optim::{Optimizer, Sgd};
use memfit::plan::simulate;

fn sgd() -> Optimizer {
    Optimizer::Sgd(Sgd::new(0.1, 0.9, 5e-4, false))
}

#[test]
fn meta_for_cuda_answers_without_a_gpu() {
    let meta = Device::Meta(Target::Cuda(0));
    assert!(!meta.computes());
    assert_eq!(meta.name(), "meta(cuda:0)");
    assert_eq!(meta.target(), Target::Cuda(0));
    assert_eq!(meta.capabilities(), Capabilities::cuda(0));
    let facts = device_facts(0);
    println!("{}", facts.source());
    if facts.probe.is_err() {
        assert_eq!(facts.compute_capability, DEFAULT_COMPUTE_CAPABILITY);
        assert!(facts.source().contains("documented default"));
        assert!(facts.source().contains("9.0"));
    }
    let caps = meta.capabilities();
    assert!(caps.deterministic);
    assert!(
        !caps.native_bf16,
        "the backend runs bf16 as pre-rounded fp32"
    );
}

#[test]
fn the_simulator_plans_a_step_for_a_gpu() {
    let mut cpu = common::tiny_config(BlockKind::Basic, [1, 1, 1, 1], 8, 10);
    let mut gpu = cpu.clone();
    gpu.target = Target::Cuda(0);
    cpu.target = Target::Cpu;
    let (micro, size) = (4, 32);
    let stages = {
        let pool = memfit::memory::Pool::shapes_only();
        memfit::nn::ResNet::new(&pool, cpu.clone())
            .unwrap()
            .stages
            .len()
    };
    let plan = Plan::keep_all_len(stages);
    let on_gpu = simulate(&gpu, BnPolicy::Batch, &sgd(), &plan, micro, size).unwrap();
    let on_cpu = simulate(&cpu, BnPolicy::Batch, &sgd(), &plan, micro, size).unwrap();
    // Same parameters, gradients and optimizer state; the workspaces are
    // the GPU's (cuDNN's, at least the documented default per convolution).
    for c in [Category::Params, Category::Grads, Category::Optimizer] {
        assert_eq!(on_gpu.peak.get(c), on_cpu.peak.get(c), "{c:?}");
    }
    let ws = on_gpu.peak.get(Category::Workspace);
    assert!(
        ws >= memfit::backend::cuda::ops::CUDNN_DEFAULT_WORKSPACE,
        "workspace peak {ws}"
    );
    assert!(on_gpu.peak_total > 0);
}

/// The pool scratch the CUDA arm takes inside an op (BN partial sums, the
/// loss's labels and row sums, the norm's partials, the op's totals) is
/// counted on the meta device standing for a GPU, so a plan's peak holds
/// it; the meta device standing for the CPU counts none.
#[test]
fn meta_for_cuda_counts_the_ops_scratch() {
    use memfit::backend::{self, scratch};
    use memfit::memory::{Pool, Tag};
    use memfit::tensor::Precision;
    for (target, counts) in [(Target::Cuda(0), true), (Target::Cpu, false)] {
        let pool = Pool::on(Device::Meta(target));
        let (rows, c) = (3000, 64);
        let ws = Category::Workspace;
        let x = pool.empty_f32(&[rows, c], ws, Tag::fixed("x")).unwrap();
        let mut stats: Vec<_> = (0..3)
            .map(|_| pool.empty_f32(&[c], ws, Tag::fixed("s")).unwrap())
            .collect();
        let (rstd, rest) = stats.split_last_mut().unwrap();
        let (mean, var) = rest.split_at_mut(1);
        let base = pool.stats().live.get(ws);
        backend::bn_batch_stats(&mut mean[0], &mut var[0], rstd, &x, 1e-5).unwrap();
        let want = if counts {
            scratch::bn_partial(rows, c)
        } else {
            0
        };
        assert_eq!(
            pool.stats().peak.get(ws) - base,
            want,
            "{target:?} bn stats"
        );
        assert_eq!(pool.stats().live.get(ws), base, "scratch freed");
        let mut dx = pool.empty_f32(&[rows, c], ws, Tag::fixed("dx")).unwrap();
        pool.reset_peak();
        let base = pool.stats().live.get(ws);
        backend::bn_backward(
            &mut dx,
            None,
            None,
            &x,
            &x,
            &mean[0],
            rstd,
            &var[0],
            None,
            true,
            Precision::F32,
        )
        .unwrap();
        let want = if counts {
            scratch::bn_partial(rows, c) + scratch::bn_coefs(c)
        } else {
            0
        };
        assert_eq!(
            pool.stats().peak.get(ws) - base,
            want,
            "{target:?} bn backward"
        );
        let (n, classes) = (16, 10);
        let logits = pool.empty_f32(&[n, classes], ws, Tag::fixed("z")).unwrap();
        let mut dz = pool.empty_f32(&[n, classes], ws, Tag::fixed("dz")).unwrap();
        pool.reset_peak();
        let base = pool.stats().live.get(ws);
        let labels: Vec<usize> = (0..n).map(|i| i % classes).collect();
        backend::cross_entropy(&mut dz, &logits, &labels, 0.1, n, None, Precision::F32).unwrap();
        let want = if counts {
            scratch::cross_entropy(n) + scratch::STEP_TOTALS
        } else {
            0
        };
        assert_eq!(pool.stats().peak.get(ws) - base, want, "{target:?} loss");
        assert_eq!(pool.stats().live.get(ws), base);
        // The linear layer's GEMMs: cuBLAS's workspace, from the pool, at
        // cuBLAS's default size for the card (32 MiB + alignment on the
        // default compute capability 9.0).
        let (fin, fout) = (24, 10);
        let x = pool.empty_f32(&[n, fin], ws, Tag::fixed("x")).unwrap();
        let w = pool.empty_f32(&[fout, fin], ws, Tag::fixed("w")).unwrap();
        let b = pool.empty_f32(&[fout], ws, Tag::fixed("b")).unwrap();
        let mut y = pool.empty_f32(&[n, fout], ws, Tag::fixed("y")).unwrap();
        let mut dx = pool.empty_f32(&[n, fin], ws, Tag::fixed("dx")).unwrap();
        let mut dw = pool.empty_f32(&[fout, fin], ws, Tag::fixed("dw")).unwrap();
        let mut db = pool.empty_f32(&[fout], ws, Tag::fixed("db")).unwrap();
        let cc = device_facts(0).compute_capability;
        let want = if counts {
            scratch::cublas_workspace(cc)
        } else {
            0
        };
        if counts && cc.0 >= 9 {
            assert_eq!(want, (32 << 20) + 256);
        }
        pool.reset_peak();
        let base = pool.stats().live.get(ws);
        backend::linear_forward(&mut y, &x, &w, &b, Precision::F32).unwrap();
        assert_eq!(pool.stats().peak.get(ws) - base, want, "{target:?} linear");
        pool.reset_peak();
        backend::linear_backward(&mut dx, &mut dw, &mut db, &y, &x, &w, Precision::F32).unwrap();
        assert_eq!(
            pool.stats().peak.get(ws) - base,
            want,
            "{target:?} linear backward"
        );
        assert_eq!(pool.stats().live.get(ws), base);
    }
}

/// A training step on a GPU reads from the device once: the window's loss
/// and hits, the found-inf (or non-finite) flag and the clipping norm come
/// back together ([`memfit::backend::StepTotals`]). The meta device
/// standing for a GPU counts every read the CUDA arm would make, so this
/// holds the step to it on the CPU: with and without the loss scaler, with
/// accumulation over micro-batches and with clipping. The step's tracked
/// peak is the planner's prediction (the roll-back copy of the BN
/// statistics and the totals are pool bytes the simulator holds too).
#[test]
fn a_gpu_training_step_reads_from_the_device_once() {
    use memfit::backend::host_reads;
    use memfit::memory::Pool;
    use memfit::nn::ResNet;
    use memfit::plan::simulate_training;
    use memfit::tensor::Precision;
    use memfit::train::NanPolicy;
    use memfit::train::step::{StepPolicy, TrainStep};

    let (window, micro, size) = (4, 2, 32);
    for precision in [Precision::F32, Precision::F16, Precision::BF16] {
        let mut config = common::tiny_config(BlockKind::Basic, [1, 1, 1, 1], 8, 10);
        config.target = Target::Cuda(0);
        config.precision = precision;
        let pool = Pool::on(Device::Meta(Target::Cuda(0)));
        let mut model = ResNet::new(&pool, config.clone()).unwrap();
        let plan = Plan::keep_all(&model);
        let mut opt = sgd();
        let scaler =
            memfit::optim::uses_loss_scaler(precision).then(memfit::optim::GradScaler::default);
        let mut step = TrainStep::new(
            StepPolicy {
                plan: plan.clone(),
                micro_batch: micro,
                label_smoothing: 0.1,
                clip_grad_norm: Some(1.0),
                nan_policy: NanPolicy::Stop,
            },
            scaler,
        );
        let images = vec![0.5f32; window * size * size * 3];
        let labels: Vec<usize> = (0..window).map(|i| i % 10).collect();
        for n in 1..=2 {
            let before = host_reads();
            let report = step
                .run(
                    &mut model,
                    &pool,
                    &mut opt,
                    &images,
                    (size, size),
                    &labels,
                    window,
                    n,
                    false,
                )
                .unwrap();
            assert_eq!(
                host_reads() - before,
                1,
                "{precision:?} step {n}: device reads in one optimizer step"
            );
            assert_eq!(report.samples, window);
        }
        let predicted =
            simulate_training(&config, BnPolicy::Batch, &sgd(), &plan, micro, size).unwrap();
        assert_eq!(
            pool.stats().peak_total,
            predicted.peak_total,
            "{precision:?}: tracked peak of two steps against the prediction"
        );
    }
}

/// The whole training loop (loader, steps, evaluation, reports) runs on
/// the meta device standing for a GPU, where any host view of a tensor
/// would panic, and reads from the device once per optimizer step (with
/// accumulation over two micro-batches and clipping, fp32 and f16) plus
/// twice per evaluation batch (its loss and its logits for top-k).
#[test]
fn the_training_loop_runs_for_a_gpu_with_one_read_per_step() {
    use memfit::backend::host_reads;
    use memfit::data::SyntheticGratings;
    use memfit::memory::Pool;
    use memfit::nn::ResNet;
    use memfit::optim::{GradScaler, LrSchedule, Schedule};
    use memfit::tensor::Precision;
    use memfit::train::{NanPolicy, TrainOptions, fit};

    let (train_n, val_n, batch, size) = (24, 10, 8, 32);
    let train = SyntheticGratings::generate(train_n, size, 3, 1);
    let val = SyntheticGratings::generate(val_n, size, 3, 2);
    for precision in [Precision::F32, Precision::F16] {
        let mut config = common::tiny_config(BlockKind::Basic, [1, 1, 1, 1], 4, 3);
        config.target = Target::Cuda(0);
        config.precision = precision;
        let pool = Pool::on(Device::Meta(Target::Cuda(0)));
        let mut model = ResNet::new(&pool, config).unwrap();
        let mut opt = sgd();
        let opts = TrainOptions {
            epochs: 1,
            max_steps: None,
            progress: false,
            batch_size: batch,
            micro_batch: Some(4),
            plan: None,
            seed: 3,
            shuffle: true,
            label_smoothing: 0.1,
            base_lr: 0.1,
            schedule: LrSchedule::new(Schedule::Constant),
            clip_grad_norm: Some(1.0),
            eval_every: 1,
            metrics_jsonl: None,
            metrics_csv: None,
            log_every: None,
            predicted_peak: None,
            memory_trace: None,
            scaler: (precision == Precision::F16).then(GradScaler::default),
            inject_inf_steps: Vec::new(),
            workers: 0,
            nan_policy: NanPolicy::Stop,
            saving: None,
            resume_step: 0,
            resume_sums: None,
            stop: None,
        };
        let before = host_reads();
        let reports = fit(&mut model, &pool, &mut opt, &train, &val, &opts, |_| {}).unwrap();
        let reads = host_reads() - before;
        assert_eq!(reports.len(), 1);
        assert!(reports[0].eval.is_some(), "evaluated");
        // Evaluation runs in micro-batches (what the plan fits).
        let steps = train_n.div_ceil(batch);
        let eval_batches = val_n.div_ceil(4);
        assert_eq!(
            reads,
            (steps + 2 * eval_batches) as u64,
            "{precision:?}: device reads for {steps} steps and {eval_batches} evaluation batches"
        );
    }
}

/// Weights save and load through the backend's host copies: on the meta
/// device standing for a GPU, where a host view panics, a model saves,
/// the file names every tensor, and it loads back (the CPU's names and
/// shapes; the values of a meta model are zeros).
#[test]
fn weights_save_and_load_for_a_gpu() {
    use memfit::io::{TensorFile, load_state_dict, save_state_dict};
    use memfit::memory::Pool;
    use memfit::nn::ResNet;

    let mut config = common::tiny_config(BlockKind::Bottleneck, [1, 1, 1, 1], 4, 3);
    config.target = Target::Cuda(0);
    let pool = Pool::on(Device::Meta(Target::Cuda(0)));
    let mut model = ResNet::new(&pool, config.clone()).unwrap();
    let dir = common::TempDir::new("meta-cuda-weights");
    let path = dir.0.join("w.safetensors");
    save_state_dict(&mut model, &path).unwrap();
    let file = TensorFile::open(&path).unwrap();
    let mut cpu_config = config;
    cpu_config.target = Target::Cpu;
    let mut cpu = ResNet::new(&Pool::new(), cpu_config).unwrap();
    let mut names = 0;
    cpu.visit_state(|slot| {
        assert!(file.tensors.contains_key(slot.name()), "{}", slot.name());
        names += 1;
    });
    assert_eq!(file.tensors.len(), names);
    load_state_dict(&mut model, &file, &[]).unwrap();
}

/// `--checkpoint auto` for a GPU never picks a plan the simulator puts over
/// the budget. Under bf16 on a GPU (no native bf16 GEMM: a replayed stage
/// widens its bf16-stored input to an f32 copy) the per-stage cost model
/// undercounts recomputed segments; auto checks its choice by simulation
/// and plans again below the overshoot. Every budget from a little above
/// the smallest plan to keep-all resolves to a plan within it, or says the
/// budget is too small, never "needs more than the budget".
#[test]
fn auto_plans_for_a_gpu_fit_their_budget_by_simulation() {
    use memfit::plan::{PlanRequest, Strategy, TimeModel, resolve, simulate};
    use memfit::tensor::Precision;
    // ResNet-50 at width 32: large enough activations for the replayed
    // stages' f32 copies to matter (about 25 MiB at 224x224, batch 16).
    let mut config = memfit::nn::ResNetConfig::by_name("resnet50").unwrap();
    config.base_width = 32;
    config.num_classes = 10;
    config.target = Target::Cuda(0);
    config.precision = Precision::BF16;
    let (batch, size) = (16, 224);
    let keep = {
        let pool = memfit::memory::Pool::on(Device::Meta(Target::Cuda(0)));
        let n = memfit::nn::ResNet::new(&pool, config.clone())
            .unwrap()
            .stages
            .len();
        Plan::keep_all_len(n)
    };
    let keep_peak = simulate(&config, BnPolicy::Batch, &sgd(), &keep, batch, size)
        .unwrap()
        .peak_total;
    let (mut resolved, mut too_small) = (0, 0);
    for step in 4..=12 {
        let budget = keep_peak * step / 12;
        let r = resolve(&PlanRequest {
            config: &config,
            bn: BnPolicy::Batch,
            optimizer: &sgd(),
            batch,
            micro_batch: Some(batch),
            image_size: size,
            budget: Some(budget),
            strategy: Strategy::Auto,
            auto_precision: false,
            time_model: TimeModel::Flops,
            processes: 1,
        });
        match r {
            Ok(r) => {
                assert!(
                    r.predicted.peak_total <= budget,
                    "{} > {budget}",
                    r.predicted.peak_total
                );
                resolved += 1;
            }
            Err(memfit::Error::BudgetTooSmall { .. }) => too_small += 1,
            Err(e) => panic!("budget {budget} of keep-all {keep_peak}: {e}"),
        }
    }
    assert!(
        resolved >= 3 && too_small >= 1,
        "{resolved} resolved, {too_small} too small"
    );
}

/// `memfit plan --device cuda` on a machine without a usable GPU plans for
/// one on the meta device (planning on a laptop for a cluster's card) and
/// says what it assumed; `train --device cuda` there still refuses.
#[test]
fn plan_for_a_gpu_this_machine_lacks() {
    let run = |sub: &str| {
        std::process::Command::new(common::memfit_bin())
            .args([
                sub,
                "--device",
                "cuda",
                "--data",
                "synthetic",
                "--model",
                "resnet18",
                "--base-width",
                "8",
                "--batch-size",
                "8",
                "--epochs",
                "1",
                "--memory-budget",
                "64MiB",
                "--checkpoint",
                "auto",
            ])
            .output()
            .unwrap()
    };
    let out = run("plan");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("predicted peak"), "{stdout}");
    if device_facts(0).probe.is_err() {
        assert!(
            stderr.contains("planning for cuda:0 without it"),
            "{stderr}"
        );
        let train = run("train");
        assert!(!train.status.success());
        let err = String::from_utf8_lossy(&train.stderr);
        assert!(err.contains("not found"), "{err}");
    }
}

// ---------------------------------------------------------------------------
// The cuDNN algorithm choice per geometry (backend::cuda::conv_algo): its
// pure part, fed cuDNN-shaped answers, so it is checked without a GPU.

mod conv_algo_choice {
    use std::collections::HashSet;

    use memfit::backend::cuda::conv_algo::{
        Candidate, Choice, ConvKey, Pass, PassLine, algo_name, choose, format_line,
    };
    use memfit::backend::cuda::dnn;
    use memfit::ops::conv2d::ConvGeom;

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Algo {
        A0,
        Pinned,
        A2,
        A3,
        A4,
        A5,
    }

    fn cand(algo: Algo, status: Result<(), &str>, deterministic: bool) -> Candidate<Algo> {
        Candidate {
            algo,
            status: status.map_err(str::to_string),
            deterministic,
            // The ranking's estimate, never what is counted.
            memory_bytes: 999_999,
        }
    }

    #[test]
    fn the_pinned_algorithm_stays_when_cudnn_sizes_it() {
        let c = choose(
            Algo::Pinned,
            Ok(131),
            || panic!("the ranking is asked only after a refusal"),
            |_| panic!("no other workspace query"),
        )
        .unwrap();
        assert_eq!(
            c,
            Choice {
                algo: Algo::Pinned,
                workspace_bytes: 131,
                refused_pinned: None
            }
        );
    }

    #[test]
    fn a_refused_pinned_algorithm_falls_back_to_the_best_deterministic_one() {
        let mut asked = Vec::new();
        let c = choose(
            Algo::Pinned,
            Err("CUDNN_STATUS_NOT_SUPPORTED".into()),
            || {
                // cuDNN's order (fastest expected first).
                Ok(vec![
                    cand(Algo::A3, Ok(()), false),
                    cand(Algo::A0, Err("CUDNN_STATUS_NOT_SUPPORTED"), true),
                    cand(Algo::Pinned, Ok(()), true),
                    cand(Algo::A2, Ok(()), true),
                    cand(Algo::A4, Ok(()), true),
                    cand(Algo::A5, Ok(()), true),
                ])
            },
            |a| {
                asked.push(a);
                match a {
                    Algo::A2 => Err("CUDNN_STATUS_BAD_PARAM".into()),
                    _ => Ok(4096),
                }
            },
        )
        .unwrap();
        assert_eq!(c.algo, Algo::A4);
        // Exactly what the workspace query said, not the ranking's estimate.
        assert_eq!(c.workspace_bytes, 4096);
        let why = c.refused_pinned.unwrap();
        assert!(
            why.contains("Pinned") && why.contains("NOT_SUPPORTED"),
            "{why}"
        );
        // Neither the non-deterministic, the failed nor the pinned one was
        // sized; the search stopped at the first that answered.
        assert_eq!(asked, [Algo::A2, Algo::A4]);
    }

    #[test]
    fn no_usable_algorithm_is_an_error_naming_each_refusal() {
        let e = choose(
            Algo::Pinned,
            Err("CUDNN_STATUS_NOT_SUPPORTED".into()),
            || {
                Ok(vec![
                    cand(Algo::A3, Ok(()), false),
                    cand(Algo::A0, Err("CUDNN_STATUS_NOT_SUPPORTED"), true),
                    cand(Algo::A2, Ok(()), true),
                ])
            },
            |_| Err("CUDNN_STATUS_BAD_PARAM".into()),
        )
        .unwrap_err();
        for part in [
            "pinned Pinned refused (CUDNN_STATUS_NOT_SUPPORTED)",
            "A3: not deterministic",
            "A0: CUDNN_STATUS_NOT_SUPPORTED",
            "A2: workspace query CUDNN_STATUS_BAD_PARAM",
        ] {
            assert!(e.contains(part), "{part:?} missing from {e}");
        }
        let e = choose(
            Algo::Pinned,
            Err("X".into()),
            || Err("CUDNN_STATUS_EXECUTION_FAILED".into()),
            |_| Ok(0),
        )
        .unwrap_err();
        assert!(
            e.contains("ranking failed (CUDNN_STATUS_EXECUTION_FAILED)"),
            "{e}"
        );
        let e = choose(Algo::Pinned, Err("X".into()), || Ok(vec![]), |_| Ok(0)).unwrap_err();
        assert!(e.contains("none offered"), "{e}");
    }

    fn stem(n: usize) -> ConvGeom {
        ConvGeom {
            n,
            h: 224,
            w: 224,
            cin: 3,
            cout: 64,
            kh: 7,
            kw: 7,
            stride: 2,
            pad: 3,
        }
    }

    #[test]
    fn one_key_per_geometry_and_math() {
        let g = stem(64);
        let k = ConvKey::f32_nhwc(&g, true);
        assert_eq!(
            k.to_string(),
            "n64 224x224x3 -> 112x112x64 k7x7 s2 p3 f32 nhwc tf32"
        );
        let mut s1 = g;
        s1.stride = 1;
        let keys: HashSet<ConvKey> = [
            k,
            ConvKey::f32_nhwc(&g, true),
            ConvKey::f32_nhwc(&g, false),
            ConvKey::f32_nhwc(&s1, true),
            ConvKey::f32_nhwc(&stem(32), true),
        ]
        .into_iter()
        .collect();
        assert_eq!(keys.len(), 4, "the same geometry and math is one entry");
    }

    #[test]
    fn the_check_prints_one_line_per_geometry() {
        assert_eq!(algo_name(dnn::FWD_ALGO), "IMPLICIT_PRECOMP_GEMM");
        assert_eq!(algo_name(dnn::BWD_DATA_ALGO), "ALGO_1");
        assert_eq!(algo_name(dnn::BWD_FILTER_ALGO), "ALGO_1");
        let line = format_line(
            &ConvKey::f32_nhwc(&stem(64), false),
            &[
                PassLine {
                    pass: Pass::Forward,
                    algo: "IMPLICIT_PRECOMP_GEMM".into(),
                    workspace_bytes: 131,
                    fallback: false,
                },
                PassLine {
                    pass: Pass::BackwardFilter,
                    algo: "ALGO_0".into(),
                    workspace_bytes: 2_200_000,
                    fallback: true,
                },
            ],
        );
        assert_eq!(
            line,
            "cudnn conv n64 224x224x3 -> 112x112x64 k7x7 s2 p3 f32 nhwc fma: fwd \
             IMPLICIT_PRECOMP_GEMM 131 B; bwd-filter ALGO_0 (fallback) 2200000 B"
        );
    }

    /// Without a GPU nothing was asked of cuDNN, so nothing is listed, and
    /// the meta device plans with the documented bound (announced by
    /// `memfit plan`), not an error.
    #[test]
    fn without_a_gpu_the_plan_uses_the_documented_bound() {
        if !memfit::device::cuda::no_gpu_here() {
            return;
        }
        let g = stem(2);
        let (_, len) = memfit::backend::conv2d_workspace(
            memfit::device::Device::Meta(memfit::device::Target::Cuda(0)),
            &g,
            memfit::backend::ConvPass::Forward,
        )
        .unwrap();
        let ws = memfit::backend::cuda::conv_ws::ConvWs::new(
            &g,
            memfit::backend::ConvPass::Forward,
            memfit::tensor::DType::F32,
            memfit::tensor::DType::F32,
            memfit::tensor::DType::F32,
        );
        let want = ws.bytes(dnn::CUDNN_DEFAULT_WORKSPACE);
        assert_eq!(len * 4, want.next_multiple_of(4));
        assert!(dnn::conv_choice_lines().is_empty());
    }
}
