//! Kernels and a whole tiny ResNet step against PyTorch. The fixtures are
//! made by `tools/make_fixtures.py` (torch 2.15.0, torchvision 0.29.2; see
//! tests/fixtures/README.md). Tensors there are NCHW / OIHW; we convert.

use memfit::device::cpu::GemmMath;
use memfit::exec::{LossOptions, Plan, forward_backward};
use memfit::io::{TensorFile, load_state_dict, nchw_to_nhwc, nhwc_to_nchw};
use memfit::memory::{Category, Pool, Tag};
use memfit::nn::{BatchNorm, BlockKind, Ctx, Mode, ResNet, ResNetConfig, StateSlot, StemKind};
use memfit::ops::conv2d::{
    ConvGeom, ConvInput, conv2d_backward, conv2d_forward, hwio_to_oihw, oihw_to_hwio,
};
use memfit::ops::cross_entropy::cross_entropy_forward_backward;
use memfit::ops::maxpool::{PoolGeom, maxpool_backward, maxpool_forward};

fn fixture(name: &str) -> TensorFile {
    TensorFile::open(format!(
        "{}/tests/fixtures/{name}.safetensors",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("fixture")
}

/// max |got - want| <= atol + rtol * max |want|, reported with the worst diff.
#[track_caller]
fn check(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: length");
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

fn nchw(f: &TensorFile, name: &str) -> (Vec<f32>, [usize; 4]) {
    let (s, v) = f.f32(name).unwrap();
    let (n, c, h, w) = (s[0], s[1], s[2], s[3]);
    (nchw_to_nhwc(v, n, c, h, w), [n, h, w, c])
}

fn conv_case(name: &str, stride: usize, pad: usize) {
    let f = fixture(name);
    let (x, [n, h, w, cin]) = nchw(&f, "x");
    let (ws, wv) = f.f32("w").unwrap();
    let (cout, kh, kw) = (ws[0], ws[2], ws[3]);
    let weight = oihw_to_hwio(wv, cout, cin, kh, kw);
    let g = ConvGeom {
        n,
        h,
        w,
        cin,
        cout,
        kh,
        kw,
        stride,
        pad,
    };
    let mut work = vec![0.0; g.backward_workspace_len()];
    let mut y = vec![0.0; g.output_len()];
    conv2d_forward(
        &mut y,
        ConvInput::F32(&x),
        &weight,
        &g,
        &mut work,
        GemmMath::F32,
    );
    let (y_ref, _) = nchw(&f, "y");
    check(&format!("{name} y"), &y, &y_ref, 1e-5, 1e-5);
    let (dy, _) = nchw(&f, "dy");
    let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; weight.len()]);
    conv2d_backward(
        Some(&mut dx),
        &mut dw,
        &dy,
        ConvInput::F32(&x),
        &weight,
        &g,
        &mut work,
        GemmMath::F32,
    );
    check(&format!("{name} dx"), &dx, &nchw(&f, "dx").0, 1e-5, 1e-5);
    check(
        &format!("{name} dw"),
        &hwio_to_oihw(&dw, cout, cin, kh, kw),
        f.f32("dw").unwrap().1,
        1e-5,
        1e-5,
    );
}

#[test]
fn conv_matches_pytorch() {
    conv_case("conv_7x7_s2_p3", 2, 3);
    conv_case("conv_3x3_s2_p1", 2, 1);
    conv_case("conv_1x1_s2", 2, 0);
    conv_case("conv_3x3_s1_p1", 1, 1);
}

#[test]
fn batchnorm_train_and_eval_match_pytorch() {
    let f = fixture("bn_train");
    let pool = Pool::new();
    let (x, [n, h, w, c]) = nchw(&f, "x");
    let mut bn = BatchNorm::new(&pool, "bn", c, false).unwrap();
    bn.weight
        .value
        .f32_mut()
        .copy_from_slice(f.f32("weight").unwrap().1);
    bn.bias
        .value
        .f32_mut()
        .copy_from_slice(f.f32("bias").unwrap().1);
    bn.running_mean
        .f32_mut()
        .copy_from_slice(f.f32("running_mean_before").unwrap().1);
    bn.running_var
        .f32_mut()
        .copy_from_slice(f.f32("running_var_before").unwrap().1);
    bn.num_batches_tracked = f.i64("num_batches_tracked_before").unwrap().1[0];
    let xt = pool
        .from_f32(&[n, h, w, c], &x, Category::Data, Tag::fixed("x"))
        .unwrap();
    let (y, stats) = bn
        .forward(&Ctx::new(&pool), &xt, false, Mode::Train, "y")
        .unwrap();
    check("bn y", y.f32(), &nchw(&f, "y").0, 1e-5, 1e-5);
    check(
        "running_mean",
        bn.running_mean.f32(),
        f.f32("running_mean_after").unwrap().1,
        1e-6,
        1e-6,
    );
    check(
        "running_var",
        bn.running_var.f32(),
        f.f32("running_var_after").unwrap().1,
        1e-6,
        1e-6,
    );
    assert_eq!(
        bn.num_batches_tracked,
        f.i64("num_batches_tracked_after").unwrap().1[0]
    );
    let (dy, _) = nchw(&f, "dy");
    let dyt = pool
        .from_f32(&[n, h, w, c], &dy, Category::Data, Tag::fixed("dy"))
        .unwrap();
    let dx = bn
        .backward(&Ctx::new(&pool), &dyt, &xt, &stats, None)
        .unwrap();
    check("bn dx", dx.f32(), &nchw(&f, "dx").0, 1e-5, 1e-5);
    check(
        "bn dweight",
        bn.weight.grad.f32(),
        f.f32("dweight").unwrap().1,
        1e-5,
        1e-5,
    );
    check(
        "bn dbias",
        bn.bias.grad.f32(),
        f.f32("dbias").unwrap().1,
        1e-5,
        1e-5,
    );

    // Eval with the updated running statistics.
    bn.weight.grad.fill_zero();
    bn.bias.grad.fill_zero();
    let (y, stats) = bn
        .forward(&Ctx::new(&pool), &xt, false, Mode::Eval, "y")
        .unwrap();
    assert_eq!(
        bn.num_batches_tracked, 4,
        "eval must not advance the counter"
    );
    check("bn y_eval", y.f32(), &nchw(&f, "y_eval").0, 1e-5, 1e-5);
    let dx = bn
        .backward(&Ctx::new(&pool), &dyt, &xt, &stats, None)
        .unwrap();
    check("bn dx_eval", dx.f32(), &nchw(&f, "dx_eval").0, 1e-5, 1e-5);
    check(
        "bn dweight_eval",
        bn.weight.grad.f32(),
        f.f32("dweight_eval").unwrap().1,
        1e-5,
        1e-5,
    );
    check(
        "bn dbias_eval",
        bn.bias.grad.f32(),
        f.f32("dbias_eval").unwrap().1,
        1e-5,
        1e-5,
    );
}

#[test]
fn maxpool_ties_match_pytorch() {
    let f = fixture("maxpool_ties");
    for (x, y, dy, dx) in [("x", "y", "dy", "dx"), ("x2", "y2", "dy2", "dx2")] {
        let (xv, [n, h, w, c]) = nchw(&f, x);
        let g = PoolGeom {
            n,
            h,
            w,
            c,
            k: 3,
            stride: 2,
            pad: 1,
        };
        let mut out = vec![0.0; g.output_len()];
        maxpool_forward(&mut out, &xv, &g);
        check(y, &out, &nchw(&f, y).0, 0.0, 0.0);
        let mut d = vec![0.0; xv.len()];
        maxpool_backward(&mut d, &nchw(&f, dy).0, &xv, &g);
        check(dx, &d, &nchw(&f, dx).0, 1e-6, 0.0);
    }
}

#[test]
fn cross_entropy_matches_pytorch() {
    let f = fixture("cross_entropy");
    let (s, logits) = f.f32("logits").unwrap();
    let labels: Vec<usize> = f
        .i64("target")
        .unwrap()
        .1
        .iter()
        .map(|&t| t as usize)
        .collect();
    for (smoothing, loss, dl) in [(0.0, "loss", "dlogits"), (0.1, "loss_ls", "dlogits_ls")] {
        let mut d = vec![0.0; logits.len()];
        let l = cross_entropy_forward_backward(&mut d, logits, &labels, s[1], smoothing).unwrap();
        check(loss, &[l as f32], f.f32(loss).unwrap().1, 1e-6, 1e-6);
        check(dl, &d, f.f32(dl).unwrap().1, 1e-7, 1e-6);
    }
}

fn tiny_resnet_step(name: &str) {
    let f = fixture(name);
    let block = match f.metadata["block"].as_str() {
        "bottleneck" => BlockKind::Bottleneck,
        _ => BlockKind::Basic,
    };
    let layers: Vec<usize> = f.metadata["layers"]
        .split(',')
        .map(|s| s.trim().parse().unwrap())
        .collect();
    let config = ResNetConfig {
        block,
        layers: [layers[0], layers[1], layers[2], layers[3]],
        base_width: f.metadata["base_width"].parse().unwrap(),
        num_classes: 10,
        // Fixtures without a "stem" entry were made with torchvision's stem.
        stem: StemKind::by_name(f.metadata.get("stem").map_or("imagenet", |s| s.as_str())).unwrap(),
        zero_init_residual: false,
        seed: 0,
        precision: memfit::nn::Precision::F32,
        recompute_bn_relu: false,
        target: memfit::device::Target::Cpu,
    };
    let pool = Pool::new();
    let mut model = ResNet::new(&pool, config).unwrap();
    load_state_dict(&mut model, &f, &["input.", "output.", "grad.", "after."]).unwrap();
    let (x, [n, h, w, c]) = nchw(&f, "input.x");
    let labels: Vec<usize> = f
        .i64("input.labels")
        .unwrap()
        .1
        .iter()
        .map(|&l| l as usize)
        .collect();
    let images = pool
        .from_f32(&[n, h, w, c], &x, Category::Data, Tag::fixed("images"))
        .unwrap();
    let plan = Plan::keep_all(&model);
    let out = forward_backward(
        &mut model,
        &pool,
        &plan,
        images,
        &labels,
        LossOptions::default(),
    )
    .unwrap();
    let want_loss = f.f32("output.loss").unwrap().1[0];
    println!("{name}: loss {} vs torch {want_loss}", out.loss);
    assert!(
        (out.loss as f32 - want_loss).abs() < 1e-5,
        "loss {} vs {want_loss}",
        out.loss
    );

    // Every gradient and every running statistic, worst diff printed per tensor.
    let mut checked = 0;
    model.visit_state(|slot| match slot {
        StateSlot::Param {
            param,
            torch_shape,
            layout,
        } => {
            let got = layout.to_torch(param.grad.f32(), &torch_shape);
            let want = f.f32(&format!("grad.{}", param.name)).unwrap().1;
            let d = check(&format!("grad.{}", param.name), &got, want, 1e-6, 2e-4);
            println!("  grad.{:<32} max diff {d:.2e}", param.name);
            checked += 1;
        }
        StateSlot::Buffer { name, tensor } => {
            let data = tensor.f32();
            check(
                &format!("after.{name}"),
                data,
                f.f32(&format!("after.{name}")).unwrap().1,
                1e-6,
                1e-5,
            );
        }
        StateSlot::Count { name, value } => {
            assert_eq!(
                *value,
                f.i64(&format!("after.{name}")).unwrap().1[0],
                "{name}"
            );
        }
    });
    let expected = f.tensors.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(checked, expected, "every parameter gradient checked");
}

#[test]
fn tiny_bottleneck_resnet_step_matches_pytorch() {
    tiny_resnet_step("tiny_resnet_bottleneck");
}

#[test]
fn tiny_basic_resnet_step_matches_pytorch() {
    tiny_resnet_step("tiny_resnet_basic");
}

#[test]
fn nhwc_round_trip() {
    let x: Vec<f32> = (0..2 * 3 * 4 * 5).map(|i| i as f32).collect();
    assert_eq!(nhwc_to_nchw(&nchw_to_nhwc(&x, 2, 3, 4, 5), 2, 4, 5, 3), x);
}
