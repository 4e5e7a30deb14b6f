//! Resumable training: a run stopped after any optimizer step and resumed
//! from its checkpoint ends with weights, BN buffers and optimizer state
//! bit-identical to the uninterrupted run — across epoch boundaries, with
//! shuffling, gradient accumulation and the f16 loss scaler.

mod common;

use std::path::{Path, PathBuf};

use memfit::data::SyntheticGratings;
use memfit::memory::Pool;
use memfit::nn::{BlockKind, Precision, ResNet, ResNetConfig, StateSlot};
use memfit::optim::{AdamW, GradScaler, LrSchedule, Optimizer, Schedule, Sgd};
use memfit::train::state::{StateSaving, list_states, load_state};
use memfit::train::{TrainOptions, fit};

fn config(precision: Precision) -> ResNetConfig {
    ResNetConfig {
        precision,
        ..common::tiny_config(BlockKind::Basic, [1, 1, 1, 1], 4, 3)
    }
}

fn options(dir: &Path, max_steps: usize, resume_step: usize, f16: bool) -> TrainOptions {
    TrainOptions {
        epochs: 3,
        max_steps: Some(max_steps),
        progress: false,
        batch_size: 5,
        micro_batch: Some(2),
        plan: None,
        seed: 11,
        shuffle: true,
        label_smoothing: 0.1,
        base_lr: 0.05,
        schedule: LrSchedule::new(Schedule::Cosine {
            total_steps: 15,
            min_lr: 0.0,
        })
        .with_warmup(2),
        clip_grad_norm: Some(5.0),
        eval_every: 1,
        metrics_jsonl: None,
        metrics_csv: None,
        log_every: None,
        predicted_peak: None,
        memory_trace: None,
        scaler: f16.then(|| GradScaler::new(256.0, 2)),
        inject_inf_steps: if f16 { vec![3] } else { vec![] },
        workers: 0,
        nan_policy: memfit::train::NanPolicy::Stop,
        saving: Some(StateSaving {
            dir: dir.to_path_buf(),
            every_steps: Some(1),
            every_epochs: None,
            keep: 100,
            fingerprint: "test=1".into(),
            run_id: "test-run".into(),
            metadata: Default::default(),
        }),
        resume_step,
        resume_sums: None,
        stop: None,
    }
}

fn state(model: &mut ResNet, opt: &Optimizer) -> Vec<(String, Vec<u32>)> {
    let mut out = Vec::new();
    model.visit_state(|slot| match slot {
        StateSlot::Param { param, .. } => out.push((
            param.name.clone(),
            param.value.f32().iter().map(|v| v.to_bits()).collect(),
        )),
        StateSlot::Buffer { name, tensor } => {
            let data = tensor.f32();
            out.push((name, data.iter().map(|v| v.to_bits()).collect()))
        }
        StateSlot::Count { name, value } => out.push((name, vec![*value as u32])),
    });
    for (name, t) in opt.state().0 {
        out.push((name, t.f32().iter().map(|v| v.to_bits()).collect()));
    }
    out
}

fn optimizer(adamw: bool) -> Optimizer {
    if adamw {
        Optimizer::AdamW(AdamW::new(0.01))
    } else {
        Optimizer::Sgd(Sgd::new(0.05, 0.9, 5e-4, true))
    }
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("memfit_resume_{name}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn a_resumed_run_is_bit_identical_to_an_uninterrupted_one() {
    let data = SyntheticGratings::generate(22, 16, 3, 5); // 5 windows per epoch, the last of 2
    let val = SyntheticGratings::generate(4, 16, 3, 6);
    for (precision, f16, adamw) in [
        (Precision::F32, false, false),
        (Precision::F16, true, false),
        (Precision::BF16, false, true),
    ] {
        let full_dir = temp("full");
        let pool = Pool::new();
        let mut model = ResNet::new(&pool, config(precision)).unwrap();
        let mut opt = optimizer(adamw);
        fit(
            &mut model,
            &pool,
            &mut opt,
            &data,
            &val,
            &options(&full_dir, 12, 0, f16),
            |_| {},
        )
        .unwrap();
        let want = state(&mut model, &opt);
        assert_eq!(list_states(&full_dir).unwrap().len(), 12);
        // Stop after step k (mid-epoch, at an epoch end, right after the
        // injected inf), then resume from that checkpoint to step 12.
        for k in [3, 5, 7] {
            let pool = Pool::new();
            let mut model = ResNet::new(
                &pool,
                ResNetConfig {
                    seed: 99, // the checkpoint, not the init, must decide
                    ..config(precision)
                },
            )
            .unwrap();
            let mut opt = optimizer(adamw);
            let ckpt = full_dir.join(format!("ckpt-{k:08}.safetensors"));
            let r = load_state(&ckpt, &pool, &mut model, &mut opt, "test=1").unwrap();
            assert_eq!(r.step, k);
            let dir = temp(&format!("part{k}"));
            let mut o = options(&dir, 12, k, f16);
            if f16 {
                o.scaler = r.scaler.clone();
            }
            fit(&mut model, &pool, &mut opt, &data, &val, &o, |_| {}).unwrap();
            let got = state(&mut model, &opt);
            assert_eq!(got.len(), want.len());
            for ((gn, g), (_, w)) in got.iter().zip(&want) {
                assert!(
                    g == w,
                    "{precision} adamw={adamw} resumed at {k}: {gn} differs"
                );
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
        let _ = std::fs::remove_dir_all(&full_dir);
    }
}

#[test]
fn an_incompatible_checkpoint_is_refused_naming_the_difference() {
    let dir = temp("mismatch");
    let data = SyntheticGratings::generate(10, 16, 3, 5);
    let pool = Pool::new();
    let mut model = ResNet::new(&pool, config(Precision::F32)).unwrap();
    let mut opt = optimizer(false);
    let mut o = options(&dir, 2, 0, false);
    o.saving.as_mut().unwrap().fingerprint = "model=resnet18; lr=0.05".into();
    fit(&mut model, &pool, &mut opt, &data, &data, &o, |_| {}).unwrap();
    let err = load_state(&dir, &pool, &mut model, &mut opt, "model=resnet18; lr=0.1")
        .unwrap_err()
        .to_string();
    assert!(err.contains("lr: checkpoint 0.05, now 0.1"), "{err}");
    // Retention: only the newest `keep` stay.
    let mut o = options(&dir, 4, 0, false);
    o.saving.as_mut().unwrap().keep = 2;
    let mut model = ResNet::new(&pool, config(Precision::F32)).unwrap();
    fit(
        &mut model,
        &pool,
        &mut optimizer(false),
        &data,
        &data,
        &o,
        |_| {},
    )
    .unwrap();
    let steps: Vec<usize> = list_states(&dir).unwrap().iter().map(|c| c.0).collect();
    assert_eq!(steps, vec![3, 4]);
    // A weights file is not a checkpoint.
    let weights = dir.join("w.safetensors");
    memfit::io::save_state_dict(&mut model, &weights).unwrap();
    let err = load_state(&weights, &pool, &mut model, &mut optimizer(false), "x")
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a training checkpoint"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The stop flag (what SIGINT/SIGTERM set) ends the run after the current
/// step with a checkpoint of it and an error that says how to resume.
#[test]
fn a_stop_request_saves_the_current_step_and_says_how_to_resume() {
    let dir = temp("stop");
    let data = SyntheticGratings::generate(10, 16, 3, 5);
    let pool = Pool::new();
    let mut model = ResNet::new(&pool, config(Precision::F32)).unwrap();
    let mut opt = optimizer(false);
    let mut o = options(&dir, 6, 0, false);
    o.saving.as_mut().unwrap().every_steps = None;
    o.stop = Some(std::sync::Arc::new(std::sync::atomic::AtomicBool::new(
        true,
    )));
    let err = fit(&mut model, &pool, &mut opt, &data, &data, &o, |_| {}).unwrap_err();
    match &err {
        memfit::Error::Interrupted {
            step: 1,
            saved_state: Some(p),
        } => assert!(p.ends_with("ckpt-00000001.safetensors"), "{p}"),
        other => panic!("expected an interruption after step 1, got {other}"),
    }
    assert!(err.to_string().contains("resume with --resume"), "{err}");
    assert_eq!(list_states(&dir).unwrap().len(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run writes and deletes only its own state files: a file of another
/// run at the same step is not overwritten (the save fails, naming it),
/// and clean-up (`keep`) leaves other runs' files alone.
#[test]
fn a_run_never_overwrites_or_deletes_another_runs_state_files() {
    let dir = temp("owners");
    let data = SyntheticGratings::generate(10, 16, 3, 5);
    let pool = Pool::new();
    let mut model = ResNet::new(&pool, config(Precision::F32)).unwrap();
    fit(
        &mut model,
        &pool,
        &mut optimizer(false),
        &data,
        &data,
        &options(&dir, 2, 0, false),
        |_| {},
    )
    .unwrap();
    let before: Vec<Vec<u8>> = list_states(&dir)
        .unwrap()
        .iter()
        .map(|(_, p)| std::fs::read(p).unwrap())
        .collect();
    assert_eq!(before.len(), 2);
    let other = |max_steps, resume_step| {
        let mut o = options(&dir, max_steps, resume_step, false);
        let s = o.saving.as_mut().unwrap();
        s.run_id = "other-run".into();
        s.keep = 1;
        o
    };
    let err = fit(
        &mut model,
        &pool,
        &mut optimizer(false),
        &data,
        &data,
        &other(4, 0),
        |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("belongs to another run (test-run)"), "{err}");
    // Steps 3 and 4 of the other run, keeping 1 of its own.
    fit(
        &mut model,
        &pool,
        &mut optimizer(false),
        &data,
        &data,
        &other(4, 2),
        |_| {},
    )
    .unwrap();
    let steps: Vec<usize> = list_states(&dir).unwrap().iter().map(|c| c.0).collect();
    assert_eq!(steps, vec![1, 2, 4]);
    for (i, (_, p)) in list_states(&dir).unwrap().iter().take(2).enumerate() {
        assert_eq!(std::fs::read(p).unwrap(), before[i], "{}", p.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
