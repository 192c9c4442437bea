//! Wan 2.1 in the engine: the RMSNorm and RoPE ops against composed references (values and
//! gradients), its parameter count is the budget's (`ditmem params`), a step on video latents
//! trains under every lever, and recompute / attention modes give the same gradients.

use candle_core::{DType, Device, Tensor, Var};
use ditmem_budget::{AttentionMode, Precision, Recompute, Spec};
use ditmem_engine::families::wan::tiny_spec;
use ditmem_engine::ops::rms_norm_rows::rms_norm_rows_reference as rms_norm_reference;
use ditmem_engine::ops::rope_cos_sin::rope_cos_sin_reference as rope_reference;
use ditmem_engine::ops::{rms_norm_rows as rms_norm, rope_cos_sin as rope};
use ditmem_engine::{trainable_count, CountingAlloc, SyntheticData, TrainOptions, Trainer};

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

/// The counting allocator is the whole process's: the tests of this file run one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn spec() -> Spec {
    ditmem_engine::host::resolve(&tiny_spec(2, 2, 5, 7).unwrap())
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut r = ditmem_engine::rng::SplitMix64::new(seed);
    let v: Vec<f64> = (0..n).map(|_| r.normal()).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// RMSNorm with and without a weight: the fused op's value and gradients (x and the weight)
/// equal candle's composed f64 reference; in f32 the value is within rounding.
#[test]
fn rms_norm_matches_its_reference() {
    let _one = one_at_a_time();
    let (rows, d) = (6, 32);
    for with_w in [true, false] {
        let x = Var::from_tensor(&randn(&[2, rows / 2, d], 1)).unwrap();
        let w = Var::from_tensor(&randn(&[d], 2).affine(0.3, 1.0).unwrap()).unwrap();
        let r = randn(&[2, rows / 2, d], 3);
        let wr = with_w.then(|| w.as_tensor());
        let y = rms_norm(x.as_tensor(), wr, 1e-6, DType::F64).unwrap();
        let yr = rms_norm_reference(x.as_tensor(), wr, 1e-6).unwrap();
        assert!(max_diff(&y, &yr) < 1e-12);
        let g = (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let gr = (yr * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let dx = max_diff(
            g.get(x.as_tensor()).unwrap(),
            gr.get(x.as_tensor()).unwrap(),
        );
        assert!(dx < 1e-12, "dx differs by {dx}");
        if with_w {
            let dw = max_diff(
                g.get(w.as_tensor()).unwrap(),
                gr.get(w.as_tensor()).unwrap(),
            );
            assert!(dw < 1e-12, "dw differs by {dw}");
        } else {
            assert!(g.get(w.as_tensor()).is_none());
        }
        let x32 = x.as_tensor().to_dtype(DType::F32).unwrap();
        let w32 = w.as_tensor().to_dtype(DType::F32).unwrap();
        let y32 = rms_norm(&x32, with_w.then_some(&w32), 1e-6, DType::BF16).unwrap();
        assert_eq!(y32.dtype(), DType::BF16);
        assert!(
            max_diff(
                &y32,
                &rms_norm_reference(&x32, with_w.then_some(&w32), 1e-6).unwrap()
            ) < 0.05
        );
    }
    // A weight of the wrong width is an error, not a panic.
    let x = randn(&[3, 8], 4);
    assert!(rms_norm(&x, Some(&randn(&[7], 5)), 1e-6, DType::F64).is_err());
}

/// RoPE on (b, s, D) rows and on (b, s, heads, d_h): the value and dx equal the composed f64
/// reference; the rotation keeps each pair's norm.
#[test]
fn rope_matches_its_reference() {
    let _one = one_at_a_time();
    let (b, s, heads, dh) = (2, 5, 3, 8);
    let ang = randn(&[s, dh / 2], 7);
    let cos = ang.cos().unwrap();
    let sin = ang.sin().unwrap();
    for shape in [vec![b, s, heads * dh], vec![b, s, heads, dh]] {
        let x = Var::from_tensor(&randn(&shape, 8)).unwrap();
        let r = randn(&shape, 9);
        let y = rope(x.as_tensor(), &cos, &sin).unwrap();
        let yr = rope_reference(x.as_tensor(), &cos, &sin).unwrap();
        assert!(max_diff(&y, &yr) < 1e-12);
        let n0: f64 = x
            .as_tensor()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        let n1: f64 = y.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
        assert!((n0 - n1).abs() < 1e-9 * n0);
        let g = (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let gr = (yr * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let dx = max_diff(
            g.get(x.as_tensor()).unwrap(),
            gr.get(x.as_tensor()).unwrap(),
        );
        assert!(dx < 1e-12, "dx differs by {dx}");
    }
    // Tables of the wrong dtype or a position count that does not divide the rows: errors.
    let x = randn(&[b, s, heads * dh], 10);
    assert!(rope(&x, &cos.to_dtype(DType::F32).unwrap(), &sin).is_err());
    assert!(rope(&randn(&[7, heads * dh], 11), &cos, &sin).is_err());
}

/// The engine's parameters are the budget's table, tensor for tensor (names, shapes) and in
/// total (`ditmem params`), the RoPE buffers included.
#[test]
fn wan_parameters_match_the_budget_table() {
    let _one = one_at_a_time();
    for (layers, heads, frames) in [(1, 2, 1), (2, 2, 5), (3, 3, 9)] {
        let s = tiny_spec(layers, heads, frames, 7).unwrap();
        let budget = ditmem_budget::denoiser::param_table(&s);
        let counts = ditmem_budget::count(&budget);
        assert_eq!(
            trainable_count(&s).unwrap(),
            counts.trained,
            "{layers}×{heads}"
        );
        assert_eq!(
            ditmem_engine::param_count(&s).unwrap(),
            counts.total + counts.buffers,
            "{layers}×{heads}: with the RoPE buffers"
        );
        let t = Trainer::new(&s, TrainOptions::default()).unwrap();
        let mut engine: Vec<(String, Vec<u64>)> = t
            .parameters()
            .unwrap()
            .into_iter()
            .map(|(n, v)| (n, v.dims().iter().map(|&d| d as u64).collect()))
            .collect();
        let mut table: Vec<(String, Vec<u64>)> = budget
            .iter()
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect();
        engine.sort();
        table.sort();
        assert_eq!(engine, table);
    }
}

/// One step under each lever on 2 latent frames: finite loss, a gradient for every trained
/// tensor, the weights move; an image (1 frame) and 3 latent frames run too.
#[test]
fn wan_steps_under_every_lever() {
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
    for frames in [1, 9] {
        let mut s = base.clone();
        s.workload.frames = frames;
        variants.push(s);
    }
    for s in variants {
        let what = format!(
            "{} {} {} frames {}",
            s.recipe.precision,
            s.recipe.recompute,
            s.recipe.attention.name(),
            s.workload.frames
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
        let before = t.parameter("blocks.0.attn2.to_k.weight").unwrap();
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
        let after = t.parameter("blocks.0.attn2.to_k.weight").unwrap();
        assert!(
            max_diff(&after, &before) > 0.0,
            "{what}: attn2.to_k did not move"
        );
    }
}

/// Recompute and the attention modes change memory, not results: the gradients of every policy
/// equal those of the stored, materialized step (f64).
#[test]
fn wan_recompute_and_attention_modes_give_the_same_gradients() {
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
        (Recompute::EveryK(2), AttentionMode::MemoryEfficient),
    ] {
        let mut s = base.clone();
        s.recipe.recompute = rc.clone();
        s.recipe.attention = a;
        for ((n, g), (_, r)) in grads(&s).iter().zip(&reference) {
            let d = max_diff(g, r);
            let m: f64 = r.abs().unwrap().max_all().unwrap().to_scalar().unwrap();
            assert!(
                d <= 1e-10 * (1.0 + m),
                "{rc} {}: {n} differs by {d}",
                a.name()
            );
        }
    }
}

/// Every third spec of the Wan agreement grid (`DITMEM_WAN_ALL=1`: all of them).
#[test]
fn budget_predicts_wans_measured_step_peak_within_two_percent() {
    use ditmem_engine::agree::{measure_and_compare, summarize, wan_grid};
    let _one = one_at_a_time();
    let all = std::env::var("DITMEM_WAN_ALL").is_ok();
    let grid = wan_grid().unwrap();
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
