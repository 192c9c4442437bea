//! diffusers' DiT (`DiTTransformer2DModel`) in the engine: its parameters are the real class's
//! (the presets at full size, counted from shapes, nothing allocated), and the backward is the
//! forward's derivative (finite differences), block 0's embedder included — the one module the
//! model reads twice (in block 0 and for the output side). What every family shares (the
//! parameter table, the levers, equal gradients across recompute and attention modes, the
//! agreement grid) is in the conformance crate's `families.rs`.

use ditmem_budget::Spec;
use ditmem_engine::families::dit_diffusers::tiny_spec;
use ditmem_engine::{trainable_count, CountingAlloc};

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

mod common;
use common::one_at_a_time;

fn preset(name: &str) -> Spec {
    let text = ditmem_budget::preset_config(name).unwrap();
    let config = match serde_json::from_str(text).unwrap() {
        serde_json::Value::Object(m) => m,
        other => panic!("{name}: {other}"),
    };
    let mut s = ditmem_budget::denoiser::with_family(Spec::small(), name, config).unwrap();
    // The class's position buffer follows sample_size: 256² (32 latent pixels) for XL/2-256.
    s.workload.height = 256;
    s.workload.width = 256;
    s
}

/// `DiTTransformer2DModel` XL/2 has 749,826,464 parameters (diffusers 0.42.1 on the meta
/// device, pinned in the budget's `families_params.rs`); the engine's inventory trains every
/// one of them, and its non-persistent position buffer is not among the trained.
#[test]
fn xl_presets_train_the_diffusers_parameter_count() {
    let _one = one_at_a_time();
    for name in ["dit-xl-2-256", "dit-xl-2-512"] {
        let s = preset(name);
        assert_eq!(trainable_count(&s).unwrap(), 749_826_464, "{name}");
        let budget = ditmem_budget::family_preset(name).unwrap().dims.counts();
        assert_eq!(budget.parameters, budget.trainable, "{name}");
        assert_eq!(trainable_count(&s).unwrap(), budget.trainable, "{name}");
    }
}

/// Central differences of the f64 loss along each named weight's gradient agree with the
/// step's gradient (dL/dε at ε = 0 along g is ‖g‖²) to 1e-5 relative: block 0's embedder (read
/// by block 0 and again for the output side, its gradient summed from both), block 1's own
/// embedder and modulation, attention and feed-forward weights, and the output side.
#[test]
fn gradients_match_finite_differences() {
    let _one = one_at_a_time();
    let s = ditmem_engine::host::resolve(&tiny_spec(2, 2).unwrap());
    common::gradients_match_finite_differences(
        s,
        &[
            "transformer_blocks.0.norm1.emb.timestep_embedder.linear_1.weight",
            "transformer_blocks.0.norm1.emb.timestep_embedder.linear_2.bias",
            "transformer_blocks.0.norm1.emb.class_embedder.embedding_table.weight",
            "transformer_blocks.1.norm1.emb.timestep_embedder.linear_2.weight",
            "transformer_blocks.1.norm1.linear.weight",
            "transformer_blocks.0.attn1.to_q.weight",
            "transformer_blocks.1.ff.net.0.proj.weight",
            "proj_out_1.weight",
            "proj_out_2.bias",
        ],
    );
}

/// `CombinedTimestepLabelEmbeddings.time_proj` is `Timesteps(256, flip_sin_to_cos=True,
/// downscale_freq_shift=1)`: cos then sin, the exponent over F/2 − 1 (diffusers
/// `get_timestep_embedding`), unlike PixArt's and the original DiT's F/2.
#[test]
fn timestep_features_follow_downscale_freq_shift_one() {
    let _one = one_at_a_time();
    use candle_core::{DType, Device};
    let f = ditmem_engine::families::dit_diffusers::label_timestep_features(
        &[0, 500],
        256,
        DType::F64,
        &Device::Cpu,
    )
    .unwrap();
    let v: Vec<Vec<f64>> = f.to_vec2().unwrap();
    // t = 0: cos 1, sin 0 everywhere.
    assert!(v[0][..128].iter().all(|&c| c == 1.0));
    assert!(v[0][128..].iter().all(|&s| s == 0.0));
    // The last frequency is 10000^(−127/127) = 1e-4 with the shift of 1 (1e-4^(127/128) without).
    let want = (500.0f64 * 1e-4).cos();
    assert!((v[1][127] - want).abs() < 1e-15, "{} vs {want}", v[1][127]);
}
