//! SD3 in the engine: its parameter count is the budget's (`ditmem params`), a step trains
//! (finite loss, every trained tensor gets a gradient) under every recipe lever, with and
//! without q/k RMSNorm, and recompute and the attention modes give the same gradients.

use ditmem_budget::{AttentionMode, Precision, Recompute, Spec};
use ditmem_engine::families::sd3::tiny_spec;
use ditmem_engine::{trainable_count, CountingAlloc, SyntheticData, TrainOptions, Trainer};

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

/// The engine's trained parameters are the budget's table, tensor for tensor (names, shapes)
/// and in total (`ditmem params`); the position table is the one buffer.
#[test]
fn sd3_parameters_match_the_budget_table() {
    let _one = one_at_a_time();
    for (layers, heads, qk) in [(1, 2, false), (2, 4, false), (3, 3, true)] {
        let s = tiny_spec(layers, heads, qk, 3, 4).unwrap();
        let budget = ditmem_budget::denoiser::param_table(&s);
        let counts = ditmem_budget::count(&budget);
        assert_eq!(
            trainable_count(&s).unwrap(),
            counts.trained,
            "{layers}×{heads} qk {qk}"
        );
        let t = Trainer::new(&s, TrainOptions::default()).unwrap();
        let mut engine: Vec<(String, Vec<u64>)> = t
            .parameters()
            .unwrap()
            .into_iter()
            .filter(|(n, _)| t.trained_names().contains(n))
            .map(|(n, v)| (n, v.dims().iter().map(|&d| d as u64).collect()))
            .collect();
        let mut table: Vec<(String, Vec<u64>)> = budget
            .iter()
            .filter(|p| p.role == ditmem_budget::ParamRole::Trained)
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect();
        engine.sort();
        table.sort();
        assert_eq!(engine, table);
        // The position table: diffusers' (1, M², D) buffer, held as (M², D).
        let pos = t.parameter("pos_embed.pos_embed").unwrap();
        let row = budget
            .iter()
            .find(|p| p.name == "pos_embed.pos_embed")
            .unwrap();
        assert_eq!(pos.elem_count() as u64, row.numel());
    }
}

/// One step under each lever: finite loss, a gradient for every trained tensor, the weights move.
#[test]
fn sd3_steps_under_every_lever() {
    let _one = one_at_a_time();
    let mut variants: Vec<Spec> = Vec::new();
    for qk in [false, true] {
        let base = spec(qk);
        for p in [
            Precision::Fp32,
            Precision::Bf16Mixed,
            Precision::Fp16Mixed,
            Precision::Bf16Pure,
            Precision::Fp64,
        ] {
            let mut s = base.clone();
            s.recipe.precision = p;
            variants.push(s);
        }
        for (rc, a) in [
            (Recompute::All, AttentionMode::MemoryEfficient),
            (Recompute::EveryK(2), AttentionMode::Materialized),
            (Recompute::AttentionOnly, AttentionMode::Materialized),
            (Recompute::Blocks(vec![2]), AttentionMode::MemoryEfficient),
        ] {
            let mut s = base.clone();
            s.recipe.recompute = rc;
            s.recipe.attention = a;
            variants.push(s);
        }
        let mut s = base.clone();
        s.workload.microbatch = 2;
        s.workload.accumulation = 2;
        s.recipe.optimizer = ditmem_budget::Optimizer::Sgd;
        s.recipe.ema.enabled = true;
        variants.push(s);
    }
    // The output projection: its gradient is large enough for SGD's lr·g to move f32 weights
    // (the small modulation weights keep the blocks' gradients small in a first step).
    let watched = "proj_out.weight";
    for s in variants {
        let what = format!(
            "{} {} {} qk {:?}",
            s.recipe.precision,
            s.recipe.recompute,
            s.recipe.attention.name(),
            s.model
                .diffusers
                .as_ref()
                .and_then(|m| m.get("qk_norm").cloned())
        );
        let mut t = Trainer::new(
            &s,
            TrainOptions {
                seed: 3,
                keep_gradients: true,
                ..TrainOptions::default()
            },
        )
        .unwrap();
        let before = t.parameter(watched).unwrap();
        let batch = SyntheticData::new(&s, 1).unwrap().step_batch(0);
        let r = t.step(&batch, None).unwrap();
        assert!(
            r.loss.is_finite() && r.loss > 0.1,
            "{what}: loss {}",
            r.loss
        );
        let names = t.trained_names();
        let grads = t.gradients().unwrap();
        assert_eq!(grads.len(), names.len(), "{what}");
        for (n, g) in &grads {
            let sq: f64 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
            // The last block is `context_pre_only`: its context queries' outputs are dropped
            // (no `to_add_out`), so their projection and norm get exactly zero.
            if n.starts_with("transformer_blocks.2.attn.add_q_proj.")
                || n.starts_with("transformer_blocks.2.attn.norm_added_q.")
            {
                assert_eq!(sq, 0.0, "{what}: {n}");
            } else {
                assert!(sq.is_finite() && sq > 0.0, "{what}: {n} has gradient² {sq}");
            }
        }
        let after = t.parameter(watched).unwrap();
        let moved: f64 = (after.to_dtype(candle_core::DType::F64).unwrap()
            - before.to_dtype(candle_core::DType::F64).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar()
        .unwrap();
        assert!(moved > 0.0, "{what}: the output projection did not move");
    }
}

/// Recompute and the attention modes change memory, not results: the gradients of every policy
/// equal those of the stored, materialized step (f64).
#[test]
fn sd3_recompute_and_attention_modes_give_the_same_gradients() {
    let _one = one_at_a_time();
    for qk in [false, true] {
        let mut base = spec(qk);
        base.recipe.precision = Precision::Fp64;
        let batch = SyntheticData::new(&base, 5).unwrap().step_batch(0);
        let grads = |s: &Spec| {
            let mut t = Trainer::new(
                s,
                TrainOptions {
                    seed: 9,
                    keep_gradients: true,
                    ..TrainOptions::default()
                },
            )
            .unwrap();
            t.compute_gradients(&batch).unwrap();
            t.gradients().unwrap()
        };
        let reference = grads(&base);
        for (rc, a) in [
            (Recompute::All, AttentionMode::Materialized),
            (Recompute::AttentionOnly, AttentionMode::Materialized),
            (Recompute::None, AttentionMode::MemoryEfficient),
            (
                Recompute::Blocks(vec![0, 2]),
                AttentionMode::MemoryEfficient,
            ),
        ] {
            let mut s = base.clone();
            s.recipe.recompute = rc.clone();
            s.recipe.attention = a;
            let g = grads(&s);
            assert_eq!(g.len(), reference.len());
            for ((n, g), (_, r)) in g.iter().zip(&reference) {
                let d: f64 = (g - r)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar()
                    .unwrap();
                let m: f64 = r.abs().unwrap().max_all().unwrap().to_scalar().unwrap();
                assert!(
                    d <= 1e-10 * (1.0 + m),
                    "qk {qk} {rc} {}: {n} differs by {d}",
                    a.name()
                );
            }
        }
    }
}

/// Every other spec of the SD3 agreement grid (`DITMEM_SD3_ALL=1`: all of them) to 2 %.
#[test]
fn budget_predicts_sd3s_measured_step_peak_within_two_percent() {
    use ditmem_engine::agree::{measure_and_compare, sd3_grid, summarize};
    let _one = one_at_a_time();
    let all = std::env::var("DITMEM_SD3_ALL").is_ok();
    let grid = sd3_grid().unwrap();
    let n = grid.len();
    let mut results = Vec::new();
    for (name, spec) in grid.into_iter().step_by(if all { 1 } else { 2 }) {
        let (a, _, _) = measure_and_compare(&name, &spec, 1, &A).expect("the grid spec runs");
        eprintln!(
            "{name}: predicted {} measured {} ({:+.3} %) [{}]",
            a.predicted_peak_bytes,
            a.measured_peak_bytes,
            100.0 * a.rel_error,
            a.predicted_peak_label
        );
        results.push(a);
    }
    for a in &results {
        assert!(
            a.rel_error.abs() <= 0.02,
            "{}: predicted {} vs measured {} ({:+.3} %)",
            a.name,
            a.predicted_peak_bytes,
            a.measured_peak_bytes,
            100.0 * a.rel_error
        );
    }
    let s = summarize(&results);
    assert!(n >= 10 && s.specs >= 5);
    eprintln!(
        "{} specs: max {:.3} % ({}), median {:.3} %",
        s.specs,
        100.0 * s.max_abs_rel_error,
        s.worst,
        100.0 * s.median_abs_rel_error
    );
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
