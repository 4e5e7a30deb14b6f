//! The pool's accounting: peaks, budgets, reuse, and exact saved bytes.

mod common;

use memfit::Error;
use memfit::exec::{LossOptions, Plan, forward_backward};
use memfit::memory::{Category, EventKind, Pool, Tag};
use memfit::nn::{BlockKind, Mode, ResNet, StemKind};
use memfit::optim::Sgd;
use std::collections::HashMap;

#[test]
fn peak_is_the_sum_of_buffers_alive_at_that_moment() {
    let pool = Pool::new();
    let a = pool
        .zeros_f32(&[25], Category::Activations, Tag::fixed("a"))
        .unwrap(); // 100 B
    let b = pool
        .zeros_f32(&[50], Category::Grads, Tag::fixed("b"))
        .unwrap(); // 200 B
    drop(a);
    let c = pool
        .zeros_f32(&[10], Category::Workspace, Tag::fixed("c"))
        .unwrap(); // 40 B
    let s = pool.stats();
    assert_eq!(s.peak_total, 300);
    assert_eq!(s.at_peak.get(Category::Activations), 100);
    assert_eq!(s.at_peak.get(Category::Grads), 200);
    assert_eq!(s.live.total(), 240);
    assert_eq!(s.peak.get(Category::Workspace), 40);
    drop((b, c));
    assert_eq!(pool.live_bytes(), 0);
}

/// Replays the timeline of a real training step: the running sum of the
/// events reaches exactly the reported peak, and the set of buffers alive
/// at that moment adds up to it.
#[test]
fn timeline_of_a_training_step_explains_the_peak() {
    let pool = Pool::new();
    let mut model = ResNet::new(
        &pool,
        common::tiny_config(BlockKind::Bottleneck, [1, 1, 1, 1], 8, 10),
    )
    .unwrap();
    let (images, labels) = common::batch(&pool, 1, 4, 32, 32, 10);
    let base = pool.live_bytes();
    pool.reset_peak();
    pool.record_timeline(true);
    let plan = Plan::keep_all(&model);
    forward_backward(
        &mut model,
        &pool,
        &plan,
        images,
        &labels,
        LossOptions::default(),
    )
    .unwrap();
    let events = pool.timeline();
    let stats = pool.stats();
    assert!(stats.peak_total > base);

    let mut live: HashMap<u64, usize> = HashMap::new();
    let mut running = base;
    let (mut best, mut best_set) = (base, 0usize);
    for e in &events {
        match e.kind {
            EventKind::Alloc => {
                live.insert(e.id, e.bytes);
                running += e.bytes;
            }
            EventKind::Free => {
                // The images were allocated before recording started, so
                // their free has no matching alloc in the timeline.
                live.remove(&e.id);
                running -= e.bytes;
            }
        }
        assert_eq!(running, e.live_total, "event {} live total", e.id);
        if running > best {
            best = running;
            best_set = live.values().sum();
        }
    }
    assert_eq!(best, stats.peak_total);
    // What was live at the peak: buffers allocated during the step plus the
    // ones from before (params, grads, images) that were still alive.
    let pre_existing_alive = best - best_set;
    assert!(pre_existing_alive <= base, "{pre_existing_alive} > {base}");
    assert_eq!(stats.at_peak.total(), stats.peak_total);
}

#[test]
fn out_of_budget_fires_exactly_at_the_budget() {
    let pool = Pool::with_budget(1000);
    let _a = pool
        .zeros_f32(&[200], Category::Params, Tag::fixed("params.a"))
        .unwrap(); // 800 B
    let _b = pool
        .zeros_f32(&[50], Category::Activations, Tag::fixed("act.b"))
        .unwrap(); // exactly 1000
    let err = pool
        .zeros_f32(&[1], Category::Workspace, Tag::fixed("ws.c"))
        .unwrap_err();
    let Error::OutOfBudget(report) = &err else {
        panic!("expected OutOfBudget, got {err}")
    };
    assert_eq!(report.requested, 4);
    assert_eq!(report.budget, 1000);
    assert_eq!(report.live.get(Category::Params), 800);
    assert_eq!(report.live.get(Category::Activations), 200);
    assert_eq!(
        report.largest[0],
        ("params.a".to_string(), Category::Params, 800)
    );
    let msg = err.to_string();
    assert!(
        msg.contains("ws.c") && msg.contains("params.a") && msg.contains("budget"),
        "{msg}"
    );
}

/// A full step fits a budget equal to its measured peak and fails one byte
/// below it.
#[test]
fn training_step_fits_its_peak_and_not_one_byte_less() {
    let run = |budget: Option<usize>| {
        let pool = Pool::new();
        let mut model = ResNet::new(
            &pool,
            common::tiny_config(BlockKind::Basic, [1, 1, 1, 1], 8, 10),
        )
        .unwrap();
        let (images, labels) = common::batch(&pool, 2, 2, 32, 32, 10);
        pool.set_budget(budget);
        let plan = Plan::keep_all(&model);
        forward_backward(
            &mut model,
            &pool,
            &plan,
            images,
            &labels,
            LossOptions::default(),
        )
        .map(|_| pool.stats().peak_total)
    };
    let peak = run(None).unwrap();
    assert_eq!(run(Some(peak)).unwrap(), peak);
    assert!(matches!(run(Some(peak - 1)), Err(Error::OutOfBudget(_))));
}

#[test]
fn steady_state_training_does_no_system_allocation() {
    let pool = Pool::new();
    let mut model = ResNet::new(
        &pool,
        common::tiny_config(BlockKind::Bottleneck, [1, 1, 1, 1], 8, 10),
    )
    .unwrap();
    let mut sgd = Sgd::new(0.1, 0.9, 1e-4, false);
    let plan = Plan::keep_all(&model);
    let mut step = |seed| {
        let (images, labels) = common::batch(&pool, seed, 4, 32, 32, 10);
        model.zero_grad();
        forward_backward(
            &mut model,
            &pool,
            &plan,
            images,
            &labels,
            LossOptions::default(),
        )
        .unwrap();
        sgd.step(&pool, &mut model).unwrap();
        pool.stats()
    };
    step(1);
    let warm = step(2);
    let after = step(3);
    assert_eq!(
        after.system_allocs, warm.system_allocs,
        "step 3 asked the system for memory"
    );
    assert!(after.reuses > warm.reuses);
    assert_eq!(after.reserved, warm.reserved);
}

/// Each stage's closed-form `saved_bytes` equals the bytes of what its
/// forward kept, and the pool's live delta over the forward is exactly the
/// saved state plus the output.
#[test]
fn saved_bytes_are_exact_per_stage() {
    for (block, layers, stem) in [
        (BlockKind::Bottleneck, [2, 1, 1, 1], StemKind::ImageNet),
        (BlockKind::Basic, [1, 2, 1, 1], StemKind::ImageNet),
        (BlockKind::Basic, [1, 2, 1, 1], StemKind::Small),
        (BlockKind::Bottleneck, [1, 1, 1, 1], StemKind::Small),
    ] {
        let pool = Pool::new();
        let mut config = common::tiny_config(block, layers, 8, 10);
        config.stem = stem;
        let mut model = ResNet::new(&pool, config).unwrap();
        let (n, h, w): (usize, usize, usize) = (3, 40, 36);
        // The small stem keeps the input resolution; the ImageNet one quarters it.
        let stem_out = match stem {
            StemKind::Small => (h, w, 8),
            StemKind::ImageNet => (h.div_ceil(4), w.div_ceil(4), 8),
        };
        assert_eq!(
            model.stage_inputs(h, w)[1],
            stem_out,
            "{stem:?} stem output"
        );
        let predicted = model.saved_bytes_per_stage(n, h, w);
        let (mut x, _) = common::batch(&pool, 3, n, h, w, 10);
        let mut kept = Vec::new();
        let ctx = model.ctx(&pool);
        for (i, stage) in model.stages.iter_mut().enumerate() {
            let before = pool.live_bytes();
            let input_bytes = x.bytes();
            let (y, saved) = stage.forward(&ctx, x, Mode::Train).unwrap();
            let saved = saved.unwrap();
            assert_eq!(saved.bytes(), predicted[i], "{} saved bytes", stage.name());
            // The input moved into `saved` (or was freed, for the head).
            let delta = pool.live_bytes() as isize - before as isize;
            assert_eq!(
                delta,
                (saved.bytes() + y.bytes()) as isize - input_bytes as isize,
                "{} live delta",
                stage.name()
            );
            kept.push(saved);
            x = y;
        }
    }
}
