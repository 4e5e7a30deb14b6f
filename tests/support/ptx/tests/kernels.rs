//! The real kernels: every source parses for both architectures, and a few
//! run against results computed here.

mod common;

use common::*;
use memfit_ptx::{Module, launch};

#[test]
fn every_kernel_parses() {
    let Some(nv) = Nvrtc::load() else { return };
    let mut count = 0;
    for (name, src) in kernel_sources() {
        for arch in ["compute_75", "compute_90"] {
            let ptx = nv.compile(&name, &src, arch);
            let m = Module::parse(&ptx).unwrap_or_else(|e| panic!("{name} ({arch}): {e}"));
            assert!(!m.kernel_names().is_empty(), "{name}: no kernels");
            count += m.kernel_names().len();
        }
    }
    eprintln!("{count} kernels parsed");
}

fn module(source: &str, arch: &str) -> Option<Module> {
    let ptx = ptx_of(source, arch)?;
    Some(Module::parse(&ptx).expect("parses"))
}

/// Inputs with the awkward cases of a 16-bit narrowing.
fn awkward_f32s(n: usize) -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.5,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0xFFC0_1234),
        65504.0,
        65519.99,
        65520.0,
        1e-8,
        5.960_464_5e-8,
        2.980_232_2e-8,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x3F80_8000), // bf16 tie, even
        f32::from_bits(0x3F81_8000), // bf16 tie, odd
        f32::MAX,
    ];
    let mut s = 0x1234_5678u32;
    while v.len() < n {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        v.push(f32::from_bits(s));
    }
    v
}

fn bf16_formula(x: f32) -> u16 {
    let b = x.to_bits();
    if (b & 0x7fff_ffff) > 0x7f80_0000 {
        ((b >> 16) | 0x40) as u16
    } else {
        ((b.wrapping_add(0x7fff).wrapping_add((b >> 16) & 1)) >> 16) as u16
    }
}

#[test]
fn cast_kernels_match_the_bit_formulas() {
    for arch in ["compute_75", "compute_90"] {
        let Some(m) = module("cast", arch) else {
            return;
        };
        let n = 3000;
        let x = awkward_f32s(n);
        let mut mem = VecMemory::default();
        let src = mem.upload_f32(&x);
        let bf = mem.alloc(2 * n);
        let h = mem.alloc(2 * n);
        let grid = [(n as u32).div_ceil(256), 1, 1];
        let k = m.kernel("cast_f32_to_bf16").unwrap();
        launch(
            k,
            grid,
            [256, 1, 1],
            0,
            &[p64(bf), p64(src), p64(n as u64)],
            &mut mem,
        )
        .unwrap();
        let k = m.kernel("cast_f32_to_f16").unwrap();
        launch(
            k,
            grid,
            [256, 1, 1],
            0,
            &[p64(h), p64(src), p64(n as u64)],
            &mut mem,
        )
        .unwrap();
        for (i, (&b, &hh)) in mem.u16s(bf).iter().zip(&mem.u16s(h)).enumerate() {
            assert_eq!(
                b,
                bf16_formula(x[i]),
                "bf16 of {:?} ({:#x})",
                x[i],
                x[i].to_bits()
            );
            let want = half::f16::from_f32(x[i]);
            if x[i].is_nan() {
                assert!(half::f16::from_bits(hh).is_nan());
            } else {
                assert_eq!(
                    hh,
                    want.to_bits(),
                    "f16 of {:?} ({:#x})",
                    x[i],
                    x[i].to_bits()
                );
            }
        }
        // Every f16 pattern widens exactly.
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let hs = mem.upload_u16(&all);
        let out = mem.alloc(4 * all.len());
        let k = m.kernel("cast_f16_to_f32").unwrap();
        launch(
            k,
            [256, 1, 1],
            [256, 1, 1],
            0,
            &[p64(out), p64(hs), p64(all.len() as u64)],
            &mut mem,
        )
        .unwrap();
        for (b, y) in all.iter().zip(mem.f32s(out)) {
            let want = half::f16::from_bits(*b).to_f32();
            assert!(
                want.to_bits() == y.to_bits() || (want.is_nan() && y.is_nan()),
                "{b:#x}"
            );
        }
        // round_inplace with ROUND_BF16 (1).
        let v = mem.upload_f32(&x);
        let k = m.kernel("round_inplace").unwrap();
        launch(
            k,
            grid,
            [256, 1, 1],
            0,
            &[p64(v), p64(n as u64), p32(1)],
            &mut mem,
        )
        .unwrap();
        for (i, y) in mem.f32s(v).iter().enumerate() {
            assert_eq!(y.to_bits(), (bf16_formula(x[i]) as u32) << 16);
        }
    }
}

#[test]
fn sum_squares_matches_an_f64_sum() {
    for arch in ["compute_75", "compute_90"] {
        let Some(m) = module("reduce", arch) else {
            return;
        };
        let n = 20000usize;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let mut mem = VecMemory::default();
        let xs = mem.upload_f32(&x);
        let blocks = n.div_ceil(8192);
        let partial = mem.alloc(8 * blocks);
        let k = m.kernel("sum_squares_partial").unwrap();
        assert_eq!(k.static_shared_bytes(), 2048);
        let stats = launch(
            k,
            [blocks as u32, 1, 1],
            [256, 1, 1],
            0,
            &[p64(partial), p64(xs), p64(n as u64)],
            &mut mem,
        )
        .unwrap();
        assert_eq!(stats.threads, 256 * blocks as u64);
        let acc = mem.upload(&0f64.to_le_bytes());
        let k = m.kernel("sum_squares_finish_add").unwrap();
        launch(
            k,
            [1, 1, 1],
            [1, 1, 1],
            0,
            &[p64(acc), p64(partial), p64(blocks as u64)],
            &mut mem,
        )
        .unwrap();
        let got = mem.f64s(acc)[0];
        let want: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
        assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
        // Each partial is its chunk's sum.
        for (b, p) in mem.f64s(partial).iter().enumerate() {
            let w: f64 = x[b * 8192..((b + 1) * 8192).min(n)]
                .iter()
                .map(|&v| (v as f64) * (v as f64))
                .sum();
            assert!((p - w).abs() <= 1e-12 * w);
        }
    }
}

#[test]
fn maxpool_forward_matches_a_reference() {
    let Some(m) = module("pool", "compute_75") else {
        return;
    };
    let (n, h, w, c, k, stride, pad) = (2usize, 7usize, 6usize, 3usize, 3usize, 2usize, 1usize);
    let oh = (h + 2 * pad - k) / stride + 1;
    let ow = (w + 2 * pad - k) / stride + 1;
    let mut x: Vec<f32> = (0..n * h * w * c)
        .map(|i| ((i * 7919) % 97) as f32 - 48.0)
        .collect();
    x[5] = f32::NAN;
    let mut mem = VecMemory::default();
    let xs = mem.upload_f32(&x);
    let total = n * oh * ow * c;
    let y = mem.alloc(4 * total);
    let kern = m.kernel("maxpool_forward").unwrap();
    let p = |v: usize| p32(v as u32);
    let params = [
        p64(y),
        p64(xs),
        p(n),
        p(h),
        p(w),
        p(c),
        p(k),
        p(stride),
        p(pad),
        p(oh),
        p(ow),
    ];
    launch(
        kern,
        [(total as u32).div_ceil(64), 1, 1],
        [64, 1, 1],
        0,
        &params,
        &mut mem,
    )
    .unwrap();
    let got = mem.f32s(y);
    for b in 0..n {
        for oy in 0..oh {
            for ox in 0..ow {
                for ch in 0..c {
                    let mut o = f32::NEG_INFINITY;
                    for iy in (oy * stride) as isize - pad as isize
                        ..(oy * stride + k) as isize - pad as isize
                    {
                        for ix in (ox * stride) as isize - pad as isize
                            ..(ox * stride + k) as isize - pad as isize
                        {
                            if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                continue;
                            }
                            let v = x[((b * h + iy as usize) * w + ix as usize) * c + ch];
                            if v > o || v.is_nan() {
                                o = v;
                            }
                        }
                    }
                    let g = got[((b * oh + oy) * ow + ox) * c + ch];
                    assert!(
                        g == o || (g.is_nan() && o.is_nan()),
                        "({b},{oy},{ox},{ch}): {g} vs {o}"
                    );
                }
            }
        }
    }
}

#[test]
fn bias_kernels_match() {
    let Some(m) = module("linear", "compute_90") else {
        return;
    };
    let (n, out) = (37usize, 10usize);
    let b: Vec<f32> = (0..out).map(|i| i as f32 * 0.25 - 1.0).collect();
    let dy: Vec<f32> = (0..n * out).map(|i| (i % 13) as f32 * 0.1).collect();
    let mut mem = VecMemory::default();
    let bs = mem.upload_f32(&b);
    let y = mem.alloc(4 * n * out);
    launch(
        m.kernel("bias_rows").unwrap(),
        [2, 1, 1],
        [256, 1, 1],
        0,
        &[p64(y), p64(bs), p64(n as u64), p32(out as u32)],
        &mut mem,
    )
    .unwrap();
    for (i, v) in mem.f32s(y).iter().enumerate() {
        assert_eq!(*v, b[i % out]);
    }
    let dys = mem.upload_f32(&dy);
    let db = mem.upload_f32(&vec![0.5; out]);
    launch(
        m.kernel("bias_grad").unwrap(),
        [1, 1, 1],
        [32, 1, 1],
        0,
        &[p64(db), p64(dys), p64(n as u64), p32(out as u32)],
        &mut mem,
    )
    .unwrap();
    for (o, v) in mem.f32s(db).iter().enumerate() {
        let mut d = 0.5f32;
        for r in 0..n {
            d += dy[r * out + o];
        }
        assert_eq!(v.to_bits(), d.to_bits());
    }
}

/// Runs relu_mask_forward and cast_f32_to_bf16 over 2^20 elements, checks
/// them and prints the interpreter's speed.
#[test]
fn throughput_on_a_million_elements() {
    let Some(m) = module("relu", "compute_75") else {
        return;
    };
    let Some(c) = module("cast", "compute_75") else {
        return;
    };
    let n = 1usize << 20;
    let x: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
    let mut mem = VecMemory::default();
    let xs = mem.upload_f32(&x);
    let mask = mem.alloc(n / 8);
    let k = m.kernel("relu_mask_forward").unwrap();
    let t = std::time::Instant::now();
    let s = launch(
        k,
        [(n as u32 / 8).div_ceil(256), 1, 1],
        [256, 1, 1],
        0,
        &[p64(xs), p64(mask), p64(n as u64)],
        &mut mem,
    )
    .unwrap();
    let dt = t.elapsed().as_secs_f64();
    eprintln!(
        "relu_mask_forward, {n} elements: {} instructions in {:.3} s = {:.1} M instructions/s",
        s.instructions,
        dt,
        s.instructions as f64 / dt / 1e6
    );
    let y = mem.f32s(xs);
    for i in 0..n {
        assert_eq!(y[i], x[i].max(0.0));
    }
    for (b, m) in mem.bytes(mask).iter().enumerate() {
        let want = (0..8).fold(0u8, |acc, j| acc | (((x[b * 8 + j] > 0.0) as u8) << j));
        assert_eq!(*m, want);
    }
    let k = c.kernel("cast_f32_to_bf16").unwrap();
    let out = mem.alloc(2 * n);
    let t = std::time::Instant::now();
    let s = launch(
        k,
        [(n as u32).div_ceil(256), 1, 1],
        [256, 1, 1],
        0,
        &[p64(out), p64(xs), p64(n as u64)],
        &mut mem,
    )
    .unwrap();
    let dt = t.elapsed().as_secs_f64();
    eprintln!(
        "cast_f32_to_bf16, {n} elements: {} instructions in {:.3} s = {:.1} M instructions/s",
        s.instructions,
        dt,
        s.instructions as f64 / dt / 1e6
    );
    assert_eq!(mem.u16s(out)[5], bf16_formula(y[5]));
}

/// The C parameter list of each `extern "C" __global__` kernel in a source.
fn signatures(src: &str) -> Vec<(String, Vec<String>)> {
    let key = "extern \"C\" __global__ void ";
    let mut out = Vec::new();
    for (i, _) in src.match_indices(key) {
        let rest = &src[i + key.len()..];
        let open = rest.find('(').unwrap();
        let close = rest.find(')').unwrap();
        let params = rest[open + 1..close]
            .split(',')
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        out.push((rest[..open].trim().to_string(), params));
    }
    out
}

/// Every kernel of every source runs, on small made-up arguments (sizes 3,
/// pointers to generous buffers of small values), without a fault: a smoke
/// test of the interpreter over all the PTX the backend has.
#[test]
fn every_kernel_runs_on_small_arguments() {
    let Some(nv) = Nvrtc::load() else { return };
    let opts = memfit_ptx::LaunchOptions {
        instruction_budget: 1 << 26,
        ..Default::default()
    };
    let mut ran = 0;
    for (name, src) in kernel_sources() {
        for arch in ["compute_75", "compute_90"] {
            let m = Module::parse(&nv.compile(&name, &src, arch)).unwrap();
            for (kname, cparams) in signatures(&src) {
                let k = m
                    .kernel(&kname)
                    .unwrap_or_else(|| panic!("{kname} in {name}"));
                assert_eq!(k.params().len(), cparams.len(), "{kname}");
                let mut mem = VecMemory::default();
                let vals: Vec<f32> = (0..16384).map(|i| (i % 5) as f32 * 0.25 + 0.5).collect();
                let params: Vec<Vec<u8>> = cparams
                    .iter()
                    .map(|p| {
                        if p.contains('*') {
                            p64(mem.upload_f32(&vals))
                        } else if p.starts_with("long long") {
                            p64(3)
                        } else if p.starts_with("float") {
                            pf32(0.5)
                        } else if p.starts_with("int") || p.starts_with("unsigned") {
                            p32(if p.ends_with("round") { 0 } else { 3 })
                        } else if p.starts_with("double") {
                            0.5f64.to_le_bytes().to_vec()
                        } else {
                            panic!("{kname}: parameter `{p}`")
                        }
                    })
                    .collect();
                let block = if k.static_shared_bytes() > 0 { 256 } else { 64 };
                memfit_ptx::launch_with(k, [2, 1, 1], [block, 1, 1], 0, &params, &mut mem, &opts)
                    .unwrap_or_else(|f| panic!("{arch}: {f}"));
                ran += 1;
            }
        }
    }
    eprintln!("{ran} kernel launches");
}
