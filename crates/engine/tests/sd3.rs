//! SD3 in the engine: the backward is the
//! forward's derivative (finite differences). What every family shares (the parameter table,
//! the levers, equal gradients across recompute and attention modes, the agreement grid) is in
//! `families.rs`.

use ditmem_budget::{Precision, Spec};
use ditmem_engine::families::sd3::tiny_spec;
use ditmem_engine::{CountingAlloc, SyntheticData, TrainOptions, Trainer};

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

/// The counting allocator is the whole process's: the tests of this file run one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn spec(qk_norm: bool) -> Spec {
    ditmem_engine::host::resolve(&tiny_spec(3, 2, qk_norm, 5, 6).unwrap())
}

/// The backward is the forward's derivative: central differences of the f64 loss along a few
/// weights' gradients (joint-attention projections of both streams, a q/k norm weight, the
/// last block's modulation) agree with the step's gradients.
#[test]
fn sd3_gradients_match_finite_differences() {
    let _one = one_at_a_time();
    let mut s = spec(true);
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
    for name in [
        "transformer_blocks.1.attn.add_q_proj.weight",
        "transformer_blocks.0.attn.to_k.weight",
        "transformer_blocks.1.attn.norm_added_k.weight",
        "transformer_blocks.2.norm1_context.linear.weight",
        "transformer_blocks.0.ff_context.net.2.weight",
    ] {
        let g = t.gradient(name).unwrap().unwrap();
        let w = t.parameter(name).unwrap();
        // Along the gradient direction: dL/dε at ε = 0 is ‖g‖².
        let gn: f64 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
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
