//! Flux in the engine: what it does not run is refused by name. What
//! every family shares (the parameter table, the levers, equal gradients across recompute and
//! attention modes, the agreement grid) is in `families.rs`; `verify` on each family in `verify_families.rs`.

use ditmem_engine::families::flux::tiny_spec;
use ditmem_engine::{CountingAlloc, TrainOptions, Trainer};

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

mod common;
use common::one_at_a_time;

/// What the engine does not run is refused by name: a Flux without single-stream blocks.
#[test]
fn flux_refuses_a_model_without_single_stream_blocks() {
    let _one = one_at_a_time();
    let mut s = tiny_spec(1, 1, 2, 5, false).unwrap();
    s.model
        .diffusers
        .as_mut()
        .unwrap()
        .insert("num_single_layers".into(), 0.into());
    let s = ditmem_budget::denoiser::with_family(
        s.clone(),
        "flux-tiny",
        s.model.diffusers.clone().unwrap(),
    )
    .unwrap();
    let e = Trainer::new(&s, TrainOptions::default())
        .err()
        .expect("refused");
    assert!(e.to_string().contains("num_single_layers"), "{e}");
}
