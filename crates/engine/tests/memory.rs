//! Measured peaks with the counting allocator. One test function only: the allocator is global,
//! so nothing else may run in this binary at the same time.

mod common;

use common::*;
use ditmem_budget::{AttentionMode, Precision, Recompute, Spec};
use ditmem_engine::{run, CountingAlloc, Phase, RunOptions, TrainOptions, Trainer};

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

fn peak(spec: &Spec) -> (u64, ditmem_engine::Measurement) {
    let m = run(
        spec,
        &RunOptions {
            warmup: 1,
            steps: 2,
            ..RunOptions::default()
        },
        Some(&A),
        &mut |_| true,
    )
    .unwrap();
    (m.peak_bytes, m)
}

#[test]
fn recompute_and_attention_modes_lower_the_measured_peak() {
    // A deeper, longer-sequence variant of the tiny model so activations dominate.
    let mut base = tiny(Precision::Fp32);
    base.model.depth = 4;
    base.workload.height = 256;
    base.workload.width = 256; // 32×32 latents, 256 tokens
    base.workload.batch = 2;
    base.workload.microbatch = 2;
    base.validate().unwrap();

    let (p_none, m_none) = peak(&base);
    let mut all = base.clone();
    all.recipe.recompute = Recompute::All;
    let (p_all, _) = peak(&all);
    let mut attn = base.clone();
    attn.recipe.recompute = Recompute::AttentionOnly;
    let (p_attn, _) = peak(&attn);
    let mut mea = base.clone();
    mea.recipe.attention = AttentionMode::MemoryEfficient;
    let (p_mea, _) = peak(&mea);
    eprintln!(
        "peaks: none {p_none}, all {p_all}, attention-only {p_attn}, memory-efficient {p_mea}"
    );
    assert!(p_all < p_none, "recompute all {p_all} ≥ none {p_none}");
    assert!(p_attn < p_none, "attention-only {p_attn} ≥ none {p_none}");
    assert!(
        p_mea < p_none,
        "memory-efficient {p_mea} ≥ materialized {p_none}"
    );

    // The timeline has one point per segment and phase, and forward grows while backward shrinks.
    let tl = &m_none.timeline;
    let fwd: Vec<u64> = tl
        .iter()
        .filter(|p| p.phase == Phase::Forward)
        .map(|p| p.live_bytes)
        .collect();
    let bwd: Vec<u64> = tl
        .iter()
        .filter(|p| p.phase == Phase::Backward)
        .map(|p| p.live_bytes)
        .collect();
    assert_eq!(fwd.len(), 1 + 4 + 1);
    assert_eq!(bwd.len(), 1 + 4 + 1);
    assert!(
        fwd.windows(2).all(|w| w[1] > w[0]),
        "forward live bytes must grow: {fwd:?}"
    );
    assert!(
        bwd[1..].windows(2).all(|w| w[1] < w[0]),
        "backward live bytes must shrink: {bwd:?}"
    );
    assert!(m_none.phase_peak_bytes.forward > 0 && m_none.phase_peak_bytes.optimizer > 0);

    // The measured peak repeats: to the byte between two runs in a row; within 4 KiB of the
    // first run (lazily created process state such as thread pools differs before it).
    let (again, _) = peak(&base);
    let (third, _) = peak(&base);
    eprintln!("repeat: {p_none} {again} {third}");
    assert_eq!(third, again);
    assert!(again.abs_diff(p_none) < 4096);

    // Accounting sanity: weights + grads + AdamW m, v are all resident during the optimizer.
    let t = Trainer::new(&base, TrainOptions::default()).unwrap();
    let n = ditmem_engine::trainable_count(&base).unwrap();
    drop(t);
    assert!(
        m_none.phase_peak_bytes.optimizer >= 4 * 4 * n,
        "optimizer peak too small"
    );
    let _ = A.live();
}
