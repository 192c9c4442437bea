//! LoRA on the diffusers families the engine runs (PixArt, SD3, Flux, Wan; Sana's own tests
//! cover Sana): the engine's inventory under LoRA is the budget's table (names, shapes, order,
//! roles), a step trains the adapters alone (finite loss, gradients and optimizer state for A and
//! B only, the base unchanged), B starts at zero so the first forward is the base model's, and
//! the `ditmem-cpu` budget predicts the measured step peak of the grids' LoRA specs to 2 %.

use ditmem_budget::{LoraSpec, ParamRole, Precision, Spec};
use ditmem_conformance::agree::{
    flux_grid_base, lora_specs, pixart_grid_base, sd3_grid_base, wan_grid_base,
};
use ditmem_engine::{trainable_count, CountingAlloc, SyntheticData, TrainOptions, Trainer};

mod common;
use common::{agreement_logged, assert_peak_within, max_abs_diff, one_at_a_time};

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

/// Each family's grid base (tiny: 2–3 blocks, hidden 64, batch 4), fp32, no EMA.
fn bases() -> Vec<(&'static str, Spec)> {
    let mut v = vec![
        ("pixart", pixart_grid_base().unwrap()),
        ("sd3", sd3_grid_base().unwrap()),
        ("flux", flux_grid_base().unwrap()),
        ("wan", wan_grid_base().unwrap()),
    ];
    for (_, s) in v.iter_mut() {
        s.recipe.precision = Precision::Fp32;
        s.recipe.ema.enabled = false;
    }
    v
}

fn with_lora(s: &Spec, rank: u32, modules: &[&str]) -> Spec {
    let mut s = s.clone();
    s.recipe.lora = Some(LoraSpec {
        dtype: Default::default(),
        rank,
        targets: ditmem_budget::default_lora_targets(),
        modules: modules.iter().map(|m| m.to_string()).collect(),
    });
    s
}

fn trainer(s: &Spec) -> Trainer {
    Trainer::new(
        s,
        TrainOptions {
            seed: 5,
            lr: 1e-2,
            keep_gradients: true,
            ..TrainOptions::default()
        },
    )
    .unwrap()
}

/// Under LoRA (the family default and a custom list reaching the embedders and the output
/// side) the engine's tensors are the budget's table in its order, by name and shape; the
/// trained ones are exactly the table's trained ones (PEFT's `lora_A` / `lora_B`), and the
/// trained count is `ditmem params`'.
#[test]
fn lora_parameters_are_the_budget_table() {
    let _one = one_at_a_time();
    for (fam, base) in bases() {
        for modules in [&[][..], &["to_q", "to_v", "linear_1", "proj_out"][..]] {
            let s = with_lora(&base, 4, modules);
            let table = ditmem_budget::denoiser::param_table(&s);
            let t = Trainer::new(&s, TrainOptions::default()).unwrap();
            let engine: Vec<(String, Vec<u64>)> = t
                .parameters()
                .unwrap()
                .into_iter()
                .map(|(n, v)| (n, v.dims().iter().map(|&d| d as u64).collect()))
                .collect();
            // Buffers aside (the position tables: the engine keeps them as (tokens, D), the
            // table as diffusers registers them), the engine's tensors are the table's, in its
            // order.
            let param = |n: &str| table.iter().any(|p| p.name == n && !p.buffer);
            let in_table: Vec<(String, Vec<u64>)> =
                engine.iter().filter(|(n, _)| param(n)).cloned().collect();
            let listed: Vec<(String, Vec<u64>)> = table
                .iter()
                .filter(|p| !p.buffer)
                .map(|p| (p.name.clone(), p.shape.clone()))
                .collect();
            assert_eq!(in_table, listed, "{fam} {modules:?}");
            let trained: Vec<String> = table
                .iter()
                .filter(|p| p.role == ParamRole::Trained)
                .map(|p| p.name.clone())
                .collect();
            assert_eq!(t.trained_names(), trained, "{fam} {modules:?}");
            assert!(!trained.is_empty(), "{fam} {modules:?}: nothing adapted");
            assert!(
                trained.iter().all(|n| n.ends_with(".lora_A.default.weight")
                    || n.ends_with(".lora_B.default.weight")),
                "{fam} {modules:?}"
            );
            assert_eq!(
                trainable_count(&s).unwrap(),
                ditmem_budget::count(&table).trained,
                "{fam} {modules:?}"
            );
        }
    }
}

/// SD3's default adapts both streams' projections (the script's `attn.add_*_proj`,
/// `attn.to_add_out`), Flux's the double blocks' feed-forwards and the single blocks' q/k/v.
#[test]
fn lora_defaults_are_the_scripts() {
    let _one = one_at_a_time();
    for (fam, base) in bases() {
        let names = Trainer::new(&with_lora(&base, 4, &[]), TrainOptions::default())
            .unwrap()
            .trained_names();
        let has = |m: &str| names.iter().any(|n| n.contains(m));
        match fam {
            "sd3" => assert!(has(".attn.add_q_proj.lora_A") && has(".attn.to_add_out.lora_B")),
            "flux" => assert!(
                has("single_transformer_blocks.0.attn.to_k.lora_A")
                    && has(".ff_context.net.2.lora_B")
                    && !has(".proj_mlp.lora_A")
            ),
            _ => assert!(has(".attn2.to_out.0.lora_A") && !has(".ff")),
        }
    }
}

/// One step: finite loss; gradients and optimizer state for the adapters alone (every B has a
/// gradient but SD3's last `attn.add_q_proj`'s: the `context_pre_only` block discards the
/// context rows its queries make); the frozen base does not move, B does. Before the step the
/// loss is the full model's on the same weights (B = 0 adds nothing).
#[test]
fn lora_trains_the_adapters_only() {
    let _one = one_at_a_time();
    for (fam, base) in bases() {
        let s = with_lora(&base, 4, &[]);
        let batch = SyntheticData::new(&s, 1).unwrap().step_batch(0);
        let full_loss = trainer(&base).compute_gradients(&batch).unwrap();
        let mut t = trainer(&s);
        let dead = format!("blocks.{}.attn.add_q_proj.", t.dims().depth - 1);
        let live_b = |n: &str| n.contains("lora_B") && !(fam == "sd3" && n.contains(&dead));
        let trained = t.trained_names();
        let base_names: Vec<String> = t
            .parameters()
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| !trained.contains(n))
            .collect();
        let before = t.parameters().unwrap();
        let r = t.step(&batch, None).unwrap();
        assert!(r.loss.is_finite(), "{fam}");
        assert!(
            ((r.loss - full_loss) / full_loss).abs() < 1e-12,
            "{fam}: LoRA's first loss {} vs the base model's {full_loss}",
            r.loss
        );
        let grads = t.gradients().unwrap();
        assert!(!grads.is_empty(), "{fam}");
        for (n, g) in &grads {
            assert!(trained.contains(n), "{fam}: the frozen {n} got a gradient");
            let sq: f64 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
            assert!(sq.is_finite(), "{fam}: {n}");
            if live_b(n) {
                assert!(sq > 0.0, "{fam}: {n} has no gradient");
            }
        }
        let trained_bytes: u64 = before
            .iter()
            .filter(|(n, _)| trained.contains(n))
            .map(|(_, v)| v.elem_count() as u64 * 4)
            .sum();
        assert_eq!(
            t.state_bytes().0,
            2 * trained_bytes,
            "{fam}: AdamW's m and v"
        );
        let after = t.parameters().unwrap();
        for ((n, a), (_, b)) in before.iter().zip(&after) {
            let d = max_abs_diff(a, b);
            if base_names.contains(n) {
                assert_eq!(d, 0.0, "{fam}: the frozen {n} moved");
            } else if live_b(n) {
                assert!(d > 0.0, "{fam}: {n} did not move");
            }
        }
    }
}

/// The `ditmem-cpu` budget predicts the measured step peak of every family's LoRA agreement
/// specs (default modules under bf16-mixed and under fp32 with recompute, a custom list under
/// fp16-mixed) to 2 %.
#[test]
fn lora_budget_agrees_with_the_measured_peak() {
    let _one = one_at_a_time();
    let mut worst: f64 = 0.0;
    for (fam, base) in [
        ("pixart", pixart_grid_base().unwrap()),
        ("sd3", sd3_grid_base().unwrap()),
        ("flux", flux_grid_base().unwrap()),
        ("wan", wan_grid_base().unwrap()),
    ] {
        let specs = lora_specs(fam, &base);
        assert!(specs.len() >= 3);
        for (name, spec) in specs {
            let a = agreement_logged(&name, &spec, &A);
            worst = worst.max(a.rel_error.abs());
            assert_peak_within(&a, 0.02);
        }
    }
    eprintln!("worst {:.3} %", 100.0 * worst);
}

/// `ops::lora_linear` (the frozen base and LoRA's branch as one node) against the composition
/// it replaces, `linear(x) + (x·Aᵀ)·Bᵀ` through candle: values and the gradients of x, A and B,
/// to 1e-12 in f64, 1e-5 in f32 and the dtype's rounding in bf16/f16 (each product rounded
/// once, the sums in another order); an untracked A gets no gradient; a tracked base and
/// factors that do not chain are refused.
#[test]
fn lora_linear_is_the_composition() {
    use candle_core::{DType, Device, Tensor, Var};
    use ditmem_engine::ops::{linear, lora_linear};
    let dev = Device::Cpu;
    let (rows, inp, out, r) = (37, 24, 40, 4);
    let val = |n: usize, seed: usize, scale: f64| -> Vec<f64> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 1009) as f64 / 1009.0 - 0.5) * scale)
            .collect()
    };
    for (dt, tol) in [
        (DType::F64, 1e-12),
        (DType::F32, 1e-5),
        (DType::BF16, 0.06),
        (DType::F16, 0.01),
    ] {
        let t = |v: Vec<f64>, shape: &[usize]| {
            Tensor::from_vec(v, shape, &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap()
        };
        let x = Var::from_tensor(&t(val(rows * inp, 1, 2.0), &[rows, inp])).unwrap();
        let a = Var::from_tensor(&t(val(r * inp, 2, 1.0), &[r, inp])).unwrap();
        let bm = Var::from_tensor(&t(val(out * r, 3, 1.0), &[out, r])).unwrap();
        let w = t(val(out * inp, 4, 0.5), &[out, inp]);
        let b = t(val(out, 5, 0.2), &[out]);
        let go = t(val(rows * out, 6, 1.0), &[rows, out]);
        let y = lora_linear(x.as_tensor(), a.as_tensor(), bm.as_tensor(), (&w, &b), None).unwrap();
        let yr = (linear(x.as_tensor(), &w, &b).unwrap()
            + x.as_tensor()
                .matmul(&a.as_tensor().t().unwrap())
                .unwrap()
                .matmul(&bm.as_tensor().t().unwrap())
                .unwrap())
        .unwrap();
        assert_eq!(y.dtype(), dt);
        let diff = |p: &Tensor, q: &Tensor| max_abs_diff(p, q);
        assert!(diff(&y, &yr) < tol, "{dt:?} y: {}", diff(&y, &yr));
        let loss = |y: &Tensor| {
            y.to_dtype(DType::F64)
                .unwrap()
                .mul(&go.to_dtype(DType::F64).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
        };
        let (g, gr) = (loss(&y).backward().unwrap(), loss(&yr).backward().unwrap());
        for (what, v) in [("x", &x), ("A", &a), ("B", &bm)] {
            let (p, q) = (
                g.get(v.as_tensor()).unwrap(),
                gr.get(v.as_tensor()).unwrap(),
            );
            assert_eq!(p.dtype(), dt);
            // Relative to the gradient's scale (bf16's sums of 40 products).
            let scale = max_abs_diff(q, &q.zeros_like().unwrap()).max(1.0);
            assert!(diff(p, q) < tol * scale, "{dt:?} d{what}: {}", diff(p, q));
        }
        // A frozen A: no gradient for it; dx and dB as before.
        let af = a.as_tensor().detach();
        let y2 = lora_linear(x.as_tensor(), &af, bm.as_tensor(), (&w, &b), None).unwrap();
        let g2 = loss(&y2).backward().unwrap();
        assert!(g2.get(&af).is_none());
        assert_eq!(
            diff(
                g2.get(x.as_tensor()).unwrap(),
                g.get(x.as_tensor()).unwrap()
            ),
            0.0
        );
    }
    let t = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &dev).unwrap();
    let wv = Var::from_tensor(&t(&[out, inp])).unwrap();
    let (x, a, bm, b) = (t(&[rows, inp]), t(&[r, inp]), t(&[out, r]), t(&[out]));
    assert!(lora_linear(&x, &a, &bm, (wv.as_tensor(), &b), None).is_err());
    assert!(lora_linear(&x, &t(&[r, inp + 1]), &bm, (&t(&[out, inp]), &b), None).is_err());
    assert!(lora_linear(&x, &a, &t(&[out, r + 1]), (&t(&[out, inp]), &b), None).is_err());
}
