//! Each instruction class on hand-written PTX, edge cases checked against
//! Rust's own arithmetic.

mod common;

use common::*;
use memfit_ptx::{Module, launch};

/// Register prefix, declaration type and load/store type of a value type.
fn class(ty: &str) -> (&'static str, &'static str, &'static str) {
    match ty {
        "pred" => ("%p", ".pred", ""),
        "f32" => ("%f", ".f32", "b32"),
        "f64" => ("%fd", ".f64", "b64"),
        "f16" | "u16" | "s16" | "b16" => ("%rs", ".b16", "b16"),
        "u32" | "s32" | "b32" => ("%r", ".b32", "b32"),
        _ => ("%rd", ".b64", "b64"),
    }
}

/// Runs `op` (with `$d` the destination of type `out`, `$0`, `$1`, ...
/// the inputs) in one thread and returns the destination's bits.
fn run(op: &str, ins: &[(&str, u64)], out: &str) -> u64 {
    let mut body = String::new();
    let mut op = op.to_string();
    for (i, (ty, _)) in ins.iter().enumerate() {
        let (pre, _, st) = class(ty);
        let reg = format!("{pre}{i}");
        if *ty == "pred" {
            body += &format!(
                "\tld.global.u32 %r9, [%ptr1+{}];\n\tsetp.ne.s32 {reg}, %r9, 0;\n",
                8 * i
            );
        } else {
            body += &format!("\tld.global.{st} {reg}, [%ptr1+{}];\n", 8 * i);
        }
        op = op.replace(&format!("${i}"), &reg);
    }
    let (pre, _, st) = class(out);
    let dst = format!("{pre}8");
    op = op.replace("$d", &dst);
    body += &format!("\t{op};\n");
    if out == "pred" {
        body += &format!("\tselp.u32 %r9, 1, 0, {dst};\n\tst.global.u32 [%ptr0], %r9;\n");
    } else {
        body += &format!("\tst.global.{st} [%ptr0], {dst};\n");
    }
    let ptx = format!(
        ".version 9.0\n.target sm_75\n.address_size 64\n\n.visible .entry t(\n\t.param .u64 t_out,\n\t.param .u64 t_in\n)\n{{\n\t.reg .b64 %ptr<2>;\n\t.reg .pred %p<10>;\n\t.reg .b16 %rs<10>;\n\t.reg .b32 %r<10>;\n\t.reg .b64 %rd<10>;\n\t.reg .f32 %f<10>;\n\t.reg .f64 %fd<10>;\n\tld.param.u64 %ptr0, [t_out];\n\tld.param.u64 %ptr1, [t_in];\n{body}\tret;\n}}\n"
    );
    let m = Module::parse(&ptx).unwrap_or_else(|e| panic!("{e}\n{ptx}"));
    let mut mem = VecMemory::default();
    let inp = mem.upload(
        &ins.iter()
            .flat_map(|(_, v)| v.to_le_bytes())
            .collect::<Vec<_>>(),
    );
    let o = mem.upload(&[0u8; 8]);
    launch(
        m.kernel("t").unwrap(),
        [1, 1, 1],
        [1, 1, 1],
        0,
        &[p64(o), p64(inp)],
        &mut mem,
    )
    .unwrap_or_else(|f| panic!("{f}"));
    mem.u64s(o)[0]
}

fn bin(op: &str, ty: &str, a: u64, b: u64) -> u64 {
    run(&format!("{op} $d, $0, $1"), &[(ty, a), (ty, b)], ty)
}

const I32S: [i32; 9] = [
    0,
    1,
    -1,
    7,
    -7,
    i32::MAX,
    i32::MIN,
    0x1234_5678,
    -0x0765_4321,
];
const I64S: [i64; 7] = [0, 1, -1, 3, -3, i64::MAX, i64::MIN];

fn m32(v: i32) -> u64 {
    v as u32 as u64
}

#[test]
fn integer_arithmetic_wraps() {
    for &a in &I32S {
        for &b in &I32S {
            let (ua, ub) = (m32(a), m32(b));
            assert_eq!(bin("add.s32", "s32", ua, ub), m32(a.wrapping_add(b)));
            assert_eq!(bin("sub.s32", "s32", ua, ub), m32(a.wrapping_sub(b)));
            assert_eq!(bin("mul.lo.s32", "s32", ua, ub), m32(a.wrapping_mul(b)));
            assert_eq!(
                bin("mul.hi.s32", "s32", ua, ub),
                m32(((a as i64 * b as i64) >> 32) as i32)
            );
            assert_eq!(bin("mul.hi.u32", "u32", ua, ub), (ua * ub) >> 32);
            assert_eq!(
                run(
                    "mul.wide.s32 $d, $0, $1",
                    &[("s32", ua), ("s32", ub)],
                    "s64"
                ),
                (a as i64 * b as i64) as u64
            );
            assert_eq!(
                run(
                    "mul.wide.u32 $d, $0, $1",
                    &[("u32", ua), ("u32", ub)],
                    "u64"
                ),
                ua * ub
            );
            assert_eq!(
                run(
                    "mad.lo.s32 $d, $0, $1, $2",
                    &[("s32", ua), ("s32", ub), ("s32", 5)],
                    "s32"
                ),
                m32(a.wrapping_mul(b).wrapping_add(5))
            );
            assert_eq!(bin("min.s32", "s32", ua, ub), m32(a.min(b)));
            assert_eq!(bin("max.s32", "s32", ua, ub), m32(a.max(b)));
            assert_eq!(bin("min.u32", "u32", ua, ub), ua.min(ub));
            assert_eq!(bin("max.u32", "u32", ua, ub), ua.max(ub));
            if b != 0 {
                // Truncating division, remainder takes the dividend's sign, MIN / -1 wraps.
                assert_eq!(
                    bin("div.s32", "s32", ua, ub),
                    m32(a.wrapping_div(b)),
                    "{a} / {b}"
                );
                assert_eq!(
                    bin("rem.s32", "s32", ua, ub),
                    m32(a.wrapping_rem(b)),
                    "{a} % {b}"
                );
                assert_eq!(bin("div.u32", "u32", ua, ub), ua / ub);
                assert_eq!(bin("rem.u32", "u32", ua, ub), ua % ub);
            }
        }
        assert_eq!(
            run("neg.s32 $d, $0", &[("s32", m32(a))], "s32"),
            m32(a.wrapping_neg())
        );
        assert_eq!(
            run("abs.s32 $d, $0", &[("s32", m32(a))], "s32"),
            m32(a.wrapping_abs())
        );
        assert_eq!(run("not.b32 $d, $0", &[("b32", m32(a))], "b32"), m32(!a));
    }
    for &a in &I64S {
        for &b in &I64S {
            let (ua, ub) = (a as u64, b as u64);
            assert_eq!(bin("add.s64", "s64", ua, ub), a.wrapping_add(b) as u64);
            assert_eq!(bin("sub.s64", "s64", ua, ub), a.wrapping_sub(b) as u64);
            assert_eq!(bin("mul.lo.s64", "s64", ua, ub), a.wrapping_mul(b) as u64);
            assert_eq!(
                bin("mul.hi.s64", "s64", ua, ub),
                ((a as i128 * b as i128) >> 64) as u64
            );
            assert_eq!(bin("min.s64", "s64", ua, ub), a.min(b) as u64);
            assert_eq!(bin("max.s64", "s64", ua, ub), a.max(b) as u64);
            assert_eq!(bin("min.u64", "u64", ua, ub), ua.min(ub));
            if b != 0 {
                assert_eq!(bin("div.s64", "s64", ua, ub), a.wrapping_div(b) as u64);
                assert_eq!(bin("rem.s64", "s64", ua, ub), a.wrapping_rem(b) as u64);
                assert_eq!(bin("div.u64", "u64", ua, ub), ua / ub);
                assert_eq!(bin("rem.u64", "u64", ua, ub), ua % ub);
            }
        }
        assert_eq!(
            run("neg.s64 $d, $0", &[("s64", a as u64)], "s64"),
            a.wrapping_neg() as u64
        );
        assert_eq!(
            run("not.b64 $d, $0", &[("b64", a as u64)], "b64"),
            !a as u64
        );
    }
    // Division by zero: all ones; remainder by zero: the dividend (as NVIDIA GPUs do).
    assert_eq!(bin("div.u32", "u32", 7, 0), 0xFFFF_FFFF);
    assert_eq!(bin("rem.u32", "u32", 7, 0), 7);
    assert_eq!(bin("div.s64", "s64", 7, 0), u64::MAX);
    // 16-bit: mul.wide.u16 and logic on b16.
    assert_eq!(
        run(
            "mul.wide.u16 $d, $0, $1",
            &[("u16", 0xFFFF), ("u16", 0xFFFF)],
            "u32"
        ),
        0xFFFF * 0xFFFF
    );
    assert_eq!(
        run(
            "mul.wide.s16 $d, $0, $1",
            &[("s16", 0xFFFF), ("s16", 3)],
            "s32"
        ),
        m32(-3)
    );
    assert_eq!(bin("and.b16", "b16", 0xF0F0, 0xFF00), 0xF000);
    assert_eq!(bin("or.b16", "b16", 0xF0F0, 0x0F00), 0xFFF0);
    assert_eq!(bin("xor.b16", "b16", 0xFFFF, 0x00FF), 0xFF00);
    assert_eq!(bin("add.s16", "s16", 0x7FFF, 1), 0x8000);
    assert_eq!(bin("and.b64", "b64", u64::MAX, 0x1234), 0x1234);
    assert_eq!(bin("xor.b32", "b32", 0xFFFF_0000, 0xFF00_FF00), 0x00FF_FF00);
}

#[test]
fn shift_amounts_clamp() {
    for &s in &[0u64, 1, 15, 31, 32, 33, 63, 64, 100, 0xFFFF_FFFF] {
        let sh = s as u32;
        let v: u32 = 0x8765_4321;
        assert_eq!(
            run(
                "shl.b32 $d, $0, $1",
                &[("b32", v as u64), ("u32", s)],
                "b32"
            ),
            if sh >= 32 { 0 } else { (v << sh) as u64 }
        );
        assert_eq!(
            run(
                "shr.u32 $d, $0, $1",
                &[("u32", v as u64), ("u32", s)],
                "u32"
            ),
            if sh >= 32 { 0 } else { (v >> sh) as u64 }
        );
        assert_eq!(
            run(
                "shr.s32 $d, $0, $1",
                &[("s32", v as u64), ("u32", s)],
                "s32"
            ),
            m32((v as i32) >> sh.min(31))
        );
        let w: u64 = 0x8765_4321_0FED_CBA9;
        assert_eq!(
            run("shl.b64 $d, $0, $1", &[("b64", w), ("u32", s)], "b64"),
            if sh >= 64 { 0 } else { w << sh }
        );
        assert_eq!(
            run("shr.u64 $d, $0, $1", &[("u64", w), ("u32", s)], "u64"),
            if sh >= 64 { 0 } else { w >> sh }
        );
        assert_eq!(
            run("shr.s64 $d, $0, $1", &[("s64", w), ("u32", s)], "s64"),
            ((w as i64) >> sh.min(63)) as u64
        );
    }
    // An immediate amount.
    assert_eq!(run("shl.b64 $d, $0, 3", &[("b64", 5)], "b64"), 40);
}

#[test]
fn integer_conversions_truncate_and_extend() {
    let v: u64 = 0xFFFF_FFFF_8000_80FF;
    assert_eq!(run("cvt.u64.u32 $d, $0", &[("u32", v)], "u64"), 0x8000_80FF);
    assert_eq!(
        run("cvt.s64.s32 $d, $0", &[("s32", v)], "s64"),
        0xFFFF_FFFF_8000_80FF
    );
    assert_eq!(
        run("cvt.s64.s32 $d, $0", &[("s32", 0x7FFF_FFFF)], "s64"),
        0x7FFF_FFFF
    );
    assert_eq!(
        run("cvt.u32.u64 $d, $0", &[("u64", 0x1_2345_6789)], "u32"),
        0x2345_6789
    );
    assert_eq!(run("cvt.u32.u16 $d, $0", &[("u16", 0x80FF)], "u32"), 0x80FF);
    assert_eq!(
        run("cvt.s32.s16 $d, $0", &[("s16", 0x80FF)], "s32"),
        0xFFFF_80FF
    );
    assert_eq!(
        run("cvt.u16.u32 $d, $0", &[("u32", 0x1_2345)], "u16"),
        0x2345
    );
    assert_eq!(
        run("cvt.u64.s32 $d, $0", &[("s32", m32(-2))], "u64"),
        (-2i64) as u64
    );
}

fn f(x: f32) -> u64 {
    x.to_bits() as u64
}
fn d(x: f64) -> u64 {
    x.to_bits()
}

#[test]
fn float_int_conversions_round_and_saturate() {
    // int -> float, round to nearest even.
    assert_eq!(
        run("cvt.rn.f32.s32 $d, $0", &[("s32", 16_777_217)], "f32"),
        f(16_777_216.0)
    );
    assert_eq!(
        run("cvt.rn.f32.s32 $d, $0", &[("s32", 16_777_219)], "f32"),
        f(16_777_220.0)
    );
    assert_eq!(
        run("cvt.rn.f32.s32 $d, $0", &[("s32", m32(-5))], "f32"),
        f(-5.0)
    );
    assert_eq!(
        run("cvt.rn.f32.u32 $d, $0", &[("u32", 0xFFFF_FFFF)], "f32"),
        f(4_294_967_296.0)
    );
    assert_eq!(
        run("cvt.rn.f32.s64 $d, $0", &[("s64", i64::MIN as u64)], "f32"),
        f(-9.223_372e18)
    );
    assert_eq!(
        run("cvt.rn.f64.s64 $d, $0", &[("s64", (1u64 << 53) + 1)], "f64"),
        d(9_007_199_254_740_992.0)
    );
    assert_eq!(
        run("cvt.rn.f64.s32 $d, $0", &[("s32", m32(i32::MIN))], "f64"),
        d(-2_147_483_648.0)
    );
    assert_eq!(
        run("cvt.rn.f64.u64 $d, $0", &[("u64", u64::MAX)], "f64"),
        d(18_446_744_073_709_551_616.0)
    );
    // float -> int: the rounding mode, then saturation, NaN -> 0.
    let fi = |op: &str, ty: &str, x: f32| run(&format!("{op} $d, $0"), &[("f32", f(x))], ty);
    assert_eq!(fi("cvt.rzi.s32.f32", "s32", -1.5), m32(-1));
    assert_eq!(fi("cvt.rni.s32.f32", "s32", 2.5), 2);
    assert_eq!(fi("cvt.rni.s32.f32", "s32", 3.5), 4);
    assert_eq!(fi("cvt.rmi.s32.f32", "s32", -1.5), m32(-2));
    assert_eq!(fi("cvt.rpi.s32.f32", "s32", 1.25), 2);
    assert_eq!(fi("cvt.rzi.s32.f32", "s32", 3e9), m32(i32::MAX));
    assert_eq!(fi("cvt.rzi.s32.f32", "s32", -3e9), m32(i32::MIN));
    assert_eq!(fi("cvt.rzi.s32.f32", "s32", f32::NAN), 0);
    assert_eq!(fi("cvt.rzi.u32.f32", "u32", -1.0), 0);
    assert_eq!(fi("cvt.rzi.u32.f32", "u32", f32::INFINITY), 0xFFFF_FFFF);
    assert_eq!(fi("cvt.rzi.s64.f32", "s64", -1e30), i64::MIN as u64);
    assert_eq!(fi("cvt.rzi.u16.f32", "u16", 70000.0), 0xFFFF);
    // float -> float.
    let one_plus = |e: i32| 1.0 + 2f64.powi(e);
    assert_eq!(
        run("cvt.rn.f32.f64 $d, $0", &[("f64", d(one_plus(-24)))], "f32"),
        f(1.0),
        "a tie goes to even"
    );
    assert_eq!(
        run(
            "cvt.rn.f32.f64 $d, $0",
            &[("f64", d(one_plus(-24) + 2f64.powi(-50)))],
            "f32"
        ),
        f(1.0 + 2f32.powi(-23))
    );
    assert_eq!(
        run("cvt.rn.f32.f64 $d, $0", &[("f64", d(1e300))], "f32"),
        f(f32::INFINITY)
    );
    assert_eq!(
        run("cvt.rn.f32.f64 $d, $0", &[("f64", d(1e-300))], "f32"),
        f(0.0)
    );
    assert_eq!(
        run("cvt.f64.f32 $d, $0", &[("f32", f(0.1))], "f64"),
        d(0.1f32 as f64)
    );
    assert_eq!(
        run("cvt.rni.f32.f32 $d, $0", &[("f32", f(2.5))], "f32"),
        f(2.0)
    );
    assert_eq!(
        run("cvt.rzi.f64.f64 $d, $0", &[("f64", d(-2.7))], "f64"),
        d(-2.0)
    );
}

#[test]
fn f16_conversions_round_to_nearest_even() {
    let to16 = |x: f32| run("cvt.rn.f16.f32 $d, $0", &[("f32", f(x))], "f16");
    let from16 = |h: u16| run("cvt.f32.f16 $d, $0", &[("f16", h as u64)], "f32") as u32;
    let cases: [(f32, u16); 14] = [
        (0.0, 0x0000),
        (-0.0, 0x8000),
        (1.0, 0x3C00),
        (-2.0, 0xC000),
        (65504.0, 0x7BFF),
        (65519.0, 0x7BFF),
        (65520.0, 0x7C00), // overflow to inf
        (1e10, 0x7C00),
        (f32::NEG_INFINITY, 0xFC00),
        (2f32.powi(-24), 0x0001),       // smallest subnormal
        (2f32.powi(-25), 0x0000),       // a tie, to even (0)
        (3.0 * 2f32.powi(-25), 0x0002), // 1.5 ulp: a tie, to even (2)
        (2f32.powi(-14), 0x0400),       // smallest normal
        (1.0 + 2f32.powi(-11), 0x3C00), // a tie, to even
    ];
    for (x, h) in cases {
        assert_eq!(to16(x), h as u64, "f16 of {x:e}");
        if x.is_finite() && x.abs() <= 65504.0 && x == half::f16::from_bits(h).to_f32() {
            assert_eq!(from16(h), x.to_bits(), "back from {h:#x}");
        }
    }
    assert_eq!(
        to16(1.0 + 3.0 * 2f32.powi(-11)),
        0x3C02,
        "a tie, to even (up)"
    );
    assert!(half::f16::from_bits(to16(f32::NAN) as u16).is_nan());
    // Every f16 widens exactly and narrows back to itself.
    for h in (0..=u16::MAX)
        .step_by(97)
        .chain([0x0001, 0x03FF, 0x8001, 0x7BFF, 0x7C00, 0xFC00])
    {
        let w = from16(h);
        let want = half::f16::from_bits(h).to_f32();
        if want.is_nan() {
            assert!(f32::from_bits(w).is_nan());
            continue;
        }
        assert_eq!(w, want.to_bits(), "{h:#x}");
        assert_eq!(to16(f32::from_bits(w)), h as u64, "round trip of {h:#x}");
    }
    assert_eq!(
        run(
            "cvt.rn.f16.f64 $d, $0",
            &[("f64", d(1.0 + 2f64.powi(-11) + 2f64.powi(-40)))],
            "f16"
        ),
        0x3C01
    );
    assert_eq!(
        run("cvt.f64.f16 $d, $0", &[("f16", 0x0001)], "f64"),
        d(2f64.powi(-24))
    );
}

#[test]
fn float_arithmetic_is_ieee_round_to_nearest() {
    let xs = [
        0.0f32,
        -0.0,
        1.0,
        -3.5,
        0.1,
        1e30,
        -1e-30,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::INFINITY,
        f32::NAN,
    ];
    let canon = |x: f32| if x.is_nan() { 0x7FFF_FFFF } else { f(x) };
    for &a in &xs {
        for &b in &xs {
            assert_eq!(
                bin("add.rn.f32", "f32", f(a), f(b)),
                canon(a + b),
                "{a} + {b}"
            );
            assert_eq!(bin("sub.rn.f32", "f32", f(a), f(b)), canon(a - b));
            assert_eq!(bin("mul.rn.f32", "f32", f(a), f(b)), canon(a * b));
            assert_eq!(bin("div.rn.f32", "f32", f(a), f(b)), canon(a / b));
            let (x, y) = (a as f64 * 1.1, b as f64 - 0.3);
            let r = bin("add.rn.f64", "f64", d(x), d(y));
            assert!(r == d(x + y) || (x + y).is_nan() && f64::from_bits(r).is_nan());
            let r = bin("div.rn.f64", "f64", d(x), d(y));
            assert!(r == d(x / y) || (x / y).is_nan() && f64::from_bits(r).is_nan());
        }
        assert_eq!(
            run("sqrt.rn.f32 $d, $0", &[("f32", f(a))], "f32"),
            canon(a.sqrt())
        );
        assert_eq!(
            run("rcp.rn.f32 $d, $0", &[("f32", f(a))], "f32"),
            canon(1.0 / a)
        );
        assert_eq!(
            run("abs.f32 $d, $0", &[("f32", f(a))], "f32"),
            f(a) & 0x7FFF_FFFF
        );
        assert_eq!(
            run("neg.f32 $d, $0", &[("f32", f(a))], "f32"),
            f(a) ^ 0x8000_0000
        );
        assert_eq!(
            run("neg.f64 $d, $0", &[("f64", d(a as f64))], "f64"),
            d(-(a as f64))
        );
        assert_eq!(
            run("abs.f64 $d, $0", &[("f64", d(-(a as f64)))], "f64"),
            d((a as f64).abs())
        );
    }
    // fma rounds once: (1 + e)(1 - e) - 1 = -e^2 exactly, where mul then add gives 0.
    let e = 2f32.powi(-23);
    let ins = [("f32", f(1.0 + e)), ("f32", f(1.0 - e)), ("f32", f(-1.0))];
    assert_eq!(run("fma.rn.f32 $d, $0, $1, $2", &ins, "f32"), f(-e * e));
    assert_eq!(
        run(
            "mul.rn.f32 %f7, $0, $1;\n\tadd.rn.f32 $d, %f7, $2",
            &ins,
            "f32"
        ),
        f(0.0)
    );
    let e = 2f64.powi(-52);
    let ins = [("f64", d(1.0 + e)), ("f64", d(1.0 - e)), ("f64", d(-1.0))];
    assert_eq!(run("fma.rn.f64 $d, $0, $1, $2", &ins, "f64"), d(-e * e));
    assert_eq!(
        run("sqrt.rn.f64 $d, $0", &[("f64", d(2.0))], "f64"),
        d(2f64.sqrt())
    );
    // rcp.approx.ftz.f64: exact here, subnormals flushed.
    assert_eq!(
        run("rcp.approx.ftz.f64 $d, $0", &[("f64", d(4.0))], "f64"),
        d(0.25)
    );
    assert_eq!(
        run(
            "rcp.approx.ftz.f64 $d, $0",
            &[("f64", d(-f64::from_bits(5)))],
            "f64"
        ),
        d(f64::NEG_INFINITY)
    );
    assert_eq!(
        run("rcp.approx.ftz.f64 $d, $0", &[("f64", d(1e308))], "f64"),
        d(0.0)
    );
    // Immediates: f32 bits, f64 bits, and an f32 immediate of an f64 op.
    assert_eq!(
        run("add.rn.f32 $d, $0, 0f3F800000", &[("f32", f(2.0))], "f32"),
        f(3.0)
    );
    assert_eq!(
        run(
            "mul.rn.f64 $d, $0, 0dC000000000000000",
            &[("f64", d(1.5))],
            "f64"
        ),
        d(-3.0)
    );
}

#[test]
fn min_max_prefer_numbers_and_order_zeros() {
    let nan = f32::NAN;
    let cases: [(f32, f32, f32, f32); 6] = [
        (1.0, 2.0, 1.0, 2.0),
        (nan, 2.0, 2.0, 2.0),
        (-3.0, nan, -3.0, -3.0),
        (-0.0, 0.0, -0.0, 0.0),
        (0.0, -0.0, -0.0, 0.0),
        (
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::INFINITY,
        ),
    ];
    for (a, b, lo, hi) in cases {
        assert_eq!(bin("min.f32", "f32", f(a), f(b)), f(lo), "min({a}, {b})");
        assert_eq!(bin("max.f32", "f32", f(a), f(b)), f(hi), "max({a}, {b})");
        assert_eq!(
            bin("min.f64", "f64", d(a as f64), d(b as f64)),
            d(lo as f64)
        );
        assert_eq!(
            bin("max.f64", "f64", d(a as f64), d(b as f64)),
            d(hi as f64)
        );
    }
    assert_eq!(bin("min.f32", "f32", f(nan), f(nan)), 0x7FFF_FFFF);
    assert!(f64::from_bits(bin("max.f64", "f64", d(f64::NAN), d(f64::NAN))).is_nan());
}

#[test]
fn comparisons_ordered_unordered_signed_unsigned() {
    let xs = [1.0f32, 2.0, -0.0, 0.0, f32::NAN, f32::INFINITY];
    for &a in &xs {
        for &b in &xs {
            let nan = a.is_nan() || b.is_nan();
            let want = [
                ("eq", a == b),
                ("ne", !nan && a != b),
                ("lt", a < b),
                ("le", a <= b),
                ("gt", a > b),
                ("ge", a >= b),
                ("equ", nan || a == b),
                ("neu", nan || a != b),
                ("ltu", nan || a < b),
                ("leu", nan || a <= b),
                ("gtu", nan || a > b),
                ("geu", nan || a >= b),
                ("num", !nan),
                ("nan", nan),
            ];
            for (c, w) in want {
                assert_eq!(
                    run(
                        &format!("setp.{c}.f32 $d, $0, $1"),
                        &[("f32", f(a)), ("f32", f(b))],
                        "pred"
                    ),
                    w as u64,
                    "{a} {c} {b}"
                );
                assert_eq!(
                    run(
                        &format!("setp.{c}.f64 $d, $0, $1"),
                        &[("f64", d(a as f64)), ("f64", d(b as f64))],
                        "pred"
                    ),
                    w as u64
                );
            }
        }
    }
    let setp = |op: &str, ty: &str, a: u64, b: u64| {
        run(
            &format!("setp.{op} $d, $0, $1"),
            &[(ty, a), (ty, b)],
            "pred",
        )
    };
    assert_eq!(setp("lt.s32", "s32", m32(-1), 1), 1);
    assert_eq!(setp("lt.u32", "u32", m32(-1), 1), 0);
    assert_eq!(setp("lo.u32", "u32", 1, m32(-1)), 1);
    assert_eq!(setp("hs.u64", "u64", u64::MAX, 0), 1);
    assert_eq!(setp("ge.s64", "s64", i64::MIN as u64, 0), 0);
    assert_eq!(setp("gt.u64", "u64", i64::MIN as u64, 0), 1);
    assert_eq!(setp("eq.b16", "b16", 0xFFFF, 0xFFFF), 1);
    assert_eq!(setp("ne.b32", "b32", 1, 2), 1);
    assert_eq!(setp("le.s16", "s16", 0x8000, 0x7FFF), 1);
}

#[test]
fn selp_and_predicate_logic() {
    for (p, q) in [(0u64, 0u64), (0, 1), (1, 0), (1, 1)] {
        let ins = [("pred", p), ("pred", q)];
        assert_eq!(run("and.pred $d, $0, $1", &ins, "pred"), p & q);
        assert_eq!(run("or.pred $d, $0, $1", &ins, "pred"), p | q);
        assert_eq!(run("xor.pred $d, $0, $1", &ins, "pred"), p ^ q);
        assert_eq!(run("not.pred $d, $0", &ins, "pred"), 1 - p);
        assert_eq!(run("mov.pred $d, $0", &ins, "pred"), p);
        let ins = [("f32", f(1.5)), ("f32", f(-2.0)), ("pred", p)];
        assert_eq!(
            run("selp.f32 $d, $0, $1, $2", &ins, "f32"),
            if p == 1 { f(1.5) } else { f(-2.0) }
        );
        let ins = [("pred", p)];
        assert_eq!(run("selp.u16 $d, 1, 0, $0", &ins, "u16"), p);
        assert_eq!(
            run("selp.b32 $d, -1, 7, $0", &ins, "b32"),
            if p == 1 { 0xFFFF_FFFF } else { 7 }
        );
        assert_eq!(
            run(
                "selp.f64 $d, 0d3FF0000000000000, 0d0000000000000000, $0",
                &ins,
                "f64"
            ),
            if p == 1 { d(1.0) } else { 0 }
        );
        // Guards: @p and @!p.
        let g = run(
            "mov.u32 $d, 5;\n\t@$0 mov.u32 $d, 6;\n\t@!$0 add.s32 $d, $d, 10",
            &ins,
            "u32",
        );
        assert_eq!(g, if p == 1 { 6 } else { 15 });
    }
}

fn prmt_ref(a: u32, b: u32, c: u32) -> u32 {
    let bytes: Vec<u8> = a.to_le_bytes().into_iter().chain(b.to_le_bytes()).collect();
    let mut out = [0u8; 4];
    for (i, o) in out.iter_mut().enumerate() {
        let s = (c >> (4 * i)) & 0xF;
        let v = bytes[(s & 7) as usize];
        *o = if s & 8 != 0 {
            ((v as i8) >> 7) as u8
        } else {
            v
        };
    }
    u32::from_le_bytes(out)
}

#[test]
fn prmt_moves_bytes() {
    let (a, b) = (0x8877_6655u32, 0x44F3_2211u32);
    for c in [4180u32, 0x3210, 0x7654, 0x0123, 0x89AB, 0xCDEF, 0x5140] {
        let got = run(
            "prmt.b32 $d, $0, $1, $2",
            &[("b32", a as u64), ("b32", b as u64), ("b32", c as u64)],
            "b32",
        );
        assert_eq!(got, prmt_ref(a, b, c) as u64, "selector {c:#x}");
    }
    // NVRTC's 4180 (0x1054): the low halves of b then a.
    assert_eq!(
        run(
            "prmt.b32 $d, $0, $1, 4180",
            &[("b32", a as u64), ("b32", b as u64)],
            "b32"
        ),
        0x6655_2211
    );
}

#[test]
fn vector_mov_packs_and_unpacks() {
    let ins = [("b32", 0x1111_2222), ("b32", 0x3333_4444)];
    assert_eq!(
        run("mov.b64 $d, {$0, $1}", &ins, "b64"),
        0x3333_4444_1111_2222
    );
    let v = [("f64", 0xAAAA_BBBB_CCCC_DDDD)];
    assert_eq!(
        run(
            "{\n\t.reg .b32 %temp;\n\tmov.b64 {$d, %temp}, $0;\n\t}",
            &v,
            "b32"
        ),
        0xCCCC_DDDD
    );
    assert_eq!(
        run(
            "{\n\t.reg .b32 %temp;\n\tmov.b64 {%temp, $d}, $0;\n\t}",
            &v,
            "b32"
        ),
        0xAAAA_BBBB
    );
    let h = [("b16", 0xBEEF), ("b16", 0xDEAD)];
    assert_eq!(run("mov.b32 $d, {$0, $1}", &h, "b32"), 0xDEAD_BEEF);
    assert_eq!(
        run("mov.b32 {%rs7, $d}, $0", &[("b32", 0x1234_5678)], "b16"),
        0x1234
    );
    // Immediates: decimal, negative, hex; mov of a special register.
    assert_eq!(run("mov.u64 $d, -8193", &[], "u64"), (-8193i64) as u64);
    assert_eq!(run("mov.u32 $d, 0xDEADBEEF", &[], "u32"), 0xDEAD_BEEF);
    assert_eq!(
        run("mov.f32 $d, 0f40490FDB", &[], "f32"),
        f(std::f32::consts::PI)
    );
    assert_eq!(run("mov.u32 $d, %ntid.x", &[], "u32"), 1);
}

#[test]
fn loads_and_stores_of_every_width() {
    // st.global.u8 / u16 keep the low bytes; ld.global.s8/s16 sign-extend.
    assert_eq!(
        run(
            "st.global.u8 [%ptr1], $0;\n\tld.global.s8 $d, [%ptr1]",
            &[("u32", 0x1FF)],
            "s32"
        ),
        0xFFFF_FFFF
    );
    assert_eq!(
        run(
            "st.global.u16 [%ptr1+2], $0;\n\tld.global.u16 $d, [%ptr1+2]",
            &[("u32", 0x1_8001)],
            "u32"
        ),
        0x8001
    );
    assert_eq!(
        run(
            "st.global.u16 [%ptr1], $0;\n\tld.global.s16 $d, [%ptr1]",
            &[("u32", 0x8001)],
            "s64"
        ),
        0xFFFF_FFFF_FFFF_8001
    );
    assert_eq!(
        run(
            "st.global.f64 [%ptr1+8], $0;\n\tld.global.f64 $d, [%ptr1+8]",
            &[("f64", d(2.5)), ("f64", 0)],
            "f64"
        ),
        d(2.5)
    );
    assert_eq!(
        run(
            "st.global.u64 [%ptr1], $0;\n\tld.global.u64 $d, [%ptr1]",
            &[("u64", u64::MAX - 1)],
            "u64"
        ),
        u64::MAX - 1
    );
    assert_eq!(
        run("ld.global.u8 $d, [%ptr1+3]", &[("u32", 0xAB00_0000)], "u16"),
        0xAB
    );
}

/// `bfi` by masks (the interpreter walks bits): the field [pos, pos + len)
/// clipped to the width.
fn bfi_ref(a: u64, b: u64, pos: u32, len: u32, w: u32) -> u64 {
    let full = if w == 64 { u64::MAX } else { (1u64 << w) - 1 };
    let (pos, len) = (pos & 0xFF, len & 0xFF);
    if pos >= w || len == 0 {
        return b & full;
    }
    let n = len.min(w - pos);
    let mask = (if n == 64 { u64::MAX } else { (1u64 << n) - 1 }) << pos;
    ((b & !mask) | ((a << pos) & mask)) & full
}

/// `bfe` by shifts and sign extension of the clipped field.
fn bfe_ref(a: u64, pos: u32, len: u32, w: u32, signed: bool) -> u64 {
    let full = if w == 64 { u64::MAX } else { (1u64 << w) - 1 };
    let (pos, len) = (pos & 0xFF, len & 0xFF);
    let a = a & full;
    if len == 0 {
        return 0;
    }
    if pos >= w {
        return if signed && (a >> (w - 1)) & 1 == 1 {
            full
        } else {
            0
        };
    }
    let n = len.min(w - pos);
    let v = (a >> pos) & (if n == 64 { u64::MAX } else { (1u64 << n) - 1 });
    if signed && n < 64 && (v >> (n - 1)) & 1 == 1 {
        (v | !((1u64 << n) - 1)) & full
    } else {
        v
    }
}

#[test]
fn bit_field_insert_and_extract() {
    let (a, b) = (0xDEAD_BEEF_1234_5678u64, 0x0F0F_F0F0_A5A5_5A5Au64);
    for w in [32u32, 64] {
        let ty = format!("b{w}");
        let full = if w == 64 { u64::MAX } else { (1u64 << w) - 1 };
        for (pos, len) in [
            (0, 1),
            (1, 1),
            (3, 5),
            (8, 8),
            (28, 8),
            (31, 1),
            (0, 32),
            (40, 30),
            (63, 2),
            (70, 3),
            (5, 0),
            (0x105, 4),
        ] {
            let ins = [
                (ty.as_str(), a & full),
                (ty.as_str(), b & full),
                ("u32", pos as u64),
                ("u32", len as u64),
            ];
            let got = run(&format!("bfi.b{w} $d, $0, $1, $2, $3"), &ins, &ty);
            assert_eq!(
                got,
                bfi_ref(a, b, pos, len, w),
                "bfi.b{w} pos {pos} len {len}"
            );
            for signed in [false, true] {
                let t = format!("{}{w}", if signed { "s" } else { "u" });
                let ins = [
                    (t.as_str(), a & full),
                    ("u32", pos as u64),
                    ("u32", len as u64),
                ];
                let got = run(&format!("bfe.{t} $d, $0, $1, $2"), &ins, &t) & full;
                assert_eq!(
                    got,
                    bfe_ref(a, pos, len, w, signed),
                    "bfe.{t} pos {pos} len {len}"
                );
            }
        }
    }
    // NVRTC's form (from relu.cu's mask loop): immediate position and length.
    assert_eq!(
        run(
            "bfi.b32 $d, $0, $1, 1, 1",
            &[("b32", 1), ("b32", 0x10)],
            "b32"
        ),
        0x12
    );
}
