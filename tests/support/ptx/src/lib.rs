//! A PTX interpreter for memfit's fake CUDA driver.
//!
//! memfit's CUDA backend (`src/backend/cuda/`) compiles its kernels with
//! NVRTC and launches them through the CUDA driver. CI machines have no GPU,
//! so a fake driver stands in for `libcuda`; its `cuLaunchKernel` hands the
//! PTX that NVRTC produced to this crate, which runs it on the CPU. The goal
//! is to exercise the real kernels (the same PTX a GPU would JIT) and to
//! catch the bugs a GPU would only show as wrong numbers or hangs: out of
//! bounds and misaligned accesses, shared-memory races (a missing
//! `__syncthreads`), divergent barriers, runaway loops, parameter blocks of
//! the wrong shape.
//!
//! # Use
//!
//! [`Module::parse`] decodes a PTX module once (registers to indices,
//! immediates to constant registers, labels to instruction indices,
//! opcodes to typed operations); anything it does not support is refused
//! with a [`ParseError`] naming the instruction or directive and its line,
//! so an unsupported kernel never runs with a guess. [`launch`] (or
//! [`launch_with`]) runs one grid against a [`Memory`], the fake driver's
//! device memory, whose addresses are opaque handles.
//!
//! # Execution model
//!
//! * Blocks run one after another, x fastest, then y, then z.
//! * Within a block the threads run one at a time: thread 0 runs until it
//!   reaches `bar.sync` or exits, then thread 1, and so on (x fastest); when
//!   every live thread waits at the barrier it releases and the round
//!   starts again ("lock-step between barriers"). Exited threads count as
//!   arrived, so `if (i >= n) return; ... __syncthreads();` is fine.
//!   Live threads waiting at *different* `bar.sync` instructions are a
//!   [`Fault`] ("divergent barrier"): CUDA requires `__syncthreads` in
//!   conditional code to be reached by the whole block, and a GPU would
//!   hang or mis-synchronize. Under this model a barrier can otherwise
//!   always release, so no deadlock detection is needed.
//! * Shared memory is the static shared variables of the module and the
//!   kernel, then the dynamic (`.extern .shared`) part, filled with `0xFF`
//!   at every block start, so uninitialized reads show up as NaN. Every
//!   shared byte remembers which thread last wrote it and read it, and in
//!   which barrier epoch: a thread reading or writing a byte another thread
//!   wrote since the last barrier, or writing a byte another thread read
//!   since the last barrier, is a race [`Fault`] (whatever the order this
//!   sequential model happens to run them in).
//! * Global memory goes through [`Memory`]; accesses must be naturally
//!   aligned (as on a GPU). `.param` reads come from the launch's
//!   parameter block, laid out by [`Kernel::params`].
//! * Arithmetic follows the PTX ISA: integer ops wrap, shift amounts clamp,
//!   `div`/`rem` by zero give all ones / the dividend (what NVIDIA GPUs
//!   return; PTX leaves it unspecified), `.rn` float ops are IEEE
//!   round-to-nearest-even (`fma` fused), f32 results that are NaN are the
//!   canonical `0x7fffffff`, `min`/`max` return the non-NaN operand and
//!   order `-0 < +0`, float-to-int `cvt` saturates with NaN to 0, f16
//!   conversions round to nearest even with subnormals and overflow to
//!   infinity. `rcp.approx.ftz.f64` is computed as an exact `1/x` with
//!   subnormal inputs and results flushed to zero.
//! * An instruction budget per launch ([`LaunchOptions::instruction_budget`],
//!   default 2^36) turns a runaway loop into a [`Fault`].
//!
//! Registers start at zero at the start of a launch; a thread slot's
//! registers are not cleared between blocks (PTX leaves unwritten
//! registers undefined; NVRTC's code never reads one). Instruction counts
//! include instructions whose guard predicate was false.
//!
//! # Supported PTX
//!
//! What NVRTC 13 emits for memfit's kernels at `compute_75` and
//! `compute_90` (both give the same instruction set):
//!
//! * directives: `.version`, `.target`, `.address_size 64`, `[.visible]
//!   .entry name(.param ...)` (scalar and `.align N .b8 name[M]`
//!   parameters), `.maxntid` / `.reqntid` (checked at launch),
//!   `.minnctapersm` / `.maxnreg` (ignored), `.reg` (including `%r<N>` and
//!   the `{ .reg .b32 %temp; ... }` scopes), `.shared` (module or kernel
//!   level, static), `.extern .shared name[]` (dynamic), `.pragma`, labels,
//!   `//` and `/* */` comments;
//! * integers (16/32/64 bits): `add sub mul.lo mul.hi mul.wide mad.lo
//!   mad.wide div rem min max neg abs not and or xor shl shr`;
//! * f32/f64: `add sub mul` (`.rn` or none), `fma.rn div.rn sqrt.rn rcp.rn
//!   rcp.approx.ftz.f64 abs neg min max`;
//! * `cvt` between u8..u64/s8..s64/f16/f32/f64 (`.rn` to a float, `.rni
//!   .rzi .rmi .rpi` to an integer or a same-size float), `setp` (every
//!   integer, unsigned and ordered/unordered float comparison), `selp`,
//!   `and/or/xor/not.pred`, `mov` (registers, immediates, special
//!   registers %tid/%ntid/%ctaid/%nctaid, shared symbol addresses, `{a, b}`
//!   pack/unpack), `prmt.b32` (default mode), `bfi.b32/b64`, `bfe.{u,s}{32,64}`;
//! * `ld`/`st` `.global` / `.shared` (`[reg]`, `[reg+imm]`, `[symbol+imm]`;
//!   cache hints such as `.nc` accepted), `ld.param`, `cvta.to.global.u64`,
//!   `bar.sync 0` / `barrier.sync 0`, `bra[.uni]`, `@p` / `@!p` guards,
//!   `ret` / `exit`.
//!
//! # Not modelled
//!
//! Warps and anything warp-level (shuffles, votes, `activemask`, warp
//! synchronous code relying on lock-step warps), atomics, memory fences and
//! real concurrency between threads or blocks (the order is deterministic
//! and sequential), local memory, textures, constant banks, device
//! functions and calls, clusters, timing and performance counters. Those
//! instructions are refused at parse time. Floating-point `.ftz`, `.sat`
//! and non-nearest rounding modes are refused except where listed above.

mod exec;
mod parse;

pub use exec::{Fault, LaunchOptions, LaunchStats, Memory, launch, launch_with};
pub use parse::{Kernel, Module, Param, ParseError};
