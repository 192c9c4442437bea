//! Parameter inventory: counts of the DiT presets (from shapes, nothing allocated) and names.

use ditmem_budget::{LoraSpec, Spec};
use ditmem_engine::{param_count, param_shapes, trainable_count};

fn preset(name: &str) -> Spec {
    let mut s = Spec::default_xl();
    s.model = ditmem_budget::ModelSpec::preset(name).unwrap();
    s
}

#[test]
fn preset_counts_match_dit() {
    for (name, want, trainable) in [
        ("dit-s-2", 32_963_360u64, 32_865_056u64),
        ("dit-b-2", 130_512_416, 130_315_808),
        ("dit-l-2", 458_102_816, 457_840_672),
        ("dit-xl-2", 675_129_632, 674_834_720),
        ("dit-xl-4", 675_074_432, 0),
        ("dit-xl-8", 675_683_072, 0),
    ] {
        let s = preset(name);
        assert_eq!(param_count(&s).unwrap(), want, "{name}");
        if trainable > 0 {
            assert_eq!(trainable_count(&s).unwrap(), trainable, "{name}");
        }
    }
}

#[test]
fn names_follow_the_pytorch_reference() {
    let s = preset("dit-s-2");
    let names: Vec<String> = param_shapes(&s)
        .unwrap()
        .into_iter()
        .map(|p| p.name)
        .collect();
    for n in [
        "x_embedder.proj.weight",
        "pos_embed",
        "t_embedder.mlp.0.weight",
        "t_embedder.mlp.2.bias",
        "y_embedder.embedding_table.weight",
        "blocks.0.attn.qkv.weight",
        "blocks.11.attn.proj.bias",
        "blocks.3.mlp.fc1.weight",
        "blocks.3.mlp.fc2.bias",
        "blocks.5.adaLN_modulation.1.weight",
        "final_layer.linear.weight",
        "final_layer.adaLN_modulation.1.bias",
    ] {
        assert!(names.iter().any(|x| x == n), "missing {n}");
    }
    let shapes = param_shapes(&s).unwrap();
    let xw = shapes
        .iter()
        .find(|p| p.name == "x_embedder.proj.weight")
        .unwrap();
    assert_eq!(xw.shape, vec![384, 16]);
}

#[test]
fn lora_adds_adapters_and_freezes_the_base() {
    let mut s = preset("dit-s-2");
    s.recipe.lora = Some(LoraSpec {
        dtype: Default::default(),
        rank: 8,
        targets: ditmem_budget::default_lora_targets(),
        modules: Vec::new(),
    });
    let shapes = param_shapes(&s).unwrap();
    let a = shapes
        .iter()
        .find(|p| p.name == "blocks.0.attn.qkv.lora_a")
        .unwrap();
    let b = shapes
        .iter()
        .find(|p| p.name == "blocks.0.attn.qkv.lora_b")
        .unwrap();
    assert_eq!(a.shape, vec![8, 384]);
    assert_eq!(b.shape, vec![1152, 8]);
    assert!(a.trainable && b.trainable);
    // Per block: r·(in+out) for qkv, proj, fc1, fc2.
    let per_block = 8 * ((384 + 1152) + (384 + 384) + (384 + 1536) + (1536 + 384));
    assert_eq!(trainable_count(&s).unwrap(), 12 * per_block as u64);
    assert!(shapes
        .iter()
        .filter(|p| !p.name.contains("lora"))
        .all(|p| !p.trainable));
}
