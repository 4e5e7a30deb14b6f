//! Running a decoded kernel over a grid.

use std::fmt;

use crate::parse::{Cmp, Cvt, Fw, Inst, Kernel, Op, Rnd, SPECIALS, Space};

/// Global (device) memory as the fake driver holds it: addresses are opaque
/// handles, not host pointers.
pub trait Memory {
    /// Reads `out.len()` bytes at `addr`. `Err` says why not (e.g. "outside
    /// every allocation").
    fn load(&mut self, addr: u64, out: &mut [u8]) -> Result<(), String>;
    /// Writes `data` at `addr`.
    fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), String>;
}

/// What one launch did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchStats {
    /// Instructions executed (a guarded-off instruction counts too).
    pub instructions: u64,
    /// Threads run (grid size times block size).
    pub threads: u64,
}

/// Knobs of [`launch_with`].
#[derive(Clone, Copy, Debug)]
pub struct LaunchOptions {
    /// Instructions one launch may execute before it is a runaway-loop
    /// [`Fault`]. Default 2^36.
    pub instruction_budget: u64,
    /// Track shared-memory races (default on).
    pub race_check: bool,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        LaunchOptions {
            instruction_budget: 1 << 36,
            race_check: true,
        }
    }
}

/// A launch that went wrong: where and why. `line` is 0 (and `instruction`
/// empty) for faults of the launch itself (parameters, block shape).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    pub kernel: String,
    pub block: [u32; 3],
    pub thread: [u32; 3],
    pub line: usize,
    pub instruction: String,
    pub what: String,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            return write!(f, "kernel {}: {}", self.kernel, self.what);
        }
        let [bx, by, bz] = self.block;
        let [tx, ty, tz] = self.thread;
        write!(
            f,
            "kernel {}, block ({bx},{by},{bz}), thread ({tx},{ty},{tz}), line {} `{}`: {}",
            self.kernel, self.line, self.instruction, self.what
        )
    }
}

impl std::error::Error for Fault {}

/// Runs the grid with the default [`LaunchOptions`]: blocks one after
/// another (x fastest); within a block the threads run one at a time, each
/// until it reaches `bar.sync` or exits, then the next; a barrier releases
/// when every live thread of the block has arrived (exited threads count as
/// arrived). `params` holds each parameter's bytes, as [`Kernel::params`]
/// sizes them.
pub fn launch(
    kernel: &Kernel,
    grid: [u32; 3],
    block: [u32; 3],
    dynamic_shared_bytes: u32,
    params: &[Vec<u8>],
    mem: &mut dyn Memory,
) -> Result<LaunchStats, Fault> {
    launch_with(
        kernel,
        grid,
        block,
        dynamic_shared_bytes,
        params,
        mem,
        &LaunchOptions::default(),
    )
}

/// Shared bytes beyond this (the largest opt-in of current GPUs) are refused.
const MAX_SHARED: usize = 227 * 1024;
const MANY: u32 = u32::MAX;

/// Who last wrote and read one shared byte, and in which barrier epoch.
#[derive(Clone, Copy, Default)]
struct Shadow {
    w_epoch: u32,
    w_tid: u32,
    w_pc: u32,
    r_epoch: u32,
    r_tid: u32,
}

struct Cx<'a> {
    mem: &'a mut dyn Memory,
    params: &'a [u8],
    shared: Vec<u8>,
    shadow: Vec<Shadow>,
    race: bool,
    epoch: u32,
    tid: u32,
    block: [u32; 3],
    executed: u64,
    budget: u64,
    static_shared: usize,
}

enum Stop {
    /// Waiting at the barrier at this instruction.
    Bar(usize),
    Exit,
}

fn coords(t: u32, block: [u32; 3]) -> [u32; 3] {
    [
        t % block[0],
        (t / block[0]) % block[1],
        t / (block[0] * block[1]),
    ]
}

fn fmt3(c: [u32; 3]) -> String {
    format!("({},{},{})", c[0], c[1], c[2])
}

/// [`launch`] with options.
pub fn launch_with(
    kernel: &Kernel,
    grid: [u32; 3],
    block: [u32; 3],
    dynamic_shared_bytes: u32,
    params: &[Vec<u8>],
    mem: &mut dyn Memory,
    opts: &LaunchOptions,
) -> Result<LaunchStats, Fault> {
    let launch_fault = |what: String| Fault {
        kernel: kernel.name.clone(),
        block: [0; 3],
        thread: [0; 3],
        line: 0,
        instruction: String::new(),
        what,
    };
    // The parameter block.
    if params.len() != kernel.params.len() {
        return Err(launch_fault(format!(
            "{} parameters given, the kernel takes {}",
            params.len(),
            kernel.params.len()
        )));
    }
    let mut pblock = vec![0u8; kernel.param_block];
    for (i, ((p, given), off)) in kernel
        .params
        .iter()
        .zip(params)
        .zip(&kernel.param_offsets)
        .enumerate()
    {
        if given.len() != p.bytes {
            return Err(launch_fault(format!(
                "parameter {i} (`{}`) is {} bytes, the kernel takes {}",
                p.name,
                given.len(),
                p.bytes
            )));
        }
        pblock[*off..*off + p.bytes].copy_from_slice(given);
    }
    // The launch shape.
    if grid.contains(&0) || block.contains(&0) {
        return Err(launch_fault(format!(
            "empty grid {grid:?} or block {block:?}"
        )));
    }
    if grid[0] > i32::MAX as u32 || grid[1] > 65535 || grid[2] > 65535 {
        return Err(launch_fault(format!("grid {grid:?} too large")));
    }
    let nthreads = block[0] as u64 * block[1] as u64 * block[2] as u64;
    if nthreads > 1024 || block[0] > 1024 || block[1] > 1024 || block[2] > 64 {
        return Err(launch_fault(format!(
            "block {block:?} ({nthreads} threads) exceeds 1024 threads or (1024, 1024, 64)"
        )));
    }
    if let Some(m) = kernel.max_threads
        && nthreads > m as u64
    {
        return Err(launch_fault(format!(
            "block of {nthreads} threads exceeds the kernel's .maxntid ({m})"
        )));
    }
    if let Some(r) = kernel.req_threads
        && r != block
    {
        return Err(launch_fault(format!(
            "block {block:?} is not the kernel's .reqntid {r:?}"
        )));
    }
    let shared_len = if dynamic_shared_bytes > 0 {
        kernel.dynamic_offset + dynamic_shared_bytes as usize
    } else {
        kernel.static_shared
    };
    if shared_len > MAX_SHARED {
        return Err(launch_fault(format!(
            "{} bytes of shared memory (static {} + dynamic {dynamic_shared_bytes}) exceed {MAX_SHARED}",
            shared_len, kernel.static_shared
        )));
    }

    let n = nthreads as usize;
    let stride = kernel.register_file_len();
    let nregs = kernel.nregs as usize;
    let nconsts = kernel.consts.len();
    let sp = nregs + nconsts;
    let mut regs = vec![0u64; n * stride];
    for t in 0..n {
        let f = &mut regs[t * stride..(t + 1) * stride];
        f[nregs..sp].copy_from_slice(&kernel.consts);
        let c = coords(t as u32, block);
        for k in 0..3 {
            f[sp + k] = c[k] as u64;
            f[sp + 3 + k] = block[k] as u64;
            f[sp + 9 + k] = grid[k] as u64;
        }
    }
    debug_assert_eq!(stride, sp + SPECIALS as usize);
    let mut cx = Cx {
        mem,
        params: &pblock,
        shared: vec![0xFF; shared_len],
        shadow: if opts.race_check {
            vec![Shadow::default(); shared_len]
        } else {
            Vec::new()
        },
        race: opts.race_check && shared_len > 0,
        epoch: 0,
        tid: 0,
        block,
        executed: 0,
        budget: opts.instruction_budget,
        static_shared: kernel.static_shared,
    };
    #[derive(Clone, Copy, PartialEq)]
    enum St {
        Ready,
        Waiting,
        Exited,
    }
    let mut pcs = vec![0usize; n];
    let mut state = vec![St::Ready; n];
    for bz in 0..grid[2] {
        for by in 0..grid[1] {
            for bx in 0..grid[0] {
                let b = [bx, by, bz];
                for t in 0..n {
                    let f = &mut regs[t * stride..(t + 1) * stride];
                    f[sp + 6] = bx as u64;
                    f[sp + 7] = by as u64;
                    f[sp + 8] = bz as u64;
                }
                cx.shared.fill(0xFF);
                pcs.fill(0);
                state.fill(St::Ready);
                cx.epoch += 1;
                let fault = |t: usize, pc: usize, what: String| Fault {
                    kernel: kernel.name.clone(),
                    block: b,
                    thread: coords(t as u32, block),
                    line: kernel.src[pc].0,
                    instruction: kernel.src[pc].1.clone(),
                    what,
                };
                loop {
                    let mut first_wait: Option<(usize, usize)> = None;
                    for t in 0..n {
                        if state[t] != St::Ready {
                            continue;
                        }
                        cx.tid = t as u32;
                        let f = &mut regs[t * stride..(t + 1) * stride];
                        match run(kernel, f, &mut pcs[t], &mut cx) {
                            Ok(Stop::Exit) => state[t] = St::Exited,
                            Ok(Stop::Bar(at)) => {
                                state[t] = St::Waiting;
                                match first_wait {
                                    None => first_wait = Some((t, at)),
                                    Some((t0, at0)) if at0 != at => {
                                        return Err(fault(
                                            t,
                                            at,
                                            format!(
                                                "divergent barrier: thread {} waits at line {} `{}` while this one waits here",
                                                fmt3(coords(t0 as u32, block)),
                                                kernel.src[at0].0,
                                                kernel.src[at0].1
                                            ),
                                        ));
                                    }
                                    _ => {}
                                }
                            }
                            Err(what) => return Err(fault(t, pcs[t], what)),
                        }
                    }
                    if first_wait.is_none() {
                        break;
                    }
                    cx.epoch += 1;
                    for s in state.iter_mut() {
                        if *s == St::Waiting {
                            *s = St::Ready;
                        }
                    }
                }
            }
        }
    }
    Ok(LaunchStats {
        instructions: cx.executed,
        threads: nthreads * grid[0] as u64 * grid[1] as u64 * grid[2] as u64,
    })
}

#[inline(always)]
fn zext(v: u64, w: u8) -> u64 {
    if w >= 64 { v } else { v & ((1u64 << w) - 1) }
}

#[inline(always)]
fn sext(v: u64, w: u8) -> i64 {
    let s = 64 - w as u32;
    ((v << s) as i64) >> s
}

#[inline(always)]
fn f32_of(v: u64) -> f32 {
    f32::from_bits(v as u32)
}

#[inline(always)]
fn f64_of(v: u64) -> f64 {
    f64::from_bits(v)
}

/// An f32 result: NaN is the canonical 0x7fffffff, as NVIDIA GPUs produce.
#[inline(always)]
fn c32(x: f32) -> u64 {
    if x.is_nan() {
        0x7FFF_FFFF
    } else {
        x.to_bits() as u64
    }
}

#[inline(always)]
fn c64(x: f64) -> u64 {
    x.to_bits()
}

/// PTX min: the non-NaN operand, NaN when both are, -0 < +0.
#[inline(always)]
fn fmin<T: Copy + PartialOrd>(a: T, b: T, a_nan: bool, b_nan: bool, a_neg: bool) -> Option<T> {
    if a_nan && b_nan {
        None
    } else if a_nan {
        Some(b)
    } else if b_nan || a < b || (a == b && a_neg) {
        Some(a)
    } else {
        Some(b)
    }
}

#[inline(always)]
fn fmax<T: Copy + PartialOrd>(a: T, b: T, a_nan: bool, b_nan: bool, a_neg: bool) -> Option<T> {
    if a_nan && b_nan {
        None
    } else if a_nan {
        Some(b)
    } else if b_nan || a > b || (a == b && !a_neg) {
        Some(a)
    } else {
        Some(b)
    }
}

fn cmp_f(c: Cmp, x: f64, y: f64) -> bool {
    let nan = x.is_nan() || y.is_nan();
    match c {
        Cmp::Eq => x == y,
        Cmp::Ne => !nan && x != y,
        Cmp::Lt => x < y,
        Cmp::Le => x <= y,
        Cmp::Gt => x > y,
        Cmp::Ge => x >= y,
        Cmp::Equ => nan || x == y,
        Cmp::Neu => x != y,
        Cmp::Ltu => nan || x < y,
        Cmp::Leu => nan || x <= y,
        Cmp::Gtu => nan || x > y,
        Cmp::Geu => nan || x >= y,
        Cmp::Num => !nan,
        Cmp::Nan => nan,
    }
}

fn cmp_i<T: Ord>(c: Cmp, x: T, y: T) -> bool {
    match c {
        Cmp::Eq => x == y,
        Cmp::Ne => x != y,
        Cmp::Lt => x < y,
        Cmp::Le => x <= y,
        Cmp::Gt => x > y,
        Cmp::Ge => x >= y,
        _ => false,
    }
}

fn f16_to_f32(h: u64) -> f32 {
    let f = half::f16::from_bits(h as u16);
    if f.is_nan() {
        f32::from_bits(0x7FFF_FFFF)
    } else {
        f.to_f32()
    }
}

fn float_in(v: u64, bits: u8) -> f64 {
    match bits {
        16 => f16_to_f32(v) as f64,
        32 => f32_of(v) as f64,
        _ => f64_of(v),
    }
}

fn round(x: f64, r: Rnd) -> f64 {
    match r {
        Rnd::Rn => x,
        Rnd::Rni => x.round_ties_even(),
        Rnd::Rzi => x.trunc(),
        Rnd::Rmi => x.floor(),
        Rnd::Rpi => x.ceil(),
    }
}

fn cvt(c: Cvt, v: u64) -> u64 {
    match c {
        Cvt::II { from, signed, to } => {
            let x = if signed {
                sext(v, from) as u64
            } else {
                zext(v, from)
            };
            zext(x, to)
        }
        Cvt::IF { from, signed, to } => match (to, signed) {
            (32, true) => (sext(v, from) as f32).to_bits() as u64,
            (32, false) => (zext(v, from) as f32).to_bits() as u64,
            (64, true) => (sext(v, from) as f64).to_bits(),
            (64, false) => (zext(v, from) as f64).to_bits(),
            // Exact in f64 below 2^53; above, f16 overflows anyway.
            (_, true) => f64_to_f16(sext(v, from) as f64) as u64,
            (_, false) => f64_to_f16(zext(v, from) as f64) as u64,
        },
        Cvt::FI {
            from,
            to,
            signed,
            rnd,
        } => {
            let x = round(float_in(v, from), rnd);
            if x.is_nan() {
                return 0;
            }
            if signed {
                let lim = 2f64.powi(to as i32 - 1);
                zext(x.clamp(-lim, lim - 1.0) as i64 as u64, to)
            } else {
                let lim = 2f64.powi(to as i32);
                zext(x.clamp(0.0, lim - 1.0) as u64, to)
            }
        }
        Cvt::FF { from, to, rnd } => match (from, to) {
            (16, 32) => f16_to_f32(v).to_bits() as u64,
            (16, 64) => (f16_to_f32(v) as f64).to_bits(),
            (32, 64) => c64(f32_of(v) as f64),
            (64, 32) => c32(f64_of(v) as f32),
            (32, 16) => {
                let x = f32_of(v);
                if x.is_nan() {
                    0x7FFF
                } else {
                    half::f16::from_f32(x).to_bits() as u64
                }
            }
            (64, 16) => {
                let x = f64_of(v);
                if x.is_nan() {
                    0x7FFF
                } else {
                    f64_to_f16(x) as u64
                }
            }
            (32, 32) => c32(round(f32_of(v) as f64, rnd) as f32),
            (64, 64) => c64(round(f64_of(v), rnd)),
            _ => {
                // f16 to f16 rounding.
                let x = round(f16_to_f32(v) as f64, rnd);
                if x.is_nan() {
                    0x7FFF
                } else {
                    f64_to_f16(x) as u64
                }
            }
        },
    }
}

/// f64 to f16 bits, rounded once to nearest even (the half crate may go
/// through f32 and round twice). Not for NaN.
fn f64_to_f16(x: f64) -> u16 {
    let sign = ((x.to_bits() >> 48) & 0x8000) as u16;
    let a = x.abs();
    if a >= 65520.0 {
        return sign | 0x7C00;
    }
    // The f16 quantum at a: 2^-24 for subnormals, else 2^(exponent - 10).
    let e = ((a.to_bits() >> 52) & 0x7FF) as i32 - 1023;
    let q = 2f64.powi(if e < -14 { -24 } else { e - 10 });
    // Scaling by a power of two is exact; the product is an f16 value.
    let v = (a / q).round_ties_even() * q;
    sign | half::f16::from_f32(v as f32).to_bits()
}

fn prmt(a: u64, b: u64, sel: u64) -> u64 {
    let x = (a as u32 as u64) | ((b as u32 as u64) << 32);
    let mut out = 0u32;
    for i in 0..4 {
        let s = (sel >> (4 * i)) & 0xF;
        let mut byte = (x >> (8 * (s & 7))) as u8;
        if s & 8 != 0 {
            byte = if byte & 0x80 != 0 { 0xFF } else { 0 };
        }
        out |= (byte as u32) << (8 * i);
    }
    out as u64
}

/// `bfi.b{w}` as the PTX ISA defines it: bits [pos, pos + len) of `base`
/// (those below w) replaced by the low bits of `insert`; pos and len are
/// the low bytes of their operands.
fn bfi(insert: u64, base: u64, pos: u64, len: u64, w: u8) -> u64 {
    let (pos, len) = ((pos & 0xFF) as u32, (len & 0xFF) as u32);
    let mut f = zext(base, w);
    for i in 0..len {
        if pos + i >= w as u32 {
            break;
        }
        let bit = (insert >> i) & 1;
        f = (f & !(1 << (pos + i))) | (bit << (pos + i));
    }
    f
}

/// `bfe.{u,s}{w}` as the PTX ISA defines it: the `len` bits of `a` from
/// `pos`, the rest filled with the field's top bit (signed) or zeros; a
/// zero length gives zero.
fn bfe(a: u64, pos: u64, len: u64, w: u8, signed: bool) -> u64 {
    let (pos, len) = ((pos & 0xFF) as u32, (len & 0xFF) as u32);
    let msb = w as u32 - 1;
    if len == 0 {
        return 0;
    }
    let sbit = if signed {
        (a >> (pos + len - 1).min(msb)) & 1
    } else {
        0
    };
    let mut d = 0u64;
    for i in 0..=msb {
        let bit = if i < len && pos + i <= msb {
            (a >> (pos + i)) & 1
        } else {
            sbit
        };
        d |= bit << i;
    }
    d
}

fn flush64(x: f64) -> f64 {
    if x.is_subnormal() {
        0.0f64.copysign(x)
    } else {
        x
    }
}

impl Cx<'_> {
    fn shared_check(
        &mut self,
        addr: u64,
        size: u8,
        store: bool,
        pc: usize,
    ) -> Result<usize, String> {
        let what = if store { "store" } else { "load" };
        let len = self.shared.len();
        if addr.checked_add(size as u64).is_none_or(|e| e > len as u64) {
            return Err(format!(
                "shared {what} of {size} bytes at shared offset 0x{addr:x} outside the block's {len} bytes of shared memory (static {} + dynamic {})",
                self.static_shared,
                len.saturating_sub(self.static_shared)
            ));
        }
        if !addr.is_multiple_of(size as u64) {
            return Err(format!(
                "misaligned shared {what} of {size} bytes at shared offset 0x{addr:x}"
            ));
        }
        let a = addr as usize;
        if self.race {
            let (t, e) = (self.tid, self.epoch);
            for i in a..a + size as usize {
                let s = &mut self.shadow[i];
                if s.w_epoch == e && s.w_tid != t {
                    return Err(format!(
                        "shared-memory race: {what} of shared offset 0x{i:x}, which thread {} wrote at line {} since the last barrier",
                        fmt3(coords(s.w_tid, self.block)),
                        s.w_pc
                    ));
                }
                if store {
                    if s.r_epoch == e && s.r_tid != t {
                        let who = if s.r_tid == MANY {
                            "other threads".to_string()
                        } else {
                            format!("thread {}", fmt3(coords(s.r_tid, self.block)))
                        };
                        return Err(format!(
                            "shared-memory race: store to shared offset 0x{i:x}, which {who} read since the last barrier"
                        ));
                    }
                    s.w_epoch = e;
                    s.w_tid = t;
                    s.w_pc = pc as u32;
                } else if s.r_epoch != e {
                    s.r_epoch = e;
                    s.r_tid = t;
                } else if s.r_tid != t {
                    s.r_tid = MANY;
                }
            }
        }
        Ok(a)
    }
}

/// Runs one thread from `*pc` until a barrier or its exit. On a fault,
/// `*pc` is the faulting instruction.
fn run(k: &Kernel, r: &mut [u64], pc: &mut usize, cx: &mut Cx) -> Result<Stop, String> {
    let insts: &[Inst] = &k.insts;
    let mut p = *pc;
    let mut n: u64 = 0;
    let res = loop {
        let cur = p;
        let i = insts[cur];
        p += 1;
        n += 1;
        if r[i.g as usize] & 1 != i.gv {
            continue;
        }
        let (d, a, b, c) = (i.d as usize, i.a as usize, i.b as usize, i.c as usize);
        match i.op {
            Op::Add(w) => r[d] = zext(r[a].wrapping_add(r[b]), w),
            Op::Sub(w) => r[d] = zext(r[a].wrapping_sub(r[b]), w),
            Op::MulLo(w) => r[d] = zext(r[a].wrapping_mul(r[b]), w),
            Op::MulHi(w, s) => {
                r[d] = if s {
                    zext(
                        ((sext(r[a], w) as i128 * sext(r[b], w) as i128) >> w) as u64,
                        w,
                    )
                } else {
                    zext(
                        ((zext(r[a], w) as u128 * zext(r[b], w) as u128) >> w) as u64,
                        w,
                    )
                }
            }
            Op::MulWide(w, s) => {
                r[d] = if s {
                    zext(sext(r[a], w).wrapping_mul(sext(r[b], w)) as u64, 2 * w)
                } else {
                    zext(zext(r[a], w).wrapping_mul(zext(r[b], w)), 2 * w)
                }
            }
            Op::MadLo(w) => r[d] = zext(r[a].wrapping_mul(r[b]).wrapping_add(r[c]), w),
            Op::MadWide(w, s) => {
                let prod = if s {
                    sext(r[a], w).wrapping_mul(sext(r[b], w)) as u64
                } else {
                    zext(r[a], w).wrapping_mul(zext(r[b], w))
                };
                r[d] = zext(prod.wrapping_add(r[c]), 2 * w);
            }
            Op::Div(w, s) => {
                let y = zext(r[b], w);
                r[d] = if y == 0 {
                    zext(u64::MAX, w)
                } else if s {
                    zext(sext(r[a], w).wrapping_div(sext(r[b], w)) as u64, w)
                } else {
                    zext(r[a], w) / y
                }
            }
            Op::Rem(w, s) => {
                let y = zext(r[b], w);
                r[d] = if y == 0 {
                    zext(r[a], w)
                } else if s {
                    zext(sext(r[a], w).wrapping_rem(sext(r[b], w)) as u64, w)
                } else {
                    zext(r[a], w) % y
                }
            }
            Op::Min(w, s) => {
                r[d] = if s {
                    zext(sext(r[a], w).min(sext(r[b], w)) as u64, w)
                } else {
                    zext(r[a], w).min(zext(r[b], w))
                }
            }
            Op::Max(w, s) => {
                r[d] = if s {
                    zext(sext(r[a], w).max(sext(r[b], w)) as u64, w)
                } else {
                    zext(r[a], w).max(zext(r[b], w))
                }
            }
            Op::Neg(w) => r[d] = zext(r[a].wrapping_neg(), w),
            Op::Abs(w) => r[d] = zext(sext(r[a], w).wrapping_abs() as u64, w),
            Op::And(w) => r[d] = zext(r[a] & r[b], w),
            Op::Or(w) => r[d] = zext(r[a] | r[b], w),
            Op::Xor(w) => r[d] = zext(r[a] ^ r[b], w),
            Op::Not(w) => r[d] = zext(!r[a], w),
            Op::PNot => r[d] = (r[a] & 1) ^ 1,
            Op::Shl(w) => {
                let s = r[b] as u32;
                r[d] = if s >= w as u32 { 0 } else { zext(r[a] << s, w) }
            }
            Op::Shr(w, false) => {
                let s = r[b] as u32;
                r[d] = if s >= w as u32 { 0 } else { zext(r[a], w) >> s }
            }
            Op::Shr(w, true) => {
                let s = (r[b] as u32).min(63);
                r[d] = zext((sext(r[a], w) >> s) as u64, w)
            }
            Op::FAdd(Fw::F32) => r[d] = c32(f32_of(r[a]) + f32_of(r[b])),
            Op::FAdd(Fw::F64) => r[d] = c64(f64_of(r[a]) + f64_of(r[b])),
            Op::FSub(Fw::F32) => r[d] = c32(f32_of(r[a]) - f32_of(r[b])),
            Op::FSub(Fw::F64) => r[d] = c64(f64_of(r[a]) - f64_of(r[b])),
            Op::FMul(Fw::F32) => r[d] = c32(f32_of(r[a]) * f32_of(r[b])),
            Op::FMul(Fw::F64) => r[d] = c64(f64_of(r[a]) * f64_of(r[b])),
            Op::FDiv(Fw::F32) => r[d] = c32(f32_of(r[a]) / f32_of(r[b])),
            Op::FDiv(Fw::F64) => r[d] = c64(f64_of(r[a]) / f64_of(r[b])),
            Op::Fma(Fw::F32) => r[d] = c32(f32_of(r[a]).mul_add(f32_of(r[b]), f32_of(r[c]))),
            Op::Fma(Fw::F64) => r[d] = c64(f64_of(r[a]).mul_add(f64_of(r[b]), f64_of(r[c]))),
            Op::Sqrt(Fw::F32) => r[d] = c32(f32_of(r[a]).sqrt()),
            Op::Sqrt(Fw::F64) => r[d] = c64(f64_of(r[a]).sqrt()),
            Op::Rcp(Fw::F32) => r[d] = c32(1.0 / f32_of(r[a])),
            Op::Rcp(Fw::F64) => r[d] = c64(1.0 / f64_of(r[a])),
            Op::RcpApproxFtz64 => r[d] = c64(flush64(1.0 / flush64(f64_of(r[a])))),
            Op::FAbs(Fw::F32) => r[d] = r[a] & 0x7FFF_FFFF,
            Op::FAbs(Fw::F64) => r[d] = r[a] & 0x7FFF_FFFF_FFFF_FFFF,
            Op::FNeg(Fw::F32) => r[d] = (r[a] ^ 0x8000_0000) & 0xFFFF_FFFF,
            Op::FNeg(Fw::F64) => r[d] = r[a] ^ 0x8000_0000_0000_0000,
            Op::FMin(Fw::F32) => {
                let (x, y) = (f32_of(r[a]), f32_of(r[b]));
                r[d] = fmin(x, y, x.is_nan(), y.is_nan(), x.is_sign_negative())
                    .map_or(0x7FFF_FFFF, c32)
            }
            Op::FMax(Fw::F32) => {
                let (x, y) = (f32_of(r[a]), f32_of(r[b]));
                r[d] = fmax(x, y, x.is_nan(), y.is_nan(), x.is_sign_negative())
                    .map_or(0x7FFF_FFFF, c32)
            }
            Op::FMin(Fw::F64) => {
                let (x, y) = (f64_of(r[a]), f64_of(r[b]));
                r[d] = fmin(x, y, x.is_nan(), y.is_nan(), x.is_sign_negative())
                    .map_or(0x7FF8_0000_0000_0000, c64)
            }
            Op::FMax(Fw::F64) => {
                let (x, y) = (f64_of(r[a]), f64_of(r[b]));
                r[d] = fmax(x, y, x.is_nan(), y.is_nan(), x.is_sign_negative())
                    .map_or(0x7FF8_0000_0000_0000, c64)
            }
            Op::Cvt(cv) => r[d] = cvt(cv, r[a]),
            Op::SetpI(cmp, w, s) => {
                r[d] = if s {
                    cmp_i(cmp, sext(r[a], w), sext(r[b], w))
                } else {
                    cmp_i(cmp, zext(r[a], w), zext(r[b], w))
                } as u64
            }
            Op::SetpF(cmp, Fw::F32) => {
                r[d] = cmp_f(cmp, f32_of(r[a]) as f64, f32_of(r[b]) as f64) as u64
            }
            Op::SetpF(cmp, Fw::F64) => r[d] = cmp_f(cmp, f64_of(r[a]), f64_of(r[b])) as u64,
            Op::Selp => r[d] = if r[c] & 1 != 0 { r[a] } else { r[b] },
            Op::Mov => r[d] = r[a],
            Op::Pack(h) => r[d] = zext(r[a], h) | (zext(r[b], h) << h),
            Op::Unpack(h) => {
                let v = r[b];
                r[d] = zext(v, h);
                r[a] = zext(v >> h, h);
            }
            Op::Prmt => r[d] = prmt(r[a], r[b], r[c]),
            Op::Bfi(w) => r[d] = bfi(r[a], r[b], r[c], r[i.imm as usize], w),
            Op::Bfe(w, signed) => r[d] = bfe(r[a], r[b], r[c], w, signed),
            Op::Ld(space, size, signed) => {
                let addr = r[a].wrapping_add(i.imm as u64);
                let mut buf = [0u8; 8];
                let sz = size as usize;
                match space {
                    Space::Global => {
                        if !addr.is_multiple_of(size as u64) {
                            *pc = cur;
                            break Err(format!(
                                "misaligned global load of {size} bytes at 0x{addr:x}"
                            ));
                        }
                        if let Err(e) = cx.mem.load(addr, &mut buf[..sz]) {
                            *pc = cur;
                            break Err(format!("global load of {size} bytes at 0x{addr:x}: {e}"));
                        }
                    }
                    Space::Shared => match cx.shared_check(addr, size, false, k.src[cur].0) {
                        Ok(o) => buf[..sz].copy_from_slice(&cx.shared[o..o + sz]),
                        Err(e) => {
                            *pc = cur;
                            break Err(e);
                        }
                    },
                }
                let v = u64::from_le_bytes(buf);
                r[d] = if signed { sext(v, size * 8) as u64 } else { v };
            }
            Op::St(space, size) => {
                let addr = r[a].wrapping_add(i.imm as u64);
                let buf = r[b].to_le_bytes();
                let sz = size as usize;
                match space {
                    Space::Global => {
                        if !addr.is_multiple_of(size as u64) {
                            *pc = cur;
                            break Err(format!(
                                "misaligned global store of {size} bytes at 0x{addr:x}"
                            ));
                        }
                        if let Err(e) = cx.mem.store(addr, &buf[..sz]) {
                            *pc = cur;
                            break Err(format!("global store of {size} bytes at 0x{addr:x}: {e}"));
                        }
                    }
                    Space::Shared => match cx.shared_check(addr, size, true, k.src[cur].0) {
                        Ok(o) => cx.shared[o..o + sz].copy_from_slice(&buf[..sz]),
                        Err(e) => {
                            *pc = cur;
                            break Err(e);
                        }
                    },
                }
            }
            Op::LdParam(size, signed) => {
                let o = i.imm as usize;
                let sz = size as usize;
                let mut buf = [0u8; 8];
                buf[..sz].copy_from_slice(&cx.params[o..o + sz]);
                let v = u64::from_le_bytes(buf);
                r[d] = if signed { sext(v, size * 8) as u64 } else { v };
            }
            Op::Bra => {
                p = i.imm as usize;
                if cx.executed + n > cx.budget {
                    *pc = cur;
                    break Err(format!(
                        "instruction budget of {} exhausted (a runaway loop?)",
                        cx.budget
                    ));
                }
            }
            Op::Bar => {
                *pc = p;
                break Ok(Stop::Bar(cur));
            }
            Op::Ret => {
                *pc = cur;
                break Ok(Stop::Exit);
            }
        }
    };
    cx.executed += n;
    res
}
