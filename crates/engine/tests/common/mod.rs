//! Shared helpers of the engine tests: a tiny spec (depth 2, hidden 64, 4 heads, patch 2, 128×128
//! images = 16×16 latents = 64 tokens, batch 4).
#![allow(dead_code)]

use candle_core::Tensor;
use ditmem_budget::{Precision, Recompute, Spec};
use ditmem_engine::{Batch, CountingAlloc, SyntheticData, TrainOptions, Trainer};

// The tensor helpers (random tensors, gradients through a graph, max |a − b|) are in their own
// file so the conformance tests include the same one.
mod tensors;
#[allow(unused_imports)] // not every test binary that includes `common` uses them
pub(crate) use tensors::*;

pub(crate) fn tiny(precision: Precision) -> Spec {
    let mut s = Spec::small();
    s.recipe.precision = precision;
    s.recipe.recompute = Recompute::None;
    s
}

pub(crate) fn batch(spec: &Spec, seed: u64) -> Batch {
    SyntheticData::new(spec, seed).unwrap().step_batch(0)
}

pub(crate) fn trainer(spec: &Spec, keep: bool) -> Trainer {
    Trainer::new(
        spec,
        TrainOptions {
            seed: 42,
            lr: 1e-3,
            keep_gradients: keep,
            ..TrainOptions::default()
        },
    )
    .unwrap()
}

/// Gradients of one forward/backward, by name, as f64 vectors.
pub(crate) fn grads(spec: &Spec, b: &Batch) -> (f64, Vec<(String, Vec<f64>)>) {
    let mut t = trainer(spec, true);
    let loss = t.compute_gradients(b).unwrap();
    let g = t
        .gradients()
        .unwrap()
        .into_iter()
        .map(|(n, g)| (n, g.flatten_all().unwrap().to_vec1::<f64>().unwrap()))
        .collect();
    (loss, g)
}

/// max |a−b| / max(max |b|, tiny) over every gradient.
pub(crate) fn max_rel_diff(a: &[(String, Vec<f64>)], b: &[(String, Vec<f64>)]) -> f64 {
    assert_eq!(a.len(), b.len(), "different gradient sets");
    let mut worst: f64 = 0.0;
    for ((na, ga), (nb, gb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        assert_eq!(ga.len(), gb.len(), "{na}");
        let scale = gb.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
        let d = ga
            .iter()
            .zip(gb)
            .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
        worst = worst.max(d / scale);
    }
    worst
}

/// Heap bytes one call of `f` leaves alive (its result with everything it holds), counted by
/// `alloc` over `n` results kept at once: the median of five counts, after `n` warm-up calls
/// (the first calls grow rayon's and the allocator's per-thread state once). The median, not
/// the least: a batch during which some other thread of the process frees a few bytes (once
/// measured: 128 B over 64 calls, 4,582 B per call against 4,584) reads low, one during which
/// it allocates reads high; one disturbed batch out of five moves neither end into the middle.
/// For a test binary that runs alone: the counting allocator is the whole process's.
pub(crate) fn heap_per_call(alloc: &CountingAlloc, n: u64, f: &dyn Fn() -> Tensor) -> u64 {
    for _ in 0..n {
        drop(f());
    }
    let mut counts: Vec<u64> = (0..5)
        .map(|_| {
            let before = alloc.live();
            let ys: Vec<Tensor> = (0..n).map(|_| f()).collect();
            let per = alloc.live().saturating_sub(before) / n;
            drop(ys);
            per
        })
        .collect();
    counts.sort_unstable();
    counts[counts.len() / 2]
}

/// The counting allocator is the whole process's: a test binary whose tests measure or train
/// runs them one at a time, each holding this guard.
pub(crate) fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Central differences of the f64 loss (`s` at fp64) along each named weight's gradient agree
/// with the step's gradient (dL/dε at ε = 0 along g is ‖g‖²) to 1e-5 relative; no named
/// gradient is zero.
pub(crate) fn gradients_match_finite_differences(mut s: Spec, names: &[&str]) {
    s.recipe.precision = Precision::Fp64;
    let batch = SyntheticData::new(&s, 5).unwrap().step_batch(0);
    let new = || {
        Trainer::new(
            &s,
            TrainOptions {
                seed: 9,
                keep_gradients: true,
                ..TrainOptions::default()
            },
        )
        .unwrap()
    };
    let mut t = new();
    t.compute_gradients(&batch).unwrap();
    for &name in names {
        let g = t.gradient(name).unwrap().unwrap();
        let w = t.parameter(name).unwrap();
        let gn: f64 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
        assert!(gn > 0.0, "{name}: zero gradient");
        let eps = 1e-4 / gn.sqrt();
        let loss_at = |e: f64| {
            let mut u = new();
            let v = (&w + (&g * e).unwrap()).unwrap();
            u.load_parameters(&[(name.to_string(), v)]).unwrap();
            u.compute_gradients(&batch).unwrap()
        };
        let fd = (loss_at(eps) - loss_at(-eps)) / (2.0 * eps);
        let rel = (fd - gn).abs() / gn;
        assert!(
            rel < 1e-5,
            "{name}: finite difference {fd} vs ‖g‖² {gn} ({rel:.2e})"
        );
    }
}
