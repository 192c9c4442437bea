//! Training behaviour on a tiny DiT: every precision learns, fp16 overflow handling, gradient
//! accumulation, store vs recompute, attention modes, LoRA, EMA and typed errors.

mod common;

use common::*;
use ditmem_budget::{AttentionMode, LoraSpec, Optimizer, Precision, Prediction, Recompute};
use ditmem_engine::{EngineError, TrainOptions, Trainer};

#[test]
fn every_precision_lowers_the_loss() {
    for p in Precision::ALL {
        let spec = tiny(p);
        let b = batch(&spec, 7);
        let mut t = trainer(&spec, false);
        let mut losses = Vec::new();
        for _ in 0..20 {
            let r = t.step(&b, None).unwrap();
            assert!(r.loss.is_finite(), "{p}: loss {}", r.loss);
            losses.push(r.loss);
        }
        let first = losses[0];
        let last = losses[losses.len() - 1];
        assert!(
            last < 0.9 * first,
            "{p}: loss {first} → {last} ({losses:?})"
        );
    }
}

#[test]
fn fp16_scaler_skips_an_injected_overflow_without_touching_weights() {
    let spec = tiny(Precision::Fp16Mixed);
    let b = batch(&spec, 3);
    let mut t = trainer(&spec, false);
    assert_eq!(t.loss_scale(), Some(65536.0));
    let r = t.step(&b, None).unwrap();
    assert!(!r.skipped, "a normal step must not be skipped");
    let before = t.parameters().unwrap();
    t.set_loss_scale(2f64.powi(60)).unwrap();
    let r = t.step(&b, None).unwrap();
    assert!(r.skipped, "an overflowing step must be skipped");
    assert!(!r.grad_norm.is_finite());
    assert_eq!(t.loss_scale(), Some(2f64.powi(59)));
    for ((n, a), (_, b)) in before.iter().zip(t.parameters().unwrap()) {
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a, b, "{n} changed during a skipped step");
    }
    assert_eq!(t.steps(), 1);
    // And it recovers: keep halving until a step goes through.
    let mut ok = false;
    for _ in 0..60 {
        if !t.step(&b, None).unwrap().skipped {
            ok = true;
            break;
        }
    }
    assert!(ok, "the scaler never recovered");
}

#[test]
fn accumulated_microbatches_equal_one_batch_fp64() {
    let one = tiny(Precision::Fp64);
    let mut acc = one.clone();
    acc.workload.microbatch = 1;
    acc.workload.accumulation = 4;
    let b = batch(&one, 5);
    let (l1, g1) = grads(&one, &b);
    let (l2, g2) = grads(&acc, &b);
    assert!((l1 - l2).abs() <= 1e-12 * l1.abs(), "{l1} vs {l2}");
    let d = max_rel_diff(&g2, &g1);
    assert!(d < 1e-10, "relative difference {d}");
    assert!(!g1.is_empty());
}

#[test]
fn stored_and_recomputed_blocks_give_identical_gradients() {
    for dropout in [0.0, 0.2] {
        let mut none = tiny(Precision::Fp32);
        none.model.attn_dropout = dropout;
        none.model.mlp_dropout = dropout;
        let b = batch(&none, 9);
        let (l0, g0) = grads(&none, &b);
        for r in [
            Recompute::All,
            Recompute::EveryK(2),
            Recompute::Blocks(vec![1]),
        ] {
            let mut s = none.clone();
            s.recipe.recompute = r.clone();
            let (l, g) = grads(&s, &b);
            assert_eq!(l, l0, "{r} dropout {dropout}: loss differs");
            assert_eq!(
                max_rel_diff(&g, &g0),
                0.0,
                "{r} dropout {dropout}: gradients differ"
            );
        }
    }
}

#[test]
fn attention_only_recompute_matches_stored_attention() {
    for dropout in [0.0, 0.25] {
        let mut none = tiny(Precision::Fp64);
        none.model.attn_dropout = dropout;
        let b = batch(&none, 4);
        let (l0, g0) = grads(&none, &b);
        let mut s = none.clone();
        s.recipe.recompute = Recompute::AttentionOnly;
        let (l, g) = grads(&s, &b);
        assert_eq!(l, l0);
        let d = max_rel_diff(&g, &g0);
        assert!(d < 1e-13, "dropout {dropout}: {d}");
    }
}

#[test]
fn memory_efficient_attention_matches_materialized_fp64() {
    let mat = tiny(Precision::Fp64);
    let mut mea = mat.clone();
    mea.recipe.attention = AttentionMode::MemoryEfficient;
    let b = batch(&mat, 11);
    let (l0, g0) = grads(&mat, &b);
    let (l1, g1) = grads(&mea, &b);
    assert!((l0 - l1).abs() < 1e-12 * l0.abs());
    let d = max_rel_diff(&g1, &g0);
    assert!(d < 1e-10, "{d}");
    // The mixed policies run too.
    for p in [Precision::Bf16Mixed, Precision::Fp32] {
        let mut s = tiny(p);
        s.recipe.attention = AttentionMode::MemoryEfficient;
        let mut t = trainer(&s, false);
        assert!(t.step(&b, None).unwrap().loss.is_finite());
    }
}

#[test]
fn identical_initial_weights_across_precisions() {
    let a = trainer(&tiny(Precision::Fp64), false);
    let b = trainer(&tiny(Precision::Fp32), false);
    for ((na, ta), (nb, tb)) in a.parameters().unwrap().iter().zip(b.parameters().unwrap()) {
        assert_eq!(na, &nb);
        let x = flat_f64(&ta.to_dtype(candle_core::DType::F32).unwrap());
        let y = flat_f64(&tb);
        assert_eq!(x, y, "{na}");
    }
}

#[test]
fn fp32_gradients_agree_with_fp64_reference() {
    let b = batch(&tiny(Precision::Fp64), 2);
    let (l64, g64) = grads(&tiny(Precision::Fp64), &b);
    let (l32, g32) = grads(&tiny(Precision::Fp32), &b);
    assert!((l64 - l32).abs() < 1e-5 * l64.abs());
    let d = max_rel_diff(&g32, &g64);
    assert!(d < 1e-3, "{d}");
    let (_, gbf) = grads(&tiny(Precision::Bf16Mixed), &b);
    let d = max_rel_diff(&gbf, &g64);
    assert!(d < 0.2, "bf16-mixed {d}");
}

#[test]
fn lora_trains_only_the_adapters() {
    let mut s = tiny(Precision::Bf16Mixed);
    s.recipe.lora = Some(LoraSpec {
        dtype: Default::default(),
        rank: 4,
        targets: ditmem_budget::default_lora_targets(),
        modules: Vec::new(),
    });
    let b = batch(&s, 1);
    let mut t = trainer(&s, true);
    let names = t.trained_names();
    assert!(names
        .iter()
        .all(|n| n.ends_with("lora_a") || n.ends_with("lora_b")));
    assert_eq!(names.len(), 2 * 4 * 2);
    let base_before = t.parameter("blocks.0.attn.qkv.weight").unwrap();
    let b_before = t.parameter("blocks.0.attn.qkv.lora_b").unwrap();
    let mut first = None;
    for _ in 0..10 {
        let r = t.step(&b, None).unwrap();
        first.get_or_insert(r.loss);
        assert!(r.loss.is_finite());
    }
    let base_after = t.parameter("blocks.0.attn.qkv.weight").unwrap();
    let diff = |a: &candle_core::Tensor, b: &candle_core::Tensor| -> f64 {
        (a.to_dtype(candle_core::DType::F64).unwrap()
            - b.to_dtype(candle_core::DType::F64).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
    };
    assert_eq!(diff(&base_before, &base_after), 0.0);
    assert!(diff(&b_before, &t.parameter("blocks.0.attn.qkv.lora_b").unwrap()) > 0.0);
}

#[test]
fn ema_follows_the_weights() {
    let mut s = tiny(Precision::Fp32);
    s.recipe.ema.enabled = true;
    s.recipe.ema.decay = 0.5;
    let b = batch(&s, 1);
    let mut t = trainer(&s, false);
    let w0 = t.parameter("blocks.0.mlp.fc1.weight").unwrap();
    t.step(&b, None).unwrap();
    let w1 = t.parameter("blocks.0.mlp.fc1.weight").unwrap();
    let ema = t.ema_parameters().unwrap();
    let e = &ema
        .iter()
        .find(|(n, _)| n == "blocks.0.mlp.fc1.weight")
        .unwrap()
        .1;
    let want = ((w0 * 0.5).unwrap() + (w1 * 0.5).unwrap()).unwrap();
    let d: f32 = (e - want)
        .unwrap()
        .abs()
        .unwrap()
        .max_keepdim(0)
        .unwrap()
        .max(1)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_scalar()
        .unwrap();
    assert!(d < 1e-7, "{d}");
    assert!(t.state_bytes().1 > 0);
}

#[test]
fn v_prediction_and_sgd_run() {
    let mut s = tiny(Precision::Fp32);
    s.recipe.prediction = Prediction::V;
    s.recipe.optimizer = Optimizer::Sgd;
    let b = batch(&s, 1);
    let mut t = trainer(&s, false);
    let l0 = t.step(&b, None).unwrap().loss;
    let mut l = l0;
    for _ in 0..10 {
        l = t.step(&b, None).unwrap().loss;
    }
    assert!(l < l0, "{l0} → {l}");
    assert_eq!(t.state_bytes().0, 0);
}

#[test]
fn bad_input_gives_typed_errors() {
    let mut s = tiny(Precision::Fp32);
    s.recipe.optimizer = Optimizer::AdamW8bit;
    assert!(matches!(
        Trainer::new(&s, TrainOptions::default()),
        Err(EngineError::Unsupported { .. })
    ));
    let mut s = tiny(Precision::Fp32);
    s.model.depth = 0;
    assert!(matches!(
        Trainer::new(&s, TrainOptions::default()),
        Err(EngineError::Spec(_))
    ));
    let s = tiny(Precision::Fp32);
    let mut t = trainer(&s, false);
    let mut b = batch(&s, 1);
    b.labels[0] = 99;
    assert!(matches!(
        t.step(&b, None),
        Err(EngineError::BadInput { .. })
    ));
    let b = b.slice(0, 2).unwrap();
    assert!(matches!(
        t.step(&b, None),
        Err(EngineError::BadInput { .. })
    ));
    assert!(t.set_loss_scale(2.0).is_err());
}

#[test]
fn latent_directory_and_interrupted_run() {
    let s = tiny(Precision::Fp32);
    let dir = std::env::temp_dir().join(format!("ditmem-latents-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = ditmem_engine::SyntheticData::new(&s, 1).unwrap();
    let lat = candle_core::Tensor::ones(
        (5, 4, 16, 16),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    candle_core::safetensors::save(
        &std::collections::HashMap::from([("latents".to_string(), lat)]),
        dir.join("a.safetensors"),
    )
    .unwrap();
    let b = ditmem_engine::load_latent_dir(&dir, &data).unwrap();
    assert_eq!(b.n, 5);
    assert!(b.latents.iter().all(|&x| x == 1.0));
    let opts = ditmem_engine::RunOptions {
        warmup: 0,
        steps: 3,
        latents_dir: Some(dir.clone()),
        ..Default::default()
    };
    let mut calls = 0;
    let r = ditmem_engine::run(&s, &opts, None, &mut |_| {
        calls += 1;
        calls < 2
    });
    assert!(matches!(
        r,
        Err(EngineError::Interrupted { after_steps: 2 })
    ));
    let m = ditmem_engine::run(&s, &opts, None, &mut |_| true).unwrap();
    assert_eq!(m.losses.len(), 3);
    std::fs::write(dir.join("b.npy"), b"not a npy file").unwrap();
    assert!(matches!(
        ditmem_engine::load_latent_dir(&dir, &data),
        Err(EngineError::Data { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
    let mut acc = s.clone();
    acc.workload.microbatch = 2;
    acc.workload.accumulation = 2;
    let b = batch(&acc, 1);
    let mut t = trainer(&acc, false);
    let r = t.step(&b, Some(&NoProbe)).unwrap();
    assert!(r
        .timeline
        .iter()
        .any(|p| p.label == "microbatch 1: block 0"));
}

/// A probe without an allocator: live bytes are always 1.
struct NoProbe;
impl ditmem_engine::MemoryProbe for NoProbe {
    fn live(&self) -> u64 {
        1
    }
    fn peak(&self) -> u64 {
        1
    }
    fn reset_peak(&self) {}
}
