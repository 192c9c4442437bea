//! Sana in the engine: LoRA trains the adapters only. What every family
//! shares (the parameter table, the levers, equal gradients across recompute and attention
//! modes, the agreement grid) is in `families.rs`; `verify` on each family in `verify_families.rs`.

use ditmem_budget::{Precision, Spec};
use ditmem_engine::families::sana::tiny_spec;
use ditmem_engine::{trainable_count, CountingAlloc, SyntheticData, TrainOptions, Trainer};

mod common;
use common::flat_f64;
use common::one_at_a_time;

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

fn spec() -> Spec {
    ditmem_engine::host::resolve(&tiny_spec(2, 4, 13).unwrap())
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
        dtype: Default::default(),
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
    assert_eq!(flat_f64(&after), flat_f64(&before), "the frozen base moved");
}
