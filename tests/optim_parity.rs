//! Optimizers, LR schedules and gradient clipping against PyTorch. The
//! fixtures are made by `tools/make_optim_fixtures.py` (torch 2.15.0,
//! torchvision 0.29.2; see its docstring). Tensors there are NCHW / OIHW.

use memfit::exec::{LossOptions, Plan, forward_backward};
use memfit::io::{TensorFile, load_state_dict, nchw_to_nhwc};
use memfit::memory::{Category, Pool, Tag};
use memfit::nn::{BlockKind, ResNet, ResNetConfig, StateSlot, StemKind};
use memfit::optim::{
    AdamW, LrSchedule, Schedule, Sgd, adamw_update, clip_grad_norm, clip_grad_norm_slices,
    grad_norm,
};

fn fixture(name: &str) -> TensorFile {
    TensorFile::open(format!(
        "{}/tests/fixtures/{name}.safetensors",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("fixture")
}

fn meta_f32(f: &TensorFile, key: &str) -> f32 {
    f.metadata[key].parse().unwrap()
}

/// max |got - want| <= atol + rtol * max |want|; returns the worst diff.
#[track_caller]
fn check(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let diff = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (g, w)| m.max((g - w).abs()));
    assert!(
        diff <= atol + rtol * scale,
        "{what}: max diff {diff:e} (max |ref| {scale:e}, atol {atol:e}, rtol {rtol:e})"
    );
    diff
}

#[test]
fn two_sgd_steps_on_tiny_resnet_match_pytorch() {
    let f = fixture("optim_sgd_resnet");
    assert_eq!(f.metadata["block"], "basic");
    let layers: Vec<usize> = f.metadata["layers"]
        .split(',')
        .map(|s| s.trim().parse().unwrap())
        .collect();
    let config = ResNetConfig {
        block: BlockKind::Basic,
        layers: [layers[0], layers[1], layers[2], layers[3]],
        base_width: f.metadata["base_width"].parse().unwrap(),
        num_classes: f.metadata["num_classes"].parse().unwrap(),
        stem: StemKind::ImageNet,
        zero_init_residual: false,
        seed: 0,
        precision: memfit::nn::Precision::F32,
        recompute_bn_relu: false,
        target: memfit::device::Target::Cpu,
    };
    let pool = Pool::new();
    let mut model = ResNet::new(&pool, config).unwrap();
    load_state_dict(&mut model, &f, &["input.", "output.", "after."]).unwrap();
    let (s, xv) = f.f32("input.x").unwrap();
    let (n, c, h, w) = (s[0], s[1], s[2], s[3]);
    let x = nchw_to_nhwc(xv, n, c, h, w);
    let labels: Vec<usize> = f
        .i64("input.labels")
        .unwrap()
        .1
        .iter()
        .map(|&l| l as usize)
        .collect();
    let mut opt = Sgd::new(meta_f32(&f, "lr"), meta_f32(&f, "momentum"), 0.0, false);
    opt.weight_decay = meta_f32(&f, "weight_decay");
    assert_eq!(f.metadata["nesterov"], "False");
    let plan = Plan::keep_all(&model);
    let before_opt = pool.stats().live.get(Category::Optimizer);
    for step in 1..=2 {
        model.zero_grad();
        let images = pool
            .from_f32(&[n, h, w, c], &x, Category::Data, Tag::fixed("images"))
            .unwrap();
        let out = forward_backward(
            &mut model,
            &pool,
            &plan,
            images,
            &labels,
            LossOptions::default(),
        )
        .unwrap();
        let want = f.f32(&format!("output.loss{step}")).unwrap().1[0];
        let d = (out.loss as f32 - want).abs();
        println!(
            "step {step}: loss {} vs torch {want} (diff {d:.2e})",
            out.loss
        );
        assert!(d <= 1e-5 * want.abs().max(1.0), "step {step} loss");
        if step == 1 {
            let want = f.f32("output.grad_norm1").unwrap().1[0];
            let got = grad_norm(&mut model).unwrap();
            println!("step 1 grad norm {got} vs torch {want}");
            assert!((got - want).abs() <= 1e-4 * want, "grad norm");
            // A max_norm far above the norm must not change anything.
            assert_eq!(clip_grad_norm(&mut model, 1e30).unwrap(), got);
        }
        opt.step(&pool, &mut model).unwrap();
    }
    // Momentum buffers: one f32 per parameter element, from the optimizer pool.
    let params = model.param_count();
    assert_eq!(
        pool.stats().live.get(Category::Optimizer) - before_opt,
        4 * params
    );

    let (mut params_checked, mut buffers_checked, mut counts_checked) = (0, 0, 0);
    let mut moved = 0;
    let mut worst = (0.0f32, String::new());
    model.visit_state(|slot| match slot {
        StateSlot::Param {
            param,
            torch_shape,
            layout,
        } => {
            let got = layout.to_torch(param.value.f32(), &torch_shape);
            let key = format!("after.{}", param.name);
            let (shape, want) = f.f32(&key).unwrap();
            assert_eq!(shape, &torch_shape[..], "{key} shape");
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let before = f.f32(&param.name).unwrap().1;
            let moved_by = before
                .iter()
                .zip(want)
                .fold(0.0f32, |m, (b, a)| m.max((a - b).abs()));
            if moved_by > 1e-3 * scale {
                moved += 1;
            }
            let d = check(&key, &got, want, 0.0, 1e-4);
            println!("  {key:<40} max diff {d:.2e} (rel {:.2e})", d / scale);
            if d / scale > worst.0 {
                worst = (d / scale, key);
            }
            params_checked += 1;
        }
        StateSlot::Buffer { name, tensor } => {
            let data = tensor.f32();
            let key = format!("after.{name}");
            let d = check(&key, data, f.f32(&key).unwrap().1, 1e-6, 1e-4);
            println!("  {key:<40} max diff {d:.2e}");
            buffers_checked += 1;
        }
        StateSlot::Count { name, value } => {
            let key = format!("after.{name}");
            assert_eq!(*value, f.i64(&key).unwrap().1[0], "{key}");
            assert_eq!(*value, f.i64(&name).unwrap().1[0] + 2, "{key}: +2");
            counts_checked += 1;
        }
    });
    println!(
        "worst relative parameter diff: {:.2e} ({})",
        worst.0, worst.1
    );
    let count = |suffix: &str| {
        f.tensors
            .keys()
            .filter(|k| k.starts_with("after.") && k.ends_with(suffix))
            .count()
    };
    let total_after = f.tensors.keys().filter(|k| k.starts_with("after.")).count();
    assert_eq!(counts_checked, count(".num_batches_tracked"));
    assert_eq!(
        buffers_checked,
        count(".running_mean") + count(".running_var")
    );
    assert_eq!(
        params_checked + buffers_checked + counts_checked,
        total_after,
        "every tensor of the state_dict checked"
    );

    // The reference really moved: a no-op optimizer would fail the checks above.
    assert!(
        moved * 10 >= params_checked * 9,
        "only {moved}/{params_checked} parameters moved by more than the tolerance"
    );
}

#[test]
fn adamw_steps_match_pytorch() {
    let f = fixture("optim_adamw");
    let lr = meta_f32(&f, "lr");
    let (b1, b2) = (meta_f32(&f, "beta1"), meta_f32(&f, "beta2"));
    let (eps, wd) = (meta_f32(&f, "eps"), meta_f32(&f, "weight_decay"));
    // The fixture uses PyTorch's defaults, which AdamW::new must carry too.
    let d = AdamW::new(lr);
    assert_eq!((d.beta1, d.beta2, d.eps, d.weight_decay), (b1, b2, eps, wd));
    let steps: u64 = f.metadata["steps"].parse().unwrap();
    let np: usize = f.metadata["params"].parse().unwrap();
    let mut w: Vec<Vec<f32>> = (0..np)
        .map(|i| f.f32(&format!("init.p{i}")).unwrap().1.to_vec())
        .collect();
    let mut m: Vec<Vec<f32>> = w.iter().map(|p| vec![0.0; p.len()]).collect();
    let mut v = m.clone();
    let mut worst = 0.0f32;
    for t in 1..=steps {
        for i in 0..np {
            let g = f.f32(&format!("grad{t}.p{i}")).unwrap().1;
            adamw_update(&mut w[i], g, &mut m[i], &mut v[i], t, lr, b1, b2, eps, wd);
            let key = format!("step{t}.p{i}");
            let want = f.f32(&key).unwrap().1;
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = check(&key, &w[i], want, 0.0, 1e-6);
            println!("  {key:<10} max diff {d:.2e} (rel {:.2e})", d / scale);
            worst = worst.max(d / scale);
        }
    }
    println!("AdamW worst relative diff {worst:.2e}");
    // Sanity: the reference moved by about lr per step, far above the tolerance.
    let init = f.f32("init.p0").unwrap().1;
    let last = f.f32(&format!("step{steps}.p0")).unwrap().1;
    assert!(init.iter().zip(last).any(|(a, b)| (a - b).abs() > lr));
}

#[test]
fn lr_schedules_match_pytorch() {
    let f = fixture("optim_schedule");
    let base = meta_f32(&f, "base_lr");
    let n: usize = f.metadata["steps"].parse().unwrap();
    let warmup_cosine = LrSchedule::new(Schedule::Cosine {
        total_steps: f.metadata["total_steps"].parse().unwrap(),
        min_lr: meta_f32(&f, "eta_min"),
    })
    .with_warmup(f.metadata["warmup_steps"].parse().unwrap());
    assert_eq!(f.metadata["warmup_start_factor"], "1/3");
    let step = LrSchedule::new(Schedule::Step {
        step_size: f.metadata["step_size"].parse().unwrap(),
        gamma: meta_f32(&f, "gamma"),
    });
    for (name, sched) in [("warmup_cosine", warmup_cosine), ("step", step)] {
        let want = f.f32(name).unwrap().1;
        assert_eq!(want.len(), n);
        let got: Vec<f32> = (0..n).map(|t| sched.lr_at(base, t)).collect();
        println!("{name}: {got:?}");
        let d = check(name, &got, want, 1e-7, 0.0);
        println!("{name}: max diff {d:.2e}");
    }
    // No warmup: Schedule::lr_at and LrSchedule::lr_at agree.
    let s = Schedule::Step {
        step_size: 5,
        gamma: 0.5,
    };
    for t in 0..n {
        assert_eq!(s.lr_at(base, t), step.lr_at(base, t));
    }
}

#[test]
fn clip_grad_norm_matches_pytorch() {
    let f = fixture("optim_clip");
    let names: Vec<String> = (0..)
        .map(|i| format!("g{i}"))
        .take_while(|g| f.tensors.contains_key(&format!("grad.{g}")))
        .collect();
    assert_eq!(names.len(), 3);
    let mut grads: Vec<Vec<f32>> = names
        .iter()
        .map(|g| f.f32(&format!("grad.{g}")).unwrap().1.to_vec())
        .collect();
    let orig = grads.clone();
    for (max_norm, norm_key, clipped) in [
        (meta_f32(&f, "max_norm"), "total_norm", true),
        (meta_f32(&f, "max_norm_big"), "total_norm_big", false),
    ] {
        grads.clone_from(&orig);
        let mut slices: Vec<&mut [f32]> = grads.iter_mut().map(|g| g.as_mut_slice()).collect();
        let total = clip_grad_norm_slices(&mut slices, max_norm);
        let want = f.f32(norm_key).unwrap().1[0];
        println!("{norm_key}: {total} vs torch {want}");
        assert!((total - want).abs() <= 1e-6 * want, "{norm_key}");
        assert_eq!(total > max_norm, clipped);
        for (i, g) in names.iter().enumerate() {
            let want = if clipped {
                f.f32(&format!("clipped.{g}")).unwrap().1
            } else {
                &orig[i][..]
            };
            let d = check(&format!("clipped.{g}"), &grads[i], want, 0.0, 1e-6);
            println!("  {g}: max diff {d:.2e}");
        }
    }
}
