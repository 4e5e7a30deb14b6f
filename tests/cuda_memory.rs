//! The pool's device memory against what the driver holds.
//!
//! The pool maps device memory in 2 MiB pages into reserved addresses and
//! unmaps free blocks' pages before it would hold more than its budget;
//! `MemoryStats::reserved` is its count of the pages it holds. Here that
//! count is checked against the driver's own: the test CUDA library
//! (`tests/support/fakecuda`) counts the physical memory it has handed out
//! (`cuMemCreate` until `cuMemRelease` and `cuMemUnmap`), and exports the
//! count as `fakecuda_stats`. On a real GPU (no such symbol) the count is
//! the card's memory in use (`cuMemGetInfo`), which also holds the context
//! and the libraries' handles: there only the pages of the first part,
//! where nothing else allocates, are compared. Without a CUDA device the
//! test skips, unless `MEMFIT_REQUIRE_GPU=1`.
//!
//! One test in this binary: the driver's count is process-wide.

#![cfg(any(feature = "cuda", feature = "cuda-12"))]

mod common;

use memfit::device::{Device, Target, cuda};
use memfit::exec::Plan;
use memfit::memory::{Category, Pool, Tag};
use memfit::nn::{BlockKind, ResNet, ResNetConfig, StemKind};
use memfit::optim::{Optimizer, Sgd};
use memfit::tensor::Precision;
use memfit::train::NanPolicy;
use memfit::train::step::{StepPolicy, TrainStep};

const PAGE: usize = 2 << 20;

/// The test CUDA library's `FakeStats` (tests/support/fakecuda/src/state.rs).
#[repr(C)]
#[derive(Default)]
struct FakeStats {
    live_bytes: u64,
    peak_bytes: u64,
    allocs: u64,
    frees: u64,
    launches: u64,
    instructions: u64,
    failed: u64,
}

/// The driver's own count, when the driver is the test CUDA library.
fn driver_stats() -> Option<FakeStats> {
    // SAFETY: RTLD_NOLOAD only looks up a library cudarc already loaded;
    // the symbol, where present, has the signature of fakecuda_stats.
    unsafe {
        let lib = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if lib.is_null() {
            return None;
        }
        let f = libc::dlsym(lib, c"fakecuda_stats".as_ptr());
        if f.is_null() {
            return None;
        }
        let f: unsafe extern "C" fn(*mut FakeStats) = std::mem::transmute(f);
        let mut s = FakeStats::default();
        f(&mut s);
        Some(s)
    }
}

/// What the driver holds, and whether it is the pool's alone: the test
/// CUDA library's exact count, else the card's memory in use.
fn driver_bytes() -> (usize, bool) {
    match driver_stats() {
        Some(s) => (s.live_bytes as usize, true),
        None => {
            let core = cuda::core(0).expect("the device started");
            (core.memory_in_use().expect("cuMemGetInfo").0, false)
        }
    }
}

fn gpu() -> Option<Pool> {
    let info = common::cuda_device()?;
    println!("running on {info}");
    Some(Pool::on(Device::Cuda(0)))
}

#[test]
fn the_pool_holds_what_the_driver_says_and_gives_pages_back() {
    let Some(pool) = gpu() else { return };
    let budget = 8 * PAGE;
    pool.set_budget(Some(budget));
    // The first allocation starts the device; what the driver held before
    // the pool's first page is not the pool's.
    let probe = pool
        .empty_f32(&[16], Category::Workspace, Tag::fixed("start"))
        .unwrap();
    let (before, exact) = driver_bytes();
    let base = before - pool.stats().reserved;
    drop(probe);
    let driver = || driver_bytes().0 - base;
    let check = |when: &str| {
        let s = pool.stats();
        assert_eq!(driver(), s.reserved, "{when}: driver vs pool");
        let budget = pool.budget().expect("set above");
        assert!(s.reserved <= budget, "{when}: {} held", s.reserved);
    };

    // Eight pages live, every other one freed, then two pages at once:
    // the live bytes fit the budget, no free block does; two free pages go
    // back to the driver before the request maps two more.
    let page = |n: usize, tag| {
        pool.empty_f32(&[n * PAGE / 4], Category::Activations, Tag::fixed(tag))
            .unwrap()
    };
    let all: Vec<_> = (0..8).map(|_| page(1, "x")).collect();
    check("eight pages");
    assert_eq!(driver(), budget);
    let odd: Vec<_> = all
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, t)| t)
        .collect();
    check("four freed, cached");
    assert_eq!(driver(), budget, "freed blocks stay mapped until needed");
    let frees = driver_stats().map(|s| s.frees);
    let two = page(2, "two");
    check("two pages past the fragments");
    assert_eq!(pool.stats().live.total(), 6 * PAGE);
    if let Some(frees) = frees {
        assert_eq!(
            driver_stats().unwrap().frees - frees,
            2,
            "two pages went back to the driver"
        );
    }
    // A page handed out again reads what the kernels wrote, not the fresh
    // memory's fill: zeros from the pool's memset.
    let fresh = page(1, "fresh");
    assert!(
        memfit::backend::copy_to_host(&fresh)
            .unwrap()
            .iter()
            .all(|&v| v == 0.0),
        "freshly mapped pages are zeroed"
    );
    drop((odd, two, fresh));
    check("all freed");
    if !exact {
        println!(
            "a real card: the pages matched the card's memory in use; the training part is not compared"
        );
        return;
    }

    // Two training steps of a small ResNet under a budget that holds
    // cuBLAS's 32 MiB workspace: after each, the driver holds what the pool
    // says, and it never held more than the budget beyond what it held
    // before.
    let budget = 24 * PAGE;
    pool.set_budget(Some(budget));
    let config = ResNetConfig {
        block: BlockKind::Basic,
        layers: [1, 1, 1, 1],
        base_width: 8,
        num_classes: 10,
        stem: StemKind::ImageNet,
        zero_init_residual: false,
        seed: 3,
        precision: Precision::BF16,
        recompute_bn_relu: false,
        target: Target::Cuda(0),
    };
    let (window, size) = (4, 32);
    let images: Vec<f32> = (0..window * size * size * 3)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let labels: Vec<usize> = (0..window).map(|i| i % 10).collect();
    let mut model = ResNet::new(&pool, config).unwrap();
    let mut opt = Optimizer::Sgd(Sgd::new(0.05, 0.9, 1e-4, false));
    let mut step = TrainStep::new(
        StepPolicy {
            plan: Plan::keep_all(&model),
            micro_batch: 2,
            label_smoothing: 0.0,
            clip_grad_norm: None,
            nan_policy: NanPolicy::Stop,
        },
        None,
    );
    for i in 1..=2 {
        step.run(
            &mut model,
            &pool,
            &mut opt,
            &images,
            (size, size),
            &labels,
            window,
            i,
            false,
        )
        .unwrap();
        check(&format!("after step {i}"));
    }
    let s = pool.stats();
    assert!(
        s.reserved_peak <= budget,
        "reserved peak {}",
        s.reserved_peak
    );
    assert!(
        driver_stats().expect("exact").peak_bytes as usize <= base + budget,
        "the driver never held more than the budget for the pool"
    );
}
