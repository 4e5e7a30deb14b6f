//! Planted bugs are caught, as `Fault`s naming where.

mod common;

use common::*;
use memfit_ptx::{LaunchOptions, Module, launch, launch_with};

const HEAD: &str = ".version 9.0\n.target sm_75\n.address_size 64\n\n";

/// Block-wide tree sum in shared memory, like sum_squares_partial; `SYNC`
/// is replaced by the barrier (or nothing).
const TREE: &str = r#"
.visible .entry tree(
	.param .u64 tree_param_0
)
{
	.reg .pred 	%p<4>;
	.reg .b32 	%r<8>;
	.reg .f32 	%f<4>;
	.reg .b64 	%rd<8>;
	.shared .align 4 .b8 lane[256];

	ld.param.u64 	%rd1, [tree_param_0];
	cvta.to.global.u64 	%rd2, %rd1;
	mov.u32 	%r1, %tid.x;
	cvt.rn.f32.u32 	%f1, %r1;
	mul.wide.u32 	%rd3, %r1, 4;
	mov.u64 	%rd4, lane;
	add.s64 	%rd5, %rd4, %rd3;
	st.shared.f32 	[%rd5], %f1;
	mov.u32 	%r2, 32;
$L__loop:
	SYNC
	setp.ge.u32 	%p1, %r1, %r2;
	@%p1 bra 	$L__skip;
	shl.b32 	%r3, %r2, 2;
	cvt.u64.u32 	%rd6, %r3;
	add.s64 	%rd7, %rd5, %rd6;
	ld.shared.f32 	%f2, [%rd5];
	ld.shared.f32 	%f3, [%rd7];
	add.rn.f32 	%f2, %f2, %f3;
	st.shared.f32 	[%rd5], %f2;
$L__skip:
	shr.u32 	%r2, %r2, 1;
	setp.ne.s32 	%p2, %r2, 0;
	@%p2 bra 	$L__loop;
	SYNC
	setp.ne.s32 	%p3, %r1, 0;
	@%p3 bra 	$L__done;
	ld.shared.f32 	%f1, [lane];
	st.global.f32 	[%rd2], %f1;
$L__done:
	ret;
}
"#;

#[test]
fn the_tree_sum_runs_with_its_barriers() {
    let m = Module::parse(&format!("{HEAD}{}", TREE.replace("SYNC", "bar.sync 0;"))).unwrap();
    let mut mem = VecMemory::default();
    let out = mem.alloc(4);
    launch(
        m.kernel("tree").unwrap(),
        [3, 1, 1],
        [64, 1, 1],
        0,
        &[p64(out)],
        &mut mem,
    )
    .unwrap();
    assert_eq!(mem.f32s(out)[0], (0..64).sum::<i32>() as f32);
}

#[test]
fn a_missing_barrier_is_a_race() {
    let m = Module::parse(&format!("{HEAD}{}", TREE.replace("SYNC", ""))).unwrap();
    let mut mem = VecMemory::default();
    let out = mem.alloc(4);
    let f = launch(
        m.kernel("tree").unwrap(),
        [1, 1, 1],
        [64, 1, 1],
        0,
        &[p64(out)],
        &mut mem,
    )
    .unwrap_err();
    let s = f.to_string();
    assert!(s.contains("shared-memory race"), "{s}");
    assert!(s.starts_with("kernel tree, block (0,0,0), thread ("), "{s}");
    // Without the check it runs (to a wrong answer).
    let opts = LaunchOptions {
        race_check: false,
        ..LaunchOptions::default()
    };
    launch_with(
        m.kernel("tree").unwrap(),
        [1, 1, 1],
        [64, 1, 1],
        0,
        &[p64(out)],
        &mut mem,
        &opts,
    )
    .unwrap();
}

#[test]
fn the_real_reduction_without_its_barriers_is_a_race() {
    let Some(ptx) = ptx_of("reduce", "compute_75") else {
        return;
    };
    let n = 1000usize;
    let mut mem = VecMemory::default();
    let x = mem.upload_f32(&vec![1.0; n]);
    let partial = mem.alloc(8);
    let params = [p64(partial), p64(x), p64(n as u64)];
    let ok = Module::parse(&ptx).unwrap();
    launch(
        ok.kernel("sum_squares_partial").unwrap(),
        [1, 1, 1],
        [256, 1, 1],
        0,
        &params,
        &mut mem,
    )
    .unwrap();
    assert_eq!(mem.f64s(partial)[0], n as f64);
    let broken: String = ptx
        .lines()
        .filter(|l| !l.contains("bar.sync"))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(broken.len() < ptx.len());
    let m = Module::parse(&broken).unwrap();
    let f = launch(
        m.kernel("sum_squares_partial").unwrap(),
        [1, 1, 1],
        [256, 1, 1],
        0,
        &params,
        &mut mem,
    )
    .unwrap_err();
    assert_eq!(f.kernel, "sum_squares_partial");
    assert!(f.what.contains("shared-memory race"), "{f}");
    assert!(f.instruction.contains(".shared"), "{f}");
    eprintln!("{f}");
}

#[test]
fn an_out_of_bounds_read_names_kernel_thread_and_address() {
    let Some(ptx) = ptx_of("linear", "compute_75") else {
        return;
    };
    let m = Module::parse(&ptx).unwrap();
    let mut mem = VecMemory::default();
    let b = mem.alloc(4 * 10); // 10 biases, but the launch says 16
    let y = mem.alloc(4 * 64);
    let f = launch(
        m.kernel("bias_rows").unwrap(),
        [1, 1, 1],
        [64, 1, 1],
        0,
        &[p64(y), p64(b), p64(4), p32(16)],
        &mut mem,
    )
    .unwrap_err();
    assert_eq!(f.kernel, "bias_rows");
    assert_eq!(f.thread, [10, 0, 0]);
    assert_eq!(f.block, [0, 0, 0]);
    let s = f.to_string();
    assert!(
        s.contains(&format!("global load of 4 bytes at {:#x}", b + 40)),
        "{s}"
    );
    assert!(s.contains("outside every allocation"), "{s}");
    assert!(s.contains("ld.global.f32"), "{s}");
    assert!(
        s.starts_with("kernel bias_rows, block (0,0,0), thread (10,0,0), line "),
        "{s}"
    );
    eprintln!("{s}");
}

const COPY: &str = r#"
.visible .entry copy(
	.param .u64 copy_param_0,
	.param .u64 copy_param_1,
	.param .u32 copy_param_2
)
.maxntid 512, 1, 1
{
	.reg .pred 	%p<2>;
	.reg .b32 	%r<6>;
	.reg .b64 	%rd<8>;

	ld.param.u64 	%rd1, [copy_param_0];
	ld.param.u64 	%rd2, [copy_param_1];
	ld.param.u32 	%r1, [copy_param_2];
	mov.u32 	%r2, %ctaid.x;
	mov.u32 	%r3, %ntid.x;
	mov.u32 	%r4, %tid.x;
	mad.lo.s32 	%r5, %r2, %r3, %r4;
	setp.ge.u32 	%p1, %r5, %r1;
	@%p1 bra 	$L__end;
	mul.wide.u32 	%rd3, %r5, 4;
	add.s64 	%rd4, %rd2, %rd3;
	ld.global.u32 	%r4, [%rd4];
	add.s64 	%rd5, %rd1, %rd3;
	st.global.u32 	[%rd5], %r4;
$L__end:
	ret;
}
"#;

fn copy_module() -> Module {
    Module::parse(&format!("{HEAD}{COPY}")).unwrap()
}

#[test]
fn wrong_parameters_are_faults() {
    let m = copy_module();
    let k = m.kernel("copy").unwrap();
    assert_eq!(
        k.params()
            .iter()
            .map(|p| (p.bytes, p.align))
            .collect::<Vec<_>>(),
        [(8, 8), (8, 8), (4, 4)]
    );
    let mut mem = VecMemory::default();
    let f = launch(k, [1, 1, 1], [32, 1, 1], 0, &[p64(0), p64(0)], &mut mem).unwrap_err();
    assert_eq!(
        f.to_string(),
        "kernel copy: 2 parameters given, the kernel takes 3"
    );
    let f = launch(
        k,
        [1, 1, 1],
        [32, 1, 1],
        0,
        &[p64(0), p64(0), p64(0)],
        &mut mem,
    )
    .unwrap_err();
    assert!(
        f.what
            .contains("parameter 2 (`copy_param_2`) is 8 bytes, the kernel takes 4"),
        "{f}"
    );
}

#[test]
fn bad_launch_shapes_are_faults() {
    let m = copy_module();
    let k = m.kernel("copy").unwrap();
    let mut mem = VecMemory::default();
    let p = [p64(0), p64(0), p32(0)];
    let f = launch(k, [1, 1, 1], [1025, 1, 1], 0, &p, &mut mem).unwrap_err();
    assert!(f.what.contains("exceeds 1024 threads"), "{f}");
    let f = launch(k, [1, 1, 1], [32, 32, 1], 0, &p, &mut mem).unwrap_err();
    assert!(f.what.contains(".maxntid"), "{f}");
    let f = launch(k, [0, 1, 1], [32, 1, 1], 0, &p, &mut mem).unwrap_err();
    assert!(f.what.contains("empty grid"), "{f}");
    // n = 0: every thread exits at once.
    launch(k, [4, 1, 1], [512, 1, 1], 0, &p, &mut mem).unwrap();
}

#[test]
fn a_misaligned_global_access_is_a_fault() {
    let m = copy_module();
    let mut mem = VecMemory::default();
    let a = mem.alloc(64);
    let b = mem.alloc(64);
    let f = launch(
        m.kernel("copy").unwrap(),
        [1, 1, 1],
        [4, 1, 1],
        0,
        &[p64(b), p64(a + 2), p32(4)],
        &mut mem,
    )
    .unwrap_err();
    assert!(
        f.what.starts_with("misaligned global load of 4 bytes"),
        "{f}"
    );
    assert_eq!(f.thread, [0, 0, 0]);
}

fn shared_kernel(body: &str, decl: &str) -> Module {
    let ptx = format!(
        "{HEAD}{decl}\n.visible .entry s(\n\t.param .u64 s_param_0\n)\n{{\n\t.reg .pred %p<4>;\n\t.reg .b32 %r<8>;\n\t.reg .b64 %rd<8>;\n\t.shared .align 4 .b8 buf[64];\n\tmov.u32 %r1, %tid.x;\n\tmul.wide.u32 %rd1, %r1, 4;\n{body}\n\tret;\n}}\n"
    );
    Module::parse(&ptx).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn shared_out_of_bounds_is_a_fault() {
    let m = shared_kernel("\tst.shared.u32 [%rd1+32], %r1;", "");
    let k = m.kernel("s").unwrap();
    assert_eq!(k.static_shared_bytes(), 64);
    let mut mem = VecMemory::default();
    launch(k, [1, 1, 1], [8, 1, 1], 0, &[p64(0)], &mut mem).unwrap();
    let f = launch(k, [1, 1, 1], [9, 1, 1], 0, &[p64(0)], &mut mem).unwrap_err();
    assert_eq!(f.thread, [8, 0, 0]);
    assert!(
        f.what
            .contains("outside the block's 64 bytes of shared memory"),
        "{f}"
    );
}

#[test]
fn dynamic_shared_follows_the_static_part() {
    // Each thread writes its id to dyn[tid], reads it back and stores it globally.
    let m = shared_kernel(
        "\tmov.u64 %rd2, dyn;\n\tadd.s64 %rd3, %rd2, %rd1;\n\tst.shared.u32 [%rd3], %r1;\n\tld.shared.u32 %r2, [%rd3];\n\tld.shared.u32 %r3, [buf];\n\tld.param.u64 %rd4, [s_param_0];\n\tadd.s64 %rd5, %rd4, %rd1;\n\tst.global.u32 [%rd5], %r2;\n\tsetp.ne.s32 %p1, %r1, 0;\n\t@%p1 bra $L__x;\n\tst.global.u32 [%rd4+64], %r3;\n$L__x:",
        ".extern .shared .align 16 .b8 dyn[];",
    );
    let k = m.kernel("s").unwrap();
    let mut mem = VecMemory::default();
    let out = mem.alloc(68);
    launch(k, [1, 1, 1], [16, 1, 1], 64, &[p64(out)], &mut mem).unwrap();
    let v = mem.u32s(out);
    assert_eq!(&v[..16], (0..16).collect::<Vec<u32>>().as_slice());
    assert_eq!(
        v[16], 0xFFFF_FFFF,
        "uninitialized shared memory reads as 0xFF bytes"
    );
    let f = launch(k, [1, 1, 1], [17, 1, 1], 64, &[p64(out)], &mut mem).unwrap_err();
    assert!(f.what.contains("(static 64 + dynamic 64)"), "{f}");
}

#[test]
fn a_write_after_another_threads_read_is_a_race() {
    // Thread t reads buf[0] (written by nobody), thread 0 ... every thread writes buf[0]
    // after thread 0 read it: a write-after-read race.
    let m = shared_kernel(
        "\tld.shared.u32 %r2, [buf+4];\n\tst.shared.u32 [buf+4], %r1;",
        "",
    );
    let mut mem = VecMemory::default();
    let f = launch(
        m.kernel("s").unwrap(),
        [1, 1, 1],
        [2, 1, 1],
        0,
        &[p64(0)],
        &mut mem,
    )
    .unwrap_err();
    assert_eq!(f.thread, [1, 0, 0]);
    assert!(f.what.contains("shared-memory race"), "{f}");
    // A single thread may do what it likes.
    launch(
        m.kernel("s").unwrap(),
        [2, 1, 1],
        [1, 1, 1],
        0,
        &[p64(0)],
        &mut mem,
    )
    .unwrap();
}

#[test]
fn barriers_after_early_exits_release_but_divergent_ones_fault() {
    // Threads >= 2 exit; the others meet at the barrier: fine.
    let m = shared_kernel(
        "\tsetp.ge.u32 %p1, %r1, 2;\n\t@%p1 bra $L__out;\n\tst.shared.u32 [%rd1], %r1;\n\tbar.sync 0;\n\tld.shared.u32 %r2, [buf+4];\n$L__out:",
        "",
    );
    let mut mem = VecMemory::default();
    launch(
        m.kernel("s").unwrap(),
        [1, 1, 1],
        [8, 1, 1],
        0,
        &[p64(0)],
        &mut mem,
    )
    .unwrap();
    // Odd and even threads wait at different barriers.
    let m = shared_kernel(
        "\tand.b32 %r2, %r1, 1;\n\tsetp.eq.s32 %p1, %r2, 0;\n\t@%p1 bra $L__even;\n\tbar.sync 0;\n\tbra.uni $L__out;\n$L__even:\n\tbar.sync 0;\n$L__out:",
        "",
    );
    let f = launch(
        m.kernel("s").unwrap(),
        [1, 1, 1],
        [4, 1, 1],
        0,
        &[p64(0)],
        &mut mem,
    )
    .unwrap_err();
    assert!(f.what.contains("divergent barrier"), "{f}");
    assert_eq!(f.thread, [1, 0, 0]);
}

#[test]
fn a_runaway_loop_exhausts_the_budget() {
    let m = shared_kernel("$L__spin:\n\tadd.s32 %r2, %r2, 1;\n\tbra.uni $L__spin;", "");
    let mut mem = VecMemory::default();
    let opts = LaunchOptions {
        instruction_budget: 100_000,
        ..LaunchOptions::default()
    };
    let f = launch_with(
        m.kernel("s").unwrap(),
        [1, 1, 1],
        [1, 1, 1],
        0,
        &[p64(0)],
        &mut mem,
        &opts,
    )
    .unwrap_err();
    assert!(
        f.what.contains("instruction budget of 100000 exhausted"),
        "{f}"
    );
    assert!(f.instruction.starts_with("bra.uni"), "{f}");
}

#[test]
fn errors_are_std_errors() {
    fn is_error<E: std::error::Error>(_: &E) {}
    let e = Module::parse(&format!(
        "{HEAD}.visible .entry k()\n{{\n\tatom.global.add.u32 %r1, [%rd1], 1;\n}}\n"
    ))
    .unwrap_err();
    is_error(&e);
    let m = copy_module();
    let f = launch(
        m.kernel("copy").unwrap(),
        [1, 1, 1],
        [1, 1, 1],
        0,
        &[],
        &mut VecMemory::default(),
    )
    .unwrap_err();
    is_error(&f);
}
