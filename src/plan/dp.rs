//! The budget dynamic program over the stage chain.
//!
//! A plan is a sequence of segments, each kept or recomputed. Walking the
//! chain left to right, what matters about a prefix is how many bytes it
//! retains for the backward (`retained`) and how much forward it will
//! recompute (`seconds`): every later segment's peak is `retained` plus a
//! local peak that depends only on that segment (see [`local_peak`]). So the
//! program keeps, at every stage boundary, the Pareto front of (retained,
//! seconds) over feasible prefixes, and extends each by every possible next
//! segment. This is exact under the cost model (no discretisation).

use crate::exec::{Plan, Segment};
use crate::plan::{CostModel, StageCost};

#[derive(Clone, Copy)]
struct State {
    retained: usize,
    seconds: f64,
    /// (boundary, index in that front, segment) this state came from.
    from: Option<(usize, usize, Segment)>,
}

/// Peak of segment `s` above what the earlier segments retain, over its
/// forward, its replay (when recomputed) and its backward.
pub(crate) fn local_peak(s: &[StageCost], recompute: bool) -> usize {
    let mut peak = 0;
    let mut acc = 0;
    if recompute {
        // First forward: only the checkpoint survives each stage.
        peak = peak.max(s[0].forward_peak);
        for st in &s[1..] {
            peak = peak.max(s[0].input + st.forward_peak);
        }
        // Replay next to the output gradient.
        let d_out = s.last().map_or(0, |st| st.output);
        for st in s {
            peak = peak.max(d_out + acc + st.forward_peak);
            acc += st.saved;
        }
    } else {
        for st in s {
            peak = peak.max(acc + st.forward_peak);
            acc += st.saved;
        }
    }
    // Backward, last stage first, with the earlier stages' saved tensors.
    let mut inner: usize = s.iter().map(|st| st.saved).sum();
    for st in s.iter().rev() {
        inner -= st.saved;
        peak = peak.max(inner + st.backward_peak);
    }
    peak
}

fn retains(s: &[StageCost], recompute: bool) -> usize {
    if recompute {
        s[0].input
    } else {
        s.iter().map(|st| st.saved).sum()
    }
}

/// Inserts `st` unless dominated; drops states it dominates.
fn insert(front: &mut Vec<State>, st: State) {
    if front
        .iter()
        .any(|o| o.retained <= st.retained && o.seconds <= st.seconds)
    {
        return;
    }
    front.retain(|o| !(st.retained <= o.retained && st.seconds <= o.seconds));
    front.push(st);
}

// Indices into `fronts` are boundaries of the chain, not a sequence walk.
#[allow(clippy::needless_range_loop)]
pub(crate) fn best_plan(costs: &CostModel, budget: usize) -> Option<Plan> {
    let n = costs.stages.len();
    let cap = budget.checked_sub(costs.persistent)?;
    if costs.eval_peak > cap || n == 0 {
        return None;
    }
    let logits = costs.stages[n - 1].output;
    let mut fronts: Vec<Vec<State>> = vec![Vec::new(); n + 1];
    fronts[0].push(State {
        retained: 0,
        seconds: 0.0,
        from: None,
    });
    for p in 0..n {
        let front = std::mem::take(&mut fronts[p]);
        for (idx, st) in front.iter().enumerate() {
            let mut recompute_seconds = 0.0;
            for q in p + 1..=n {
                let s = &costs.stages[p..q];
                recompute_seconds += costs.stages[q - 1].forward_seconds();
                // The head keeps no input, so it is never recomputed.
                for recompute in [false, true] {
                    if recompute && q == n {
                        continue;
                    }
                    if st.retained + local_peak(s, recompute) > cap {
                        continue;
                    }
                    let next = State {
                        retained: st.retained + retains(s, recompute),
                        seconds: st.seconds + if recompute { recompute_seconds } else { 0.0 },
                        from: Some((
                            p,
                            idx,
                            Segment {
                                start: p,
                                end: q,
                                recompute,
                            },
                        )),
                    };
                    if q == n && next.retained + 2 * logits > cap {
                        continue;
                    }
                    insert(&mut fronts[q], next);
                }
            }
        }
        fronts[p] = front;
    }
    // Least recomputation; among equals, the lowest peak.
    let best = fronts[n].iter().copied().min_by(|a, b| {
        a.seconds
            .total_cmp(&b.seconds)
            .then(a.retained.cmp(&b.retained))
    })?;
    let mut segments = Vec::new();
    let mut cur = best;
    while let Some((p, idx, seg)) = cur.from {
        segments.push(seg);
        cur = fronts[p][idx];
    }
    segments.reverse();
    Some(merge_kept(segments))
}

/// Adjacent kept segments are one segment (the same execution).
fn merge_kept(segments: Vec<Segment>) -> Plan {
    let mut out: Vec<Segment> = Vec::new();
    for s in segments {
        match out.last_mut() {
            Some(last) if !last.recompute && !s.recompute => last.end = s.end,
            _ => out.push(s),
        }
    }
    Plan { segments: out }
}
