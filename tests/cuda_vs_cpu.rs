//! The CUDA backend against the CPU backend (GPU only; run as one binary on
//! a machine with an NVIDIA GPU):
//!
//! ```text
//! LD_LIBRARY_PATH=<cuBLAS/NVRTC dir>:<cuDNN dir> MEMFIT_REQUIRE_GPU=1 \
//!   cargo test --release --features cuda --test cuda_vs_cpu -- --nocapture --test-threads=1
//! ```
//!
//! Without a usable CUDA device every test prints `skipped: no CUDA device`
//! and passes, unless `MEMFIT_REQUIRE_GPU=1` (the GPU check sets it), where
//! they fail. One test thread: the device's cuBLAS handle and the TF32
//! switch are process-wide. NONE OF THIS HAS RUN ON A GPU YET.
//!
//! Each test states its own tolerance: bits where a kernel mirrors the
//! CPU's order and is compiled without FMA contraction (elementwise ops,
//! casts, BN statistics and backward, pools, the optimizers, the bias
//! gradient); 1e-12 relative for the f64 loss and sums of squares (other
//! summation orders, CUDA's exp/log); normwise 1e-5 for cuDNN and cuBLAS in
//! strict fp32 and 1e-2 for TF32 convolutions; for a whole step of tiny
//! ResNets the loss within 1e-4 (fp32) / 2e-2 (bf16) / 5e-3 (f16)
//! relative and gradients and BN running statistics within 1e-3 / 1e-1 /
//! 1e-2 normwise (the median gradient within a tenth of that); and bits between a recomputing plan and keep-all on the
//! GPU (deterministic algorithms, one stream).

#![cfg(any(feature = "cuda", feature = "cuda-12"))]

mod common;

use memfit::backend::{self, ConvPass};
use memfit::device::{CUDA_BACKEND_COMPLETE, Device, Target};
use memfit::exec::{LossOptions, Plan, forward_backward, forward_eval};
use memfit::memory::{Category, Pool, Tag};
use memfit::nn::{BlockKind, ResNet, ResNetConfig, StateSlot, StemKind};
use memfit::ops::conv2d::ConvGeom;
use memfit::tensor::{DType, Precision, Tensor};

/// The GPU pool, or None (and the skip line) without a usable device; a
/// failure instead under `MEMFIT_REQUIRE_GPU=1`, so a GPU check whose
/// libraries are not found cannot pass by skipping.
fn gpu() -> Option<Pool> {
    let info = common::cuda_device()?;
    println!("running on {info}");
    Some(Pool::on(Device::Cuda(0)))
}

/// Deterministic values in [-2, 2) with some exact zeros.
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            if i % 11 == 0 {
                0.0
            } else {
                (s as f32 / u32::MAX as f32) * 4.0 - 2.0
            }
        })
        .collect()
}

fn t(pool: &Pool, dims: &[usize], v: &[f32]) -> Tensor {
    pool.from_f32(dims, v, Category::Workspace, Tag::fixed("t"))
        .unwrap()
}

fn host(x: &Tensor) -> Vec<f32> {
    backend::copy_to_host(x).unwrap()
}

fn assert_bits(op: &str, gpu: &[f32], cpu: &[f32]) {
    assert_eq!(gpu.len(), cpu.len(), "{op}: lengths");
    for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        assert!(
            g.to_bits() == c.to_bits() || (g.is_nan() && c.is_nan()),
            "{op}[{i}]: gpu {g} cpu {c}"
        );
    }
}

fn assert_close(op: &str, gpu: &[f32], cpu: &[f32], rel: f32) {
    assert_eq!(gpu.len(), cpu.len(), "{op}: lengths");
    for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        let tol = rel * c.abs() + 1e-6;
        assert!(
            (g - c).abs() <= tol,
            "{op}[{i}]: gpu {g} cpu {c} (tol {tol})"
        );
    }
}

#[test]
fn round_trip_through_device_memory() {
    let Some(pool) = gpu() else { return };
    let v = values(1000, 1);
    let x = t(&pool, &[10, 100], &v);
    assert_bits("upload/download", &host(&x), &v);
    let z = pool
        .zeros(&[777], DType::F32, Category::Workspace, Tag::fixed("z"))
        .unwrap();
    assert!(host(&z).iter().all(|&v| v == 0.0));
    let mut y = pool
        .empty_f32(&[10, 100], Category::Workspace, Tag::fixed("y"))
        .unwrap();
    backend::copy(&mut y, &x).unwrap();
    assert_bits("copy", &host(&y), &v);
    backend::synchronize(pool.device()).unwrap();
    // Uploads return before their copies run, through page-locked slots
    // used in turn: more uploads than slots, growing and shrinking, each
    // from a host vector dropped at once, then each read back.
    let sizes = [5usize, 300_000, 17, 1 << 20, 3, 64_000, 2, 1 << 21, 9];
    let sent: Vec<(Tensor, Vec<f32>)> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let v = values(n, 200 + i as u32);
            let mut d = empty(&pool, &[n]);
            backend::copy_from_host(&mut d, &v.clone()).unwrap();
            (d, v)
        })
        .collect();
    for (i, (d, v)) in sent.iter().enumerate() {
        assert_bits(&format!("staged upload {i}"), &host(d), v);
    }
}

/// Each wired elementwise op on the GPU against the CPU: the same bits.
#[test]
fn elementwise_ops_match_the_cpu_bit_for_bit() {
    let Some(pool) = gpu() else { return };
    let cpu = Pool::new();
    let n = 4099;
    let (a, b) = (values(n, 2), values(n, 3));
    for p in Precision::ALL {
        // add_assign
        let (mut ga, gb) = (t(&pool, &[n], &a), t(&pool, &[n], &b));
        let (mut ca, cb) = (t(&cpu, &[n], &a), t(&cpu, &[n], &b));
        backend::add_assign(&mut ga, &gb, p).unwrap();
        backend::add_assign(&mut ca, &cb, p).unwrap();
        assert_bits("add_assign", &host(&ga), ca.f32());
        // add_relu_forward with its mask
        let mut gm = pool
            .zeros(&[n], DType::Bits, Category::Workspace, Tag::fixed("m"))
            .unwrap();
        let mut cm = cpu
            .zeros(&[n], DType::Bits, Category::Workspace, Tag::fixed("m"))
            .unwrap();
        let (mut gz, mut cz) = (t(&pool, &[n], &a), t(&cpu, &[n], &a));
        backend::add_relu_forward(&mut gz, &gb, &mut gm, p).unwrap();
        backend::add_relu_forward(&mut cz, &cb, &mut cm, p).unwrap();
        assert_bits("add_relu_forward", &host(&gz), cz.f32());
        // the mask drives the backward the same way
        let (mut gd, mut cd) = (t(&pool, &[n], &b), t(&cpu, &[n], &b));
        backend::relu_mask_backward_inplace(&mut gd, &gm).unwrap();
        backend::relu_mask_backward_inplace(&mut cd, &cm).unwrap();
        assert_bits("relu_mask_backward_inplace", &host(&gd), cd.f32());
        // round / copy_rounded
        let (mut gr, mut cr) = (t(&pool, &[n], &a), t(&cpu, &[n], &a));
        backend::round(&mut gr, p).unwrap();
        backend::round(&mut cr, p).unwrap();
        assert_bits("round", &host(&gr), cr.f32());
    }
    // widen(narrow(x)) for both 16-bit types
    for dt in [DType::BF16, DType::F16] {
        let mut gl = pool
            .empty(&[n], dt, Category::Workspace, Tag::fixed("l"))
            .unwrap();
        let mut cl = cpu
            .empty(&[n], dt, Category::Workspace, Tag::fixed("l"))
            .unwrap();
        let p = if dt == DType::BF16 {
            Precision::BF16
        } else {
            Precision::F16
        };
        let (mut gr, mut cr) = (t(&pool, &[n], &a), t(&cpu, &[n], &a));
        backend::round(&mut gr, p).unwrap();
        backend::round(&mut cr, p).unwrap();
        backend::narrow(&mut gl, &gr).unwrap();
        backend::narrow(&mut cl, &cr).unwrap();
        let (mut gw, mut cw) = (t(&pool, &[n], &b), t(&cpu, &[n], &b));
        backend::widen(&mut gw, &gl).unwrap();
        backend::widen(&mut cw, &cl).unwrap();
        assert_bits("narrow+widen", &host(&gw), cw.f32());
    }
}

/// SGD (momentum, Nesterov) and AdamW: the CPU's bits.
#[test]
fn optimizer_updates_match_the_cpu_bit_for_bit() {
    let Some(pool) = gpu() else { return };
    let cpu = Pool::new();
    let n = 1031;
    let (w, g, m) = (values(n, 4), values(n, 5), values(n, 6));
    let v: Vec<f32> = values(n, 7).iter().map(|x| x.abs()).collect();
    for (first, nesterov) in [(true, false), (false, false), (false, true)] {
        let (mut gw, gg, mut gb) = (t(&pool, &[n], &w), t(&pool, &[n], &g), t(&pool, &[n], &m));
        let (mut cw, cg, mut cb) = (t(&cpu, &[n], &w), t(&cpu, &[n], &g), t(&cpu, &[n], &m));
        backend::sgd_update(&mut gw, &gg, Some(&mut gb), first, 0.1, 0.9, 5e-4, nesterov).unwrap();
        backend::sgd_update(&mut cw, &cg, Some(&mut cb), first, 0.1, 0.9, 5e-4, nesterov).unwrap();
        assert_bits("sgd w", &host(&gw), cw.f32());
        assert_bits("sgd buf", &host(&gb), cb.f32());
    }
    for step in [1, 7] {
        let (mut gw, gg) = (t(&pool, &[n], &w), t(&pool, &[n], &g));
        let (mut gm, mut gv) = (t(&pool, &[n], &m), t(&pool, &[n], &v));
        let (mut cw, cg) = (t(&cpu, &[n], &w), t(&cpu, &[n], &g));
        let (mut cm, mut cv) = (t(&cpu, &[n], &m), t(&cpu, &[n], &v));
        backend::adamw_update(
            &mut gw, &gg, &mut gm, &mut gv, step, 1e-3, 0.9, 0.999, 1e-8, 0.01,
        )
        .unwrap();
        backend::adamw_update(
            &mut cw, &cg, &mut cm, &mut cv, step, 1e-3, 0.9, 0.999, 1e-8, 0.01,
        )
        .unwrap();
        assert_bits("adamw w", &host(&gw), cw.f32());
        assert_bits("adamw m", &host(&gm), cm.f32());
        assert_bits("adamw v", &host(&gv), cv.f32());
    }
}

/// Pools: max pooling gives the CPU's bits; average pooling sums in f64
/// in the CPU's order, so bits too (checked to 1e-6 relative to say so
/// plainly should a driver's f64 division ever differ).
#[test]
fn pools_match_the_cpu() {
    let Some(pool) = gpu() else { return };
    let cpu = Pool::new();
    let (n, h, w, c) = (2, 9, 7, 5);
    let x = values(n * h * w * c, 8);
    let g = memfit::ops::maxpool::PoolGeom {
        n,
        h,
        w,
        c,
        k: 3,
        stride: 2,
        pad: 1,
    };
    let (oh, ow) = (g.oh(), g.ow());
    let (gx, cx) = (t(&pool, &[n, h, w, c], &x), t(&cpu, &[n, h, w, c], &x));
    let mut gy = pool
        .empty_f32(&[n, oh, ow, c], Category::Workspace, Tag::fixed("y"))
        .unwrap();
    let mut cy = cpu
        .empty_f32(&[n, oh, ow, c], Category::Workspace, Tag::fixed("y"))
        .unwrap();
    backend::maxpool_forward(&mut gy, &gx, &g).unwrap();
    backend::maxpool_forward(&mut cy, &cx, &g).unwrap();
    assert_bits("maxpool_forward", &host(&gy), cy.f32());
    let dy = values(n * oh * ow * c, 9);
    let (gdy, cdy) = (
        t(&pool, &[n, oh, ow, c], &dy),
        t(&cpu, &[n, oh, ow, c], &dy),
    );
    for p in Precision::ALL {
        let mut gdx = pool
            .empty_f32(&[n, h, w, c], Category::Workspace, Tag::fixed("dx"))
            .unwrap();
        let mut cdx = cpu
            .empty_f32(&[n, h, w, c], Category::Workspace, Tag::fixed("dx"))
            .unwrap();
        backend::maxpool_backward(&mut gdx, &gdy, &gx, &g, p).unwrap();
        backend::maxpool_backward(&mut cdx, &cdy, &cx, &g, p).unwrap();
        assert_bits("maxpool_backward", &host(&gdx), cdx.f32());
        let mut ga = pool
            .empty_f32(&[n, c], Category::Workspace, Tag::fixed("a"))
            .unwrap();
        let mut ca = cpu
            .empty_f32(&[n, c], Category::Workspace, Tag::fixed("a"))
            .unwrap();
        backend::avgpool_forward(&mut ga, &gx, p).unwrap();
        backend::avgpool_forward(&mut ca, &cx, p).unwrap();
        assert_close("avgpool_forward", &host(&ga), ca.f32(), 1e-6);
    }
}

/// Normwise closeness: `|g - c| <= rel · max|c| + 1e-6` per element (the
/// GEMM-shaped ops sum in other orders than the CPU, and a relative test
/// per element fails wherever a sum cancels to near zero).
fn assert_close_normwise(op: &str, gpu: &[f32], cpu: &[f32], rel: f32) {
    assert_eq!(gpu.len(), cpu.len(), "{op}: lengths");
    let scale = cpu.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let tol = rel * scale + 1e-6;
    for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        assert!(
            (g - c).abs() <= tol,
            "{op}[{i}]: gpu {g} cpu {c} (tol {tol}, max|cpu| {scale})"
        );
    }
}

fn empty(pool: &Pool, dims: &[usize]) -> Tensor {
    pool.empty_f32(dims, Category::Workspace, Tag::fixed("out"))
        .unwrap()
}

fn workspace(pool: &Pool, g: &ConvGeom, pass: ConvPass) -> Tensor {
    let (dt, len) = backend::conv2d_workspace(pool.device(), g, pass).unwrap();
    pool.empty(&[len.max(1)], dt, Category::Workspace, Tag::fixed("ws"))
        .unwrap()
}

/// One convolution of geometry `g` on `pool`: the forward of `xv` by `wv`,
/// then the backward of `dyv` accumulating into `dx0` (the input gradient
/// skipped when `None`, as for the stem) and `dw0`, in strict fp32 unless
/// TF32 is allowed. Returns y, dx and dw on the host.
#[allow(clippy::type_complexity)]
fn conv_run(
    pool: &Pool,
    g: &ConvGeom,
    (xv, wv, dyv): (&[f32], &[f32], &[f32]),
    dx0: Option<&[f32]>,
    dw0: &[f32],
) -> memfit::Result<(Vec<f32>, Option<Vec<f32>>, Vec<f32>)> {
    let xd = [g.n, g.h, g.w, g.cin];
    let wd = [g.kh, g.kw, g.cin, g.cout];
    let yd = [g.n, g.oh(), g.ow(), g.cout];
    let (x, w) = (t(pool, &xd, xv), t(pool, &wd, wv));
    let mut y = empty(pool, &yd);
    let mut ws = workspace(pool, g, ConvPass::Forward);
    backend::conv2d_forward(&mut y, &x, &w, g, &mut ws, Precision::F32)?;
    let dy = t(pool, &yd, dyv);
    let mut dx = dx0.map(|v| t(pool, &xd, v));
    let mut dw = t(pool, &wd, dw0);
    let mut ws = workspace(pool, g, ConvPass::Backward);
    backend::conv2d_backward(
        dx.as_mut(),
        &mut dw,
        &dy,
        &x,
        &w,
        g,
        &mut ws,
        Precision::F32,
    )?;
    Ok((host(&y), dx.as_ref().map(host), host(&dw)))
}

/// The CLI's default on a GPU (as PyTorch's cuDNN): fp32 convolutions in
/// TF32 (10-bit mantissa products, f32 sums), forward and backward within
/// 1e-2 normwise of the CPU's strict fp32. Process-wide switch, restored
/// after (the binary runs with one test thread).
#[test]
fn tf32_convolutions_match_the_cpu_loosely() {
    let Some(pool) = gpu() else { return };
    let cpu = Pool::new();
    let g = ConvGeom {
        n: 2,
        h: 9,
        w: 9,
        cin: 16,
        cout: 32,
        kh: 3,
        kw: 3,
        stride: 1,
        pad: 1,
    };
    let (xv, wv, dyv) = (
        values(2 * 9 * 9 * 16, 301),
        values(3 * 3 * 16 * 32, 302),
        values(2 * g.oh() * g.ow() * 32, 303),
    );
    let (zeros_x, zeros_w) = (vec![0.0; xv.len()], vec![0.0; wv.len()]);
    let inputs = (&xv[..], &wv[..], &dyv[..]);
    backend::cuda::dnn::set_allow_tf32(true);
    let on_gpu = conv_run(&pool, &g, inputs, Some(&zeros_x), &zeros_w);
    backend::cuda::dnn::set_allow_tf32(false);
    let (gy, gdx, gdw) = on_gpu.unwrap();
    let (cy, cdx, cdw) = conv_run(&cpu, &g, inputs, Some(&zeros_x), &zeros_w).unwrap();
    assert_close_normwise("tf32 conv fwd", &gy, &cy, 1e-2);
    assert_close_normwise("tf32 conv dgrad", &gdx.unwrap(), &cdx.unwrap(), 1e-2);
    assert_close_normwise("tf32 conv wgrad", &gdw, &cdw, 1e-2);
}

/// cuDNN convolutions (strict fp32, pinned algorithms) against the CPU's:
/// forward, backward-data accumulating into a non-zero `dx`, backward-
/// filter accumulating into a non-zero `dw` (HWIO), within 1e-5 normwise,
/// over 3×3, strided, pointwise and stem-like geometries; and the
/// workspace the planner counts covers what cuDNN asks for (the call
/// checks and errors otherwise).
#[test]
fn convolutions_match_the_cpu() {
    let Some(pool) = gpu() else { return };
    let cpu = Pool::new();
    let geoms = [
        (2, 9, 9, 8, 16, 3, 1, 1),
        (2, 9, 9, 8, 16, 3, 2, 1),
        (2, 8, 8, 16, 8, 1, 1, 0),
        (2, 8, 8, 16, 32, 1, 2, 0),
        (1, 20, 20, 3, 8, 7, 2, 3),
    ];
    for (seed, &(n, h, w, cin, cout, k, stride, pad)) in geoms.iter().enumerate() {
        let g = ConvGeom {
            n,
            h,
            w,
            cin,
            cout,
            kh: k,
            kw: k,
            stride,
            pad,
        };
        let what = format!("{g:?}");
        let seed = seed as u32 * 10;
        let (oh, ow) = (g.oh(), g.ow());
        let xv = values(n * h * w * cin, seed + 1);
        let wv = values(k * k * cin * cout, seed + 2);
        let dyv = values(n * oh * ow * cout, seed + 3);
        let dx0 = values(n * h * w * cin, seed + 4);
        let dw0 = values(k * k * cin * cout, seed + 5);
        let inputs = (&xv[..], &wv[..], &dyv[..]);
        let (gy, gdx, gdw) = conv_run(&pool, &g, inputs, Some(&dx0), &dw0).unwrap();
        let (cy, cdx, cdw) = conv_run(&cpu, &g, inputs, Some(&dx0), &dw0).unwrap();
        assert_close_normwise(&format!("conv fwd {what}"), &gy, &cy, 1e-5);
        let (gdx, cdx) = (gdx.unwrap(), cdx.unwrap());
        assert_close_normwise(&format!("conv dgrad {what}"), &gdx, &cdx, 1e-5);
        assert_close_normwise(&format!("conv wgrad {what}"), &gdw, &cdw, 1e-5);
        // Without dx (the stem): the weight gradient alone, same values.
        let (_, none, gdw2) = conv_run(&pool, &g, inputs, None, &dw0).unwrap();
        assert!(none.is_none());
        assert_bits(&format!("conv wgrad alone {what}"), &gdw2, &gdw);
    }
}

/// `v` on `pool` stored in bf16 (the values rounded to nearest even).
fn bf16_tensor(pool: &Pool, dims: &[usize], v: &[f32]) -> Tensor {
    let f = t(pool, dims, v);
    let mut b = pool
        .empty(dims, DType::BF16, Category::Workspace, Tag::fixed("bf16"))
        .unwrap();
    backend::narrow(&mut b, &f).unwrap();
    b
}

/// `x` on the host as f32, widened first when it is stored in bf16.
fn host_any(pool: &Pool, x: &Tensor) -> Vec<f32> {
    if x.dtype() == DType::F32 {
        return host(x);
    }
    let mut f = empty(pool, x.dims());
    backend::widen(&mut f, x).unwrap();
    host(&f)
}

/// The workspace a convolution of `g` asks for with its input stored as
/// `input` and its forward output as `output`, in precision `p`.
fn workspace_for(
    pool: &Pool,
    g: &ConvGeom,
    pass: ConvPass,
    (input, output): (DType, DType),
    p: Precision,
) -> Tensor {
    let (dt, len) =
        backend::conv2d_workspace_for(pool.device(), g, pass, input, output, p).unwrap();
    pool.empty(&[len.max(1)], dt, Category::Workspace, Tag::fixed("ws"))
        .unwrap()
}

/// bf16 and f16 convolutions on operands rounded to the type (as the
/// layers pass them) against the CPU's. f16: an f32 convolution on both
/// devices, within 1e-5 normwise. bf16 runs cuDNN in bf16 on a GPU with
/// bf16 tensor cores (f32 accumulation), with the activations stored as
/// the layers store them (input and output in bf16, read and written in
/// place) and, for the stem's case, in f32 (staged through the
/// workspace); the output (y, and dx with what it accumulated) comes back
/// rounded to bf16 on both devices, where a sum landing on the other side
/// of a rounding boundary differs by one bf16 ulp (2^-8 relative), and the
/// GPU rounds its dgrad before adding it into the accumulated dx (cuDNN's
/// bf16 output) where the CPU rounds once after: 1e-2 normwise. cuDNN's
/// bf16 weight gradient is rounded to bf16 before the f32 `dw` adds it
/// (PyTorch's autocast keeps the same bf16 gradient): 1e-2 normwise under
/// bf16, 1e-5 under f16.
#[test]
fn low_precision_convolutions_match_the_cpu_on_rounded_operands() {
    let Some(pool) = gpu() else { return };
    let cpu = Pool::new();
    let bf16_cudnn = Device::Cuda(0).capabilities().reads_bf16;
    let cases = [
        (Precision::BF16, DType::BF16),
        (Precision::BF16, DType::F32),
        (Precision::F16, DType::F32),
    ];
    for (p, stored) in cases {
        if stored == DType::BF16 && !bf16_cudnn {
            println!("note: this GPU has no bf16 convolutions; bf16 storage not tested");
            continue;
        }
        let what = format!("{p} {stored:?}");
        let rounded = |v: Vec<f32>| -> Vec<f32> {
            let mut x = t(&cpu, &[v.len()], &v);
            backend::round(&mut x, p).unwrap();
            x.f32().to_vec()
        };
        let g = ConvGeom {
            n: 2,
            h: 9,
            w: 9,
            cin: 8,
            cout: 16,
            kh: 3,
            kw: 3,
            stride: 1,
            pad: 1,
        };
        let (xd, wd, yd) = ([2, 9, 9, 8], [3, 3, 8, 16], [2, 9, 9, 16]);
        let xv = rounded(values(2 * 9 * 9 * 8, 91));
        let wv = rounded(values(3 * 3 * 8 * 16, 92));
        let dyv = rounded(values(2 * 9 * 9 * 16, 93));
        let dx0 = rounded(values(2 * 9 * 9 * 8, 94));
        let (tol, wgrad_tol) = if p == Precision::BF16 {
            (1e-2, 1e-2)
        } else {
            (1e-5, 1e-5)
        };
        let activation = |pool: &Pool, dims: &[usize], v: &[f32]| match stored {
            DType::BF16 => bf16_tensor(pool, dims, v),
            _ => t(pool, dims, v),
        };
        let out = |pool: &Pool| match stored {
            DType::BF16 => pool
                .empty(&yd, DType::BF16, Category::Workspace, Tag::fixed("y"))
                .unwrap(),
            _ => empty(pool, &yd),
        };
        let (gx, cx) = (activation(&pool, &xd, &xv), activation(&cpu, &xd, &xv));
        let (gw, cw) = (t(&pool, &wd, &wv), t(&cpu, &wd, &wv));
        let (mut gy, mut cy) = (out(&pool), out(&cpu));
        let types = (stored, stored);
        let mut gws = workspace_for(&pool, &g, ConvPass::Forward, types, p);
        let mut cws = workspace_for(&cpu, &g, ConvPass::Forward, types, p);
        backend::conv2d_forward(&mut gy, &gx, &gw, &g, &mut gws, p).unwrap();
        backend::conv2d_forward(&mut cy, &cx, &cw, &g, &mut cws, p).unwrap();
        let (gyh, cyh) = (host_any(&pool, &gy), host_any(&cpu, &cy));
        assert_close_normwise(&format!("{what} conv fwd"), &gyh, &cyh, tol);
        if p == Precision::BF16 {
            assert_bits("bf16 conv y is rounded", &gyh, &rounded(gyh.clone()));
        }
        let (gdy, cdy) = (t(&pool, &yd, &dyv), t(&cpu, &yd, &dyv));
        let (mut gdx, mut cdx) = (t(&pool, &xd, &dx0), t(&cpu, &xd, &dx0));
        let (mut gdw, mut cdw) = (empty(&pool, &wd), empty(&cpu, &wd));
        gdw.fill_zero();
        cdw.fill_zero();
        let types = (stored, DType::F32);
        let mut gws = workspace_for(&pool, &g, ConvPass::Backward, types, p);
        let mut cws = workspace_for(&cpu, &g, ConvPass::Backward, types, p);
        backend::conv2d_backward(Some(&mut gdx), &mut gdw, &gdy, &gx, &gw, &g, &mut gws, p)
            .unwrap();
        backend::conv2d_backward(Some(&mut cdx), &mut cdw, &cdy, &cx, &cw, &g, &mut cws, p)
            .unwrap();
        let gdxh = host(&gdx);
        assert_close_normwise(&format!("{what} conv dgrad"), &gdxh, cdx.f32(), tol);
        if p == Precision::BF16 {
            assert_bits("bf16 conv dx is rounded", &gdxh, &rounded(gdxh.clone()));
        }
        // The weight gradient is f32 (master gradients).
        let what = format!("{what} conv wgrad");
        assert_close_normwise(&what, &host(&gdw), cdw.f32(), wgrad_tol);
    }
}

/// cuBLAS linear against the CPU: y, dx within 1e-5 normwise, dw
/// accumulating into non-zero values within 1e-5 normwise, db (the CPU's
/// loop, in order) bit for bit.
#[test]
fn linear_matches_the_cpu() {
    let Some(pool) = gpu() else { return };
    let cpu = Pool::new();
    let (n, fin, fout) = (7, 33, 10);
    let (xv, wv, bv) = (
        values(n * fin, 21),
        values(fout * fin, 22),
        values(fout, 23),
    );
    let (dyv, dw0, db0) = (
        values(n * fout, 24),
        values(fout * fin, 25),
        values(fout, 26),
    );
    let (gx, cx) = (t(&pool, &[n, fin], &xv), t(&cpu, &[n, fin], &xv));
    let (gw, cw) = (t(&pool, &[fout, fin], &wv), t(&cpu, &[fout, fin], &wv));
    let (gb, cb) = (t(&pool, &[fout], &bv), t(&cpu, &[fout], &bv));
    let (mut gy, mut cy) = (empty(&pool, &[n, fout]), empty(&cpu, &[n, fout]));
    backend::linear_forward(&mut gy, &gx, &gw, &gb, Precision::F32).unwrap();
    backend::linear_forward(&mut cy, &cx, &cw, &cb, Precision::F32).unwrap();
    assert_close_normwise("linear fwd", &host(&gy), cy.f32(), 1e-5);
    let (gdy, cdy) = (t(&pool, &[n, fout], &dyv), t(&cpu, &[n, fout], &dyv));
    let (mut gdx, mut cdx) = (empty(&pool, &[n, fin]), empty(&cpu, &[n, fin]));
    let (mut gdw, mut cdw) = (t(&pool, &[fout, fin], &dw0), t(&cpu, &[fout, fin], &dw0));
    let (mut gdb, mut cdb) = (t(&pool, &[fout], &db0), t(&cpu, &[fout], &db0));
    backend::linear_backward(&mut gdx, &mut gdw, &mut gdb, &gdy, &gx, &gw, Precision::F32).unwrap();
    backend::linear_backward(&mut cdx, &mut cdw, &mut cdb, &cdy, &cx, &cw, Precision::F32).unwrap();
    assert_close_normwise("linear dx", &host(&gdx), cdx.f32(), 1e-5);
    assert_close_normwise("linear dw", &host(&gdw), cdw.f32(), 1e-5);
    assert_bits("linear db", &host(&gdb), cdb.f32());
}

/// BN batch statistics: the kernels mirror the CPU's chunk order and f64
/// accumulation, so mean, var, rstd are the CPU's bits (rows = 1100: two
/// whole chunks and a partial one; c = 70: a partial block).
#[test]
fn bn_batch_stats_match_the_cpu_bit_for_bit() {
    let Some(pool) = gpu() else { return };
    let cpu = Pool::new();
    let (rows, c) = (1100, 70);
    let xv: Vec<f32> = values(rows * c, 31).iter().map(|v| v * 3.0 + 1.0).collect();
    let (gx, cx) = (t(&pool, &[rows, c], &xv), t(&cpu, &[rows, c], &xv));
    let mut g: Vec<Tensor> = (0..3).map(|_| empty(&pool, &[c])).collect();
    let mut k: Vec<Tensor> = (0..3).map(|_| empty(&cpu, &[c])).collect();
    let [gm, gv, gr] = g.as_mut_slice() else {
        unreachable!()
    };
    backend::bn_batch_stats(gm, gv, gr, &gx, 1e-5).unwrap();
    let [cm, cv, cr] = k.as_mut_slice() else {
        unreachable!()
    };
    backend::bn_batch_stats(cm, cv, cr, &cx, 1e-5).unwrap();
    assert_bits("bn mean", &host(gm), cm.f32());
    assert_bits("bn var", &host(gv), cv.f32());
    assert_bits("bn rstd", &host(gr), cr.f32());
}

/// BN backward, training (batch statistics) and frozen, with and without
/// the fused ReLU's output (f32 and bf16): dgamma/dbeta accumulate into
/// non-zero values and are the CPU's bits (same chunk order); dx is
/// elementwise from the same coefficients, the CPU's bits too.
#[test]
fn bn_backward_matches_the_cpu_bit_for_bit() {
    let Some(pool) = gpu() else { return };
    let cpu = Pool::new();
    let (rows, c) = (1100, 70);
    let xv = values(rows * c, 41);
    let dyv = values(rows * c, 42);
    let outv = values(rows * c, 43);
    let mv = values(c, 44);
    let rv: Vec<f32> = values(c, 45).iter().map(|v| v.abs() + 0.5).collect();
    let gav = values(c, 46);
    let (g0, b0) = (values(c, 47), values(c, 48));
    let on = |p: &Pool| {
        (
            t(p, &[rows, c], &xv),
            t(p, &[rows, c], &dyv),
            t(p, &[rows, c], &outv),
            t(p, &[c], &mv),
            t(p, &[c], &rv),
            t(p, &[c], &gav),
        )
    };
    let (gx, gdy, gout, gmean, grstd, ggamma) = on(&pool);
    let (cx, cdy, cout, cmean, crstd, cgamma) = on(&cpu);
    for batch_stats in [true, false] {
        for with_relu in [false, true] {
            let (mut gdx, mut cdx) = (empty(&pool, &[rows, c]), empty(&cpu, &[rows, c]));
            let (mut gdg, mut cdg) = (t(&pool, &[c], &g0), t(&cpu, &[c], &g0));
            let (mut gdb, mut cdb) = (t(&pool, &[c], &b0), t(&cpu, &[c], &b0));
            backend::bn_backward(
                &mut gdx,
                Some(&mut gdg),
                Some(&mut gdb),
                &gdy,
                &gx,
                &gmean,
                &grstd,
                &ggamma,
                with_relu.then_some(&gout),
                batch_stats,
                Precision::F32,
            )
            .unwrap();
            backend::bn_backward(
                &mut cdx,
                Some(&mut cdg),
                Some(&mut cdb),
                &cdy,
                &cx,
                &cmean,
                &crstd,
                &cgamma,
                with_relu.then_some(&cout),
                batch_stats,
                Precision::F32,
            )
            .unwrap();
            let what = format!("batch_stats {batch_stats} relu {with_relu}");
            assert_bits(&format!("bn dx {what}"), &host(&gdx), cdx.f32());
            assert_bits(&format!("bn dgamma {what}"), &host(&gdg), cdg.f32());
            assert_bits(&format!("bn dbeta {what}"), &host(&gdb), cdb.f32());
        }
    }
}

/// `v` on `pool` as f32, or stored in bf16 when `bf16`.
fn stored(pool: &Pool, dims: &[usize], v: &[f32], bf16: bool) -> Tensor {
    if bf16 {
        bf16_tensor(pool, dims, v)
    } else {
        t(pool, dims, v)
    }
}

/// What a device that reads bf16 (`Capabilities::reads_bf16`) runs on
/// bf16-stored activations and gradients: BN statistics of a bf16 input,
/// BN backward of every mix of f32 and bf16 dy, x and ReLU output, the
/// residual add (bf16 addend, and the sum itself stored in bf16, with its
/// mask), the ReLU-mask backward of a bf16 gradient and the max-pool
/// backward of bf16 dy and x: the CPU's bits, as their f32 kernels are.
#[test]
fn bf16_storage_ops_match_the_cpu_bit_for_bit() {
    let Some(pool) = gpu() else { return };
    let cpu = Pool::new();
    let (rows, c) = (1100, 70);
    let dims = [rows, c];
    let xv: Vec<f32> = values(rows * c, 51).iter().map(|v| v * 3.0 + 1.0).collect();
    let (gx, cx) = (
        bf16_tensor(&pool, &dims, &xv),
        bf16_tensor(&cpu, &dims, &xv),
    );
    let mut g: Vec<Tensor> = (0..3).map(|_| empty(&pool, &[c])).collect();
    let mut k: Vec<Tensor> = (0..3).map(|_| empty(&cpu, &[c])).collect();
    let ([gm, gv, gr], [cm, cv, cr]) = (g.as_mut_slice(), k.as_mut_slice()) else {
        unreachable!()
    };
    backend::bn_batch_stats(gm, gv, gr, &gx, 1e-5).unwrap();
    backend::bn_batch_stats(cm, cv, cr, &cx, 1e-5).unwrap();
    assert_bits("bn mean of bf16 x", &host(gm), cm.f32());
    assert_bits("bn var of bf16 x", &host(gv), cv.f32());
    assert_bits("bn rstd of bf16 x", &host(gr), cr.f32());

    let (dyv, outv) = (values(rows * c, 52), values(rows * c, 53));
    let (mv, gav) = (values(c, 54), values(c, 56));
    let rv: Vec<f32> = values(c, 55).iter().map(|v| v.abs() + 0.5).collect();
    for mix in 0..8u32 {
        let (dy_bf16, x_bf16, o_bf16) = (mix & 1 != 0, mix & 2 != 0, mix & 4 != 0);
        let run = |p: &Pool| {
            let dy = stored(p, &dims, &dyv, dy_bf16);
            let x = stored(p, &dims, &xv, x_bf16);
            let out = stored(p, &dims, &outv, o_bf16);
            let (mean, rstd, gamma) = (t(p, &[c], &mv), t(p, &[c], &rv), t(p, &[c], &gav));
            let mut dx = empty(p, &dims);
            let (mut dg, mut db) = (t(p, &[c], &mv), t(p, &[c], &rv));
            backend::bn_backward(
                &mut dx,
                Some(&mut dg),
                Some(&mut db),
                &dy,
                &x,
                &mean,
                &rstd,
                &gamma,
                Some(&out),
                true,
                Precision::BF16,
            )
            .unwrap();
            [host(&dx), host(&dg), host(&db)]
        };
        let (gpu_out, cpu_out) = (run(&pool), run(&cpu));
        for (what, (a, b)) in ["dx", "dgamma", "dbeta"]
            .iter()
            .zip(gpu_out.iter().zip(&cpu_out))
        {
            assert_bits(
                &format!("bn backward {what}, bf16 dy {dy_bf16} x {x_bf16} out {o_bf16}"),
                a,
                b,
            );
        }
    }

    let n = 4099;
    let (a, b) = (values(n, 57), values(n, 58));
    let mask = |p: &Pool| {
        p.zeros(&[n], DType::Bits, Category::Workspace, Tag::fixed("m"))
            .unwrap()
    };
    // add_assign of a bf16 addend
    let (mut ga, mut ca) = (t(&pool, &[n], &a), t(&cpu, &[n], &a));
    backend::add_assign(&mut ga, &bf16_tensor(&pool, &[n], &b), Precision::BF16).unwrap();
    backend::add_assign(&mut ca, &bf16_tensor(&cpu, &[n], &b), Precision::BF16).unwrap();
    assert_bits("add_assign of bf16", &host(&ga), ca.f32());
    for r_bf16 in [false, true] {
        // z = relu(z + residual) stored in bf16, then its mask backward on a
        // bf16 gradient.
        let run = |p: &Pool| {
            let mut z = bf16_tensor(p, &[n], &a);
            let r = stored(p, &[n], &b, r_bf16);
            let mut m = mask(p);
            backend::add_relu_forward(&mut z, &r, &mut m, Precision::BF16).unwrap();
            let mut d = bf16_tensor(p, &[n], &b);
            backend::relu_mask_backward_inplace(&mut d, &m).unwrap();
            (host_any(p, &z), host_any(p, &d))
        };
        let ((gz, gd), (cz, cd)) = (run(&pool), run(&cpu));
        assert_bits(
            &format!("bf16 add_relu_forward, bf16 residual {r_bf16}"),
            &gz,
            &cz,
        );
        assert_bits("relu_mask_backward_inplace of bf16", &gd, &cd);
    }

    let (n, h, w, c) = (2, 9, 7, 6);
    let g = memfit::ops::maxpool::PoolGeom {
        n,
        h,
        w,
        c,
        k: 3,
        stride: 2,
        pad: 1,
    };
    let xv = values(n * h * w * c, 59);
    let dyv = values(n * g.oh() * g.ow() * c, 60);
    for mix in 0..4u32 {
        let (dy_bf16, x_bf16) = (mix & 1 != 0, mix & 2 != 0);
        let run = |p: &Pool| {
            let x = stored(p, &[n, h, w, c], &xv, x_bf16);
            let dy = stored(p, &[n, g.oh(), g.ow(), c], &dyv, dy_bf16);
            let mut dx = empty(p, &[n, h, w, c]);
            backend::maxpool_backward(&mut dx, &dy, &x, &g, Precision::BF16).unwrap();
            host(&dx)
        };
        let what = format!("maxpool_backward, bf16 dy {dy_bf16} x {x_bf16}");
        assert_bits(&what, &run(&pool), &run(&cpu));
    }
}

/// Cross-entropy: loss within 1e-12 relative (per-row sums added in
/// order, CUDA's exp/log within 1-2 ulp of libm's), the same top-1 count,
/// and d_logits within 2 ulp (4e-7 relative, 1e-9 absolute), with and
/// without label smoothing and the loss scale.
#[test]
fn cross_entropy_matches_the_cpu() {
    let Some(pool) = gpu() else { return };
    let cpu = Pool::new();
    let (n, classes) = (9, 13);
    let z: Vec<f32> = values(n * classes, 51).iter().map(|v| v * 4.0).collect();
    let labels: Vec<usize> = (0..n).map(|i| (i * 7) % classes).collect();
    let (gz, cz) = (t(&pool, &[n, classes], &z), t(&cpu, &[n, classes], &z));
    for (smoothing, scale) in [(0.0, None), (0.1, Some(1024.0))] {
        let mut gd = empty(&pool, &[n, classes]);
        let mut cd = empty(&cpu, &[n, classes]);
        let go = backend::cross_entropy(&mut gd, &gz, &labels, smoothing, n, scale, Precision::F32)
            .unwrap();
        let co = backend::cross_entropy(&mut cd, &cz, &labels, smoothing, n, scale, Precision::F32)
            .unwrap();
        assert!(
            (go.loss - co.loss).abs() <= 1e-12 * co.loss.abs(),
            "loss gpu {} cpu {}",
            go.loss,
            co.loss
        );
        assert_eq!(go.correct, co.correct, "correct");
        for (i, (g, c)) in host(&gd).iter().zip(cd.f32()).enumerate() {
            let tol = 4e-7 * c.abs() + 1e-9 * scale.unwrap_or(1.0);
            assert!((g - c).abs() <= tol, "d_logits[{i}]: gpu {g} cpu {c}");
        }
    }
    // A label out of range is the CPU's error, before any upload.
    let mut gd = empty(&pool, &[n, classes]);
    let mut bad = labels.clone();
    bad[3] = classes;
    assert!(backend::cross_entropy(&mut gd, &gz, &bad, 0.0, n, None, Precision::F32).is_err());
}

/// The host-returning checks: sum of squares within 1e-12 relative
/// (another f64 order), unscale's values bit for bit and its flag,
/// all_finite both ways.
#[test]
fn norms_and_finiteness_match_the_cpu() {
    let Some(pool) = gpu() else { return };
    let cpu = Pool::new();
    let n = 20_000;
    let v = values(n, 61);
    let (gv, cv) = (t(&pool, &[n], &v), t(&cpu, &[n], &v));
    let (gs, cs) = (
        backend::sum_squares(&gv).unwrap(),
        backend::sum_squares(&cv).unwrap(),
    );
    assert!(
        (gs - cs).abs() <= 1e-12 * cs,
        "sum_squares gpu {gs} cpu {cs}"
    );
    assert!(backend::all_finite(&gv).unwrap());
    let (mut gu, mut cu) = (t(&pool, &[n], &v), t(&cpu, &[n], &v));
    assert!(!backend::unscale(&mut gu, 0.125).unwrap());
    assert!(!backend::unscale(&mut cu, 0.125).unwrap());
    assert_bits("unscale", &host(&gu), cu.f32());
    let mut w = v.clone();
    w[12_345] = f32::INFINITY;
    let mut gw = t(&pool, &[n], &w);
    assert!(!backend::all_finite(&gw).unwrap());
    assert!(backend::unscale(&mut gw, 0.5).unwrap());
    w[12_345] = f32::NAN;
    let gw = t(&pool, &[n], &w);
    assert!(!backend::all_finite(&gw).unwrap());
}

/// A step's totals on the device against the CPU's host totals: two
/// micro-batches' loss shares (1e-12 relative: per-row sums in another
/// order) and hits exact, the flag of unscale and the finite checks, the
/// clipping sum over two tensors (1e-12 relative), and one device read.
#[test]
fn step_totals_match_the_cpu() {
    let Some(pool) = gpu() else { return };
    let cpu = Pool::new();
    let (n, classes, window) = (6, 11, 10);
    let read = |totals: &backend::StepTotals| {
        let before = backend::host_reads();
        let t = totals.read().unwrap();
        (t, backend::host_reads() - before)
    };
    let mut totals = [&pool, &cpu].map(|p| backend::StepTotals::new(p).unwrap());
    for (i, p) in [&pool, &cpu].into_iter().enumerate() {
        for (m, share) in [(0u32, (n, window)), (1, (window - n, window))] {
            let rows = share.0;
            let z: Vec<f32> = values(rows * classes, 70 + m)
                .iter()
                .map(|v| v * 3.0)
                .collect();
            let labels: Vec<usize> = (0..rows).map(|r| (r * 5 + m as usize) % classes).collect();
            let z = t(p, &[rows, classes], &z);
            let mut d = empty(p, &[rows, classes]);
            backend::cross_entropy_add(
                &mut totals[i],
                &mut d,
                &z,
                &labels,
                0.1,
                window,
                None,
                Precision::F32,
                Some(share),
            )
            .unwrap();
        }
        let mut a = t(p, &[20_000], &values(20_000, 81));
        let b = t(p, &[333], &values(333, 82));
        backend::unscale_add(&mut totals[i], &mut a, 0.25).unwrap();
        backend::check_finite_add(&mut totals[i], &b).unwrap();
        backend::sum_squares_add(&mut totals[i], &a).unwrap();
        backend::sum_squares_add(&mut totals[i], &b).unwrap();
    }
    let ((g, g_reads), (c, c_reads)) = (read(&totals[0]), read(&totals[1]));
    assert_eq!((g_reads, c_reads), (1, 0), "device reads");
    assert!(
        (g.loss - c.loss).abs() <= 1e-12 * c.loss,
        "loss gpu {} cpu {}",
        g.loss,
        c.loss
    );
    assert_eq!(g.correct, c.correct, "hits");
    assert!(!g.non_finite && !c.non_finite, "all finite");
    assert!(
        (g.sum_squares - c.sum_squares).abs() <= 1e-12 * c.sum_squares,
        "sum of squares gpu {} cpu {}",
        g.sum_squares,
        c.sum_squares
    );
    // One inf among many tensors sets the one flag, by either check.
    for (k, unscaled) in [(0, true), (1, false)] {
        let mut gt = backend::StepTotals::new(&pool).unwrap();
        let mut w = values(5000, 90 + k);
        w[4321] = if unscaled { f32::INFINITY } else { f32::NAN };
        let fine = t(&pool, &[777], &values(777, 95));
        let mut bad = t(&pool, &[5000], &w);
        backend::check_finite_add(&mut gt, &fine).unwrap();
        if unscaled {
            backend::unscale_add(&mut gt, &mut bad, 0.5).unwrap();
        } else {
            backend::check_finite_add(&mut gt, &bad).unwrap();
        }
        backend::check_finite_add(&mut gt, &fine).unwrap();
        assert!(read(&gt).0.non_finite, "flag set (unscale: {unscaled})");
    }
}

/// The gradients of every parameter, by name.
fn grads(model: &mut ResNet) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    model.visit_params(|p| out.push((p.name.clone(), backend::copy_to_host(&p.grad).unwrap())));
    out
}

/// The BN running statistics and `num_batches_tracked` of every layer, by
/// name.
type Buffers = (Vec<(String, Vec<f32>)>, Vec<(String, i64)>);
fn buffers(model: &mut ResNet) -> Buffers {
    let (mut stats, mut counts) = (Vec::new(), Vec::new());
    model.visit_state(|slot| {
        let name = slot.name().to_string();
        match slot {
            StateSlot::Buffer { tensor, .. } => {
                stats.push((name, backend::copy_to_host(tensor).unwrap()))
            }
            StateSlot::Count { value, .. } => counts.push((name, *value)),
            StateSlot::Param { .. } => {}
        }
    });
    (stats, counts)
}

/// One fp32 training step (batch statistics, the loss, every backward) of
/// tiny basic and bottleneck ResNets on the GPU against the CPU: the loss
/// within 1e-4 relative, the same top-1 count, every gradient within
/// 1e-3 normwise per tensor (cuDNN and cuBLAS sum in other orders, and the
/// differences grow through the layers); then the same step with every
/// stage recomputed gives the GPU's keep-all gradients bit for bit
/// (deterministic algorithms, one stream). The same in bf16 and f16
/// (operands rounded by the layers, f32 products on both devices): a sum
/// that lands on the other side of a rounding boundary moves a value by an
/// ulp, and that spreads, so the loss within 2e-2 (bf16) / 5e-3 (f16)
/// relative, the top-1 count within 1, gradients within 5e-2 / 1e-2
/// normwise: first tolerances, to be confirmed on a GPU. The BN running
/// statistics after the step within the gradients' tolerance (the
/// recomputed run's bit for bit: they advance once), `num_batches_tracked`
/// exact, and an evaluation forward on the running statistics within the
/// loss's tolerance normwise.
#[test]
fn whole_step_matches_the_cpu() {
    let (n, size, classes) = (4, 32, 10);
    let images = values(n * size * size * 3, 71);
    let labels: Vec<usize> = (0..n).map(|i| (i * 3) % classes).collect();
    let dims = [n, size, size, 3];
    let eval = |model: &mut ResNet, pool: &Pool| {
        let x = pool
            .from_f32(&dims, &images, Category::Data, Tag::fixed("images"))
            .unwrap();
        backend::copy_to_host(&forward_eval(model, pool, x).unwrap()).unwrap()
    };
    let run = |model: &mut ResNet, pool: &Pool, plan: &Plan| {
        let x = pool
            .from_f32(&dims, &images, Category::Data, Tag::fixed("images"))
            .unwrap();
        forward_backward(model, pool, plan, x, &labels, LossOptions::default()).unwrap()
    };
    // Every stage but the head (which cannot be) recomputed, each its own
    // segment.
    let recompute_plan = |stages: usize| {
        let mut flags = vec![true; stages];
        flags[stages - 1] = false;
        Plan::from_flags(&flags, &vec![true; stages])
    };
    // The CPU half runs here too (the reference, and the test's own plan
    // logic: recomputing gives keep-all's bits on the CPU as well).
    let mut cpu_runs = Vec::new();
    // Every block and precision with torchvision's stem, and the small
    // stem (its fused ReLU mask kernel) once.
    let cases = [BlockKind::Basic, BlockKind::Bottleneck]
        .into_iter()
        .flat_map(|b| Precision::ALL.map(|p| (b, p, StemKind::ImageNet)))
        .chain([(BlockKind::Basic, Precision::F32, StemKind::Small)]);
    for (block, precision, stem) in cases {
        let cpu_pool = Pool::new();
        let config = ResNetConfig {
            block,
            layers: [1, 1, 1, 1],
            base_width: 8,
            num_classes: classes,
            stem,
            zero_init_residual: false,
            seed: 7,
            precision,
            recompute_bn_relu: false,
            target: Target::Cpu,
        };
        let mut model = ResNet::new(&cpu_pool, config.clone()).unwrap();
        let keep = Plan::keep_all(&model);
        let out = run(&mut model, &cpu_pool, &keep);
        let g = grads(&mut model);
        let bufs = buffers(&mut model);
        let eval_logits = eval(&mut model, &cpu_pool);
        let mut again = ResNet::new(&cpu_pool, config.clone()).unwrap();
        let plan = recompute_plan(again.stages.len());
        plan.validate(again.stages.len()).unwrap();
        run(&mut again, &cpu_pool, &plan);
        for ((name, a), (_, b)) in grads(&mut again).iter().zip(&g) {
            assert_bits(
                &format!("cpu {block:?} {precision} recomputed grad {name}"),
                a,
                b,
            );
        }
        cpu_runs.push((config, out, g, bufs, eval_logits));
    }
    let Some(gpu_pool) = gpu() else { return };
    if !CUDA_BACKEND_COMPLETE {
        println!("note: CUDA_BACKEND_COMPLETE is false in this build; running the steps anyway");
    }
    for (mut config, co, cg, (cstats, ccounts), ceval) in cpu_runs {
        let (block, p) = (config.block, config.precision);
        let (loss_tol, grad_tol, hits) = match p {
            Precision::F32 => (1e-4, 1e-3, 0),
            // bf16: the GPU's cuDNN rounds each dgrad to bf16 before it is
            // added into a gradient that already holds the shortcut's (the
            // CPU rounds the sum once), a one-ulp difference the backward
            // carries to the stem, where a BN bias gradient is a sum that
            // cancels to a twentieth of the largest: each gradient within
            // 1e-1 normwise, and their median within 1e-2 (below).
            Precision::BF16 => (2e-2, 1e-1, 1),
            Precision::F16 => (5e-3, 1e-2, 1),
        };
        config.target = Target::Cuda(0);
        let mut gpu_model = ResNet::new(&gpu_pool, config.clone()).unwrap();
        let keep = Plan::keep_all(&gpu_model);
        let go = run(&mut gpu_model, &gpu_pool, &keep);
        assert!(
            (go.loss - co.loss).abs() <= loss_tol * co.loss.abs(),
            "{block:?} {p} loss gpu {} cpu {}",
            go.loss,
            co.loss
        );
        assert!(
            go.correct.abs_diff(co.correct) <= hits,
            "{block:?} {p} correct gpu {} cpu {}",
            go.correct,
            co.correct
        );
        let gg = grads(&mut gpu_model);
        assert_eq!(gg.len(), cg.len());
        let mut worst = Vec::new();
        for ((name, g), (cname, c)) in gg.iter().zip(&cg) {
            assert_eq!(name, cname);
            assert_close_normwise(&format!("{block:?} {p} grad {name}"), g, c, grad_tol);
            let scale = c.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
            let d = g
                .iter()
                .zip(c)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            worst.push(d / scale);
        }
        worst.sort_by(f32::total_cmp);
        let median = worst[worst.len() / 2];
        assert!(
            median <= grad_tol / 10.0,
            "{block:?} {p}: median normwise gradient error {median}"
        );
        let (gstats, gcounts) = buffers(&mut gpu_model);
        assert_eq!(gcounts, ccounts, "{block:?} {p} num_batches_tracked");
        for ((name, g), (_, c)) in gstats.iter().zip(&cstats) {
            assert_close_normwise(&format!("{block:?} {p} running {name}"), g, c, grad_tol);
        }
        let geval = eval(&mut gpu_model, &gpu_pool);
        assert_close_normwise(
            &format!("{block:?} {p} eval logits"),
            &geval,
            &ceval,
            loss_tol as f32,
        );
        // Recompute: the same GPU gradients, bit for bit.
        let mut again = ResNet::new(&gpu_pool, config.clone()).unwrap();
        let plan = recompute_plan(again.stages.len());
        run(&mut again, &gpu_pool, &plan);
        for ((name, a), (_, b)) in grads(&mut again).iter().zip(&gg) {
            assert_bits(&format!("{block:?} {p} recomputed grad {name}"), a, b);
        }
        let (astats, acounts) = buffers(&mut again);
        assert_eq!(
            acounts, gcounts,
            "{block:?} {p} recomputed num_batches_tracked"
        );
        for ((name, a), (_, b)) in astats.iter().zip(&gstats) {
            assert_bits(&format!("{block:?} {p} recomputed running {name}"), a, b);
        }
    }
}

/// Two optimizer steps of `TrainStep` on each device (accumulation over two
/// micro-batches, clipping, SGD with momentum and weight decay; f16 with
/// the loss scaler): what only a real step runs on the GPU (the totals
/// read once, unscale, the finite checks, the BN roll-back copy, clipping's
/// scale, the optimizer) against the CPU. Reported losses within the whole
/// step's tolerance, the clipping norm within 1e-3 (f16: 1e-2) relative,
/// the scaler's decision equal (a step it skips, as f16's first here at
/// the default scale, has no clipping norm on either device), and every
/// weight after the steps within 1e-4 (f16: 1e-3) normwise.
#[test]
fn train_steps_match_the_cpu() {
    use memfit::optim::{GradScaler, Optimizer, Sgd};
    use memfit::train::NanPolicy;
    use memfit::train::step::{StepPolicy, TrainStep};
    let (window, size, classes) = (4, 32, 10);
    let images = values(window * size * size * 3, 91);
    let labels: Vec<usize> = (0..window).map(|i| (i * 7) % classes).collect();
    let steps = |pool: &Pool, target: Target, p: Precision| {
        let config = ResNetConfig {
            block: BlockKind::Basic,
            layers: [1, 1, 1, 1],
            base_width: 8,
            num_classes: classes,
            stem: StemKind::ImageNet,
            zero_init_residual: false,
            seed: 11,
            precision: p,
            recompute_bn_relu: false,
            target,
        };
        let mut model = ResNet::new(pool, config).unwrap();
        let mut opt = Optimizer::Sgd(Sgd::new(0.05, 0.9, 1e-4, false));
        let mut step = TrainStep::new(
            StepPolicy {
                plan: Plan::keep_all(&model),
                micro_batch: 2,
                label_smoothing: 0.1,
                clip_grad_norm: Some(0.5),
                nan_policy: NanPolicy::Stop,
            },
            (p == Precision::F16).then(GradScaler::default),
        );
        let reports: Vec<_> = (1..=2)
            .map(|i| {
                step.run(
                    &mut model,
                    pool,
                    &mut opt,
                    &images,
                    (size, size),
                    &labels,
                    window,
                    i,
                    false,
                )
                .unwrap()
            })
            .collect();
        let mut weights = Vec::new();
        model.visit_params(|q| {
            weights.push((q.name.clone(), backend::copy_to_host(&q.value).unwrap()))
        });
        (reports, weights)
    };
    let cpu_runs: Vec<_> = [Precision::F32, Precision::F16]
        .map(|p| (p, steps(&Pool::new(), Target::Cpu, p)))
        .into();
    let Some(gpu_pool) = gpu() else { return };
    for (p, (creports, cweights)) in cpu_runs {
        let (loss_tol, norm_tol, w_tol) = match p {
            Precision::F16 => (5e-3, 1e-2, 1e-3),
            _ => (1e-4, 1e-3, 1e-4),
        };
        let (greports, gweights) = steps(&gpu_pool, Target::Cuda(0), p);
        for (i, (g, c)) in greports.iter().zip(&creports).enumerate() {
            assert!(
                (g.loss - c.loss).abs() <= loss_tol * c.loss.abs(),
                "{p} step {i} loss gpu {} cpu {}",
                g.loss,
                c.loss
            );
            // The scaler's decision first: a skipped step has no norm.
            assert_eq!(
                g.scaled.map(|s| (s.scale, s.skipped)),
                c.scaled.map(|s| (s.scale, s.skipped)),
                "{p} step {i} scaler"
            );
            match (g.grad_norm, c.grad_norm) {
                (Some(gn), Some(cn)) => assert!(
                    (gn - cn).abs() <= norm_tol * cn.abs(),
                    "{p} step {i} norm gpu {gn} cpu {cn}"
                ),
                // Only a step the scaler skipped may lack one.
                (gn, cn) => assert!(
                    gn.is_none() && cn.is_none() && g.scaled.is_some_and(|s| s.skipped),
                    "{p} step {i}: clipping norm gpu {gn:?} cpu {cn:?}"
                ),
            }
        }
        for ((name, g), (_, c)) in gweights.iter().zip(&cweights) {
            assert_close_normwise(&format!("{p} weight {name} after 2 steps"), g, c, w_tol);
        }
    }
}
