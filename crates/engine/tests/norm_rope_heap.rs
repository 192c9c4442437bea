//! The heap norm-rope's backward holds, measured by the counting allocator, against
//! `norm_rope_bwd_elems` — the rule the op sizes its workspace by and the `ditmem-cpu` runtime
//! predicts by. No spec of the agreement grid peaks inside this backward (its workspace lives and
//! dies in the one op), so the grid cannot hold the rule; this test does. Alone in its test binary
//! (as `wan_meta.rs`): the counting allocator is the whole process's.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use ditmem_budget::ditmem_cpu::ops::norm_rope_bwd_elems;
use ditmem_engine::ops::{norm_rope, RopeTable};
use ditmem_engine::CountingAlloc;

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

const F32: u64 = 4;

/// Peak heap of one backward from y = norm_rope(x, w) above what was live before it, for an
/// untracked f32 x of `rows` tokens (one sample of a table of `rows` positions) × `heads` heads
/// of width `dh`, and a tracked weight (dh). Run on one rayon thread, so that no other
/// thread's allocations fall inside the measurement.
fn backward_peak(rows: usize, heads: usize, dh: usize) -> u64 {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    pool.install(|| {
        let dev = Device::Cpu;
        let ids: Vec<f64> = (0..rows).map(|i| i as f64).collect();
        let table = Arc::new(RopeTable::new(&ids, &[dh], 10_000.0, DType::F32).unwrap());
        let x = Tensor::rand(-1f32, 1f32, (rows, heads * dh), &dev).unwrap();
        let w = Var::from_tensor(&Tensor::rand(0.5f32, 1.5f32, dh, &dev).unwrap()).unwrap();
        let y = norm_rope(&x, w.as_tensor(), 1e-6, &table).unwrap();
        // One warm-up backward, then the measured one.
        drop(y.backward().unwrap());
        let before = A.live();
        A.reset_peak();
        let grads = y.backward().unwrap();
        let peak = A.peak() - before;
        assert!(grads.get(w.as_tensor()).is_some(), "no gradient for w");
        drop(grads);
        peak
    })
}

/// What the rule says the backward's workspace is (x's dtype and the accumulation type are f32).
fn workspace(elems: usize, dh: usize) -> u64 {
    let (x_elems, acc_elems) = norm_rope_bwd_elems(elems as u64, dh as u64);
    x_elems * F32 + acc_elems * F32
}

/// At the peak of the backward (inside the op) candle holds the seed gradient (ones like y),
/// and the op its workspace and the weight's gradient (dh); the rest (the gradient store, the
/// sorted nodes, the tensors' bookkeeping) does not depend on the sizes. So between two sizes
/// the peak moves by the workspace's change, the seed's and dw's — the workspace as the rule
/// states it, measured.
#[test]
fn the_backward_holds_the_workspace_the_rule_states() {
    let (rows, heads) = (96, 8);
    // Same x, narrower heads: more rstd groups (one per row and head), a smaller dw.
    let (wide, narrow) = (64, 16);
    let e = rows * heads * wide;
    let (h_wide, h_narrow) = (heads, heads * wide / narrow);
    let by_dh =
        backward_peak(rows, h_narrow, narrow) as i64 - backward_peak(rows, h_wide, wide) as i64;
    let rule = workspace(e, narrow) as i64 - workspace(e, wide) as i64;
    let dw = (narrow as i64 - wide as i64) * F32 as i64;
    assert_eq!(by_dh, rule + dw, "peak change with d_h {wide} → {narrow}");
    // Twice the tokens at the same heads: the seed and the workspace double, dw does not.
    let by_rows =
        backward_peak(2 * rows, heads, wide) as i64 - backward_peak(rows, heads, wide) as i64;
    let rule = workspace(2 * e, wide) as i64 - workspace(e, wide) as i64;
    let seed = (e as u64 * F32) as i64;
    assert_eq!(by_rows, rule + seed, "peak change with the tokens doubled");
}
