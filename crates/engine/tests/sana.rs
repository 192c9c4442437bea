//! Sana in the engine: its parameter count is the budget's (`ditmem params`), a step trains
//! (finite loss, every trained tensor gets a gradient), the recipe levers run, `verify` passes,
//! and the `ditmem-cpu` budget predicts its measured step peak (a subset of the agreement grid,
//! each spec to 2 %).

use ditmem_budget::{AttentionMode, Precision, Recompute, Spec};
use ditmem_engine::agree::{measure_and_compare, sana_grid, summarize};
use ditmem_engine::families::sana::tiny_spec;
use ditmem_engine::{trainable_count, CountingAlloc, SyntheticData, TrainOptions, Trainer};

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

/// The counting allocator is the whole process's: the tests of this file run one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn spec() -> Spec {
    ditmem_engine::host::resolve(&tiny_spec(2, 4, 13).unwrap())
}

/// The engine's trained parameters are the budget's table, tensor for tensor (names, shapes)
/// and in total (`ditmem params`).
#[test]
fn sana_parameters_match_the_budget_table() {
    let _one = one_at_a_time();
    for (layers, heads) in [(1, 2), (2, 4), (3, 6)] {
        let s = tiny_spec(layers, heads, 7).unwrap();
        let budget = ditmem_budget::denoiser::param_table(&s);
        let counts = ditmem_budget::count(&budget);
        assert_eq!(
            trainable_count(&s).unwrap(),
            counts.trained,
            "{layers}×{heads}"
        );
        assert_eq!(counts.total, counts.trained, "Sana trains every parameter");
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
    }
}

/// LoRA on the scripts' default targets: the base is frozen, the adapters are the budget's
/// (names and shapes), a step trains them (B from zero, so only B has a gradient at step 1)
/// and leaves the base as it was.
#[test]
fn sana_lora_trains_the_adapters_only() {
    let _one = one_at_a_time();
    let mut s = spec();
    s.recipe.precision = Precision::Bf16Mixed;
    s.recipe.lora = Some(ditmem_budget::LoraSpec {
        rank: 4,
        targets: ditmem_budget::default_lora_targets(),
        modules: Vec::new(),
    });
    let budget = ditmem_budget::denoiser::param_table(&s);
    let mut table: Vec<String> = budget
        .iter()
        .filter(|p| p.role == ditmem_budget::ParamRole::Trained)
        .map(|p| p.name.clone())
        .collect();
    let mut t = Trainer::new(
        &s,
        TrainOptions {
            seed: 3,
            keep_gradients: true,
            ..TrainOptions::default()
        },
    )
    .unwrap();
    let mut trained = t.trained_names();
    trained.sort();
    table.sort();
    assert_eq!(trained, table);
    assert_eq!(
        trainable_count(&s).unwrap(),
        ditmem_budget::count(&budget).trained
    );
    // 2 blocks × 2 attentions × 4 projections × (A, B).
    assert_eq!(trained.len(), 32);
    let base = "transformer_blocks.0.attn1.to_q.weight";
    let before = t.parameter(base).unwrap();
    let batch = SyntheticData::new(&s, 1).unwrap().step_batch(0);
    let r = t.step(&batch, None).unwrap();
    assert!(r.loss.is_finite());
    for (n, g) in t.gradients().unwrap() {
        let sq: f64 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
        if n.contains("lora_B") {
            assert!(sq.is_finite() && sq > 0.0, "{n} has gradient² {sq}");
        }
    }
    let after = t.parameter(base).unwrap();
    let moved: f64 = (after.to_dtype(candle_core::DType::F64).unwrap()
        - before.to_dtype(candle_core::DType::F64).unwrap())
    .unwrap()
    .abs()
    .unwrap()
    .sum_all()
    .unwrap()
    .to_scalar()
    .unwrap();
    assert_eq!(moved, 0.0, "the frozen base moved");
}

/// One step under each lever: finite loss, a gradient for every trained tensor, the weights move.
#[test]
fn sana_steps_under_every_lever() {
    let _one = one_at_a_time();
    let base = spec();
    let mut variants: Vec<Spec> = Vec::new();
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
        (Recompute::Blocks(vec![1]), AttentionMode::MemoryEfficient),
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
    for s in variants {
        let what = format!(
            "{} {} {}",
            s.recipe.precision,
            s.recipe.recompute,
            s.recipe.attention.name()
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
        let before = t
            .parameter("transformer_blocks.0.attn1.to_k.weight")
            .unwrap();
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
            assert!(sq.is_finite() && sq > 0.0, "{what}: {n} has gradient² {sq}");
        }
        let after = t
            .parameter("transformer_blocks.0.attn1.to_k.weight")
            .unwrap();
        let moved: f64 = (after.to_dtype(candle_core::DType::F64).unwrap()
            - before.to_dtype(candle_core::DType::F64).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar()
        .unwrap();
        assert!(
            moved > 0.0,
            "{what}: the linear attention's weights did not move"
        );
    }
}

/// Recompute and the attention modes change memory, not results: the gradients of every policy
/// equal those of the stored, materialized step (f64).
#[test]
fn sana_recompute_and_attention_modes_give_the_same_gradients() {
    let _one = one_at_a_time();
    let mut base = spec();
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
    ] {
        let mut s = base.clone();
        s.recipe.recompute = rc.clone();
        s.recipe.attention = a;
        for ((n, g), (_, r)) in grads(&s).iter().zip(&reference) {
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
                "{rc} {}: {n} differs by {d}",
                a.name()
            );
        }
    }
}

/// Every third spec of the Sana agreement grid (`DITMEM_SANA_ALL=1`: all of them).
#[test]
fn budget_predicts_sanas_measured_step_peak_within_two_percent() {
    let _one = one_at_a_time();
    let all = std::env::var("DITMEM_SANA_ALL").is_ok();
    let grid = sana_grid().unwrap();
    let n = grid.len();
    let mut results = Vec::new();
    for (name, spec) in grid.into_iter().step_by(if all { 1 } else { 3 }) {
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
    assert!(n >= 10 && s.specs >= 4);
    eprintln!(
        "{} specs: max {:.3} % ({}), median {:.3} %",
        s.specs,
        100.0 * s.max_abs_rel_error,
        s.worst,
        100.0 * s.median_abs_rel_error
    );
}
