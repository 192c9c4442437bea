//! The families' parameter tables against diffusers' own classes.
//!
//! `data/diffusers_params.json` is the output of the PyTorch peer, which builds every preset's
//! diffusers class from its config on the meta device (diffusers 0.42.1, torch 2.15.0):
//!
//! ```sh
//! bench/torch_peer/setup_diffusers.sh
//! bench/torch_peer/.venv/bin/python bench/torch_peer/count_params.py \
//!     --out crates/budget/tests/data/diffusers_params.json --configs /tmp/ditmem-configs
//! for d in /tmp/ditmem-configs/*/; do
//!     cp "$d/config.json" "crates/budget/tests/data/saved_configs/$(basename "$d").json"; done
//! ```
//!
//! For every preset (and seven small variants covering the options no preset uses) the test holds
//! the total parameters (`sum(p.numel() for p in model.parameters())`), the buffers
//! (`model.buffers()`), and every tensor's name, shape and kind (parameter, persistent or
//! non-persistent buffer) against the peer's; `data/saved_configs/` holds the config.json files
//! the peer wrote with `save_config`, which the reader must accept and read to the same model.

use std::collections::BTreeMap;

use ditmem_budget::{
    family_preset, family_preset_names, from_config_json, preset_config, Dims, FamilyModel,
    TensorKind,
};
use serde_json::Value;

const PEER: &str = include_str!("data/diffusers_params.json");

fn peer() -> Value {
    serde_json::from_str(PEER).expect("the peer's JSON")
}

/// "0-12,15" → [0, …, 12, 15].
fn indices(text: &str) -> Vec<u64> {
    let mut v = Vec::new();
    for part in text.split(',') {
        match part.split_once('-') {
            Some((a, b)) => v.extend(a.parse::<u64>().unwrap()..=b.parse::<u64>().unwrap()),
            None => v.push(part.parse().unwrap()),
        }
    }
    v
}

/// The peer's table of one model, expanded: name → (shape, kind).
fn peer_table(entry: &Value) -> BTreeMap<String, (Vec<u64>, String)> {
    let mut m = BTreeMap::new();
    for row in entry["tensors"].as_array().unwrap() {
        let template = row[0].as_str().unwrap();
        let shape: Vec<u64> = row[1]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let kind = row[2].as_str().unwrap().to_string();
        match row[3].as_str() {
            Some(ix) => {
                for i in indices(ix) {
                    let name = template.replace("{i}", &i.to_string());
                    assert!(m.insert(name, (shape.clone(), kind.clone())).is_none());
                }
            }
            None => assert!(m.insert(template.to_string(), (shape, kind)).is_none()),
        }
    }
    m
}

fn our_table(model: &FamilyModel) -> BTreeMap<String, (Vec<u64>, String)> {
    let mut m = BTreeMap::new();
    for t in model.dims.table() {
        let dup = m.insert(
            t.name.clone(),
            (t.shape.clone(), t.kind.peer_name().to_string()),
        );
        assert!(dup.is_none(), "{} appears twice", t.name);
    }
    m
}

fn assert_same_table(name: &str, ours: &FamilyModel, entry: &Value) {
    let theirs = peer_table(entry);
    let mine = our_table(ours);
    let missing: Vec<_> = theirs
        .keys()
        .filter(|k| !mine.contains_key(*k))
        .take(5)
        .collect();
    let extra: Vec<_> = mine
        .keys()
        .filter(|k| !theirs.contains_key(*k))
        .take(5)
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{name}: missing {missing:?}, not in diffusers {extra:?}"
    );
    for (k, v) in &theirs {
        assert_eq!(&mine[k], v, "{name}: {k}");
    }
    let c = ours.dims.counts();
    assert_eq!(
        c.parameters,
        entry["parameters"].as_u64().unwrap(),
        "{name} parameters"
    );
    assert_eq!(
        c.buffers,
        entry["buffers"].as_u64().unwrap(),
        "{name} buffers"
    );
    assert_eq!(c.tensors, theirs.len(), "{name} tensor count");
    assert_eq!(
        ours.class_name,
        entry["class"].as_str().unwrap(),
        "{name}: the class diffusers builds"
    );
}

/// Every diffusers preset (the original DiTs have no diffusers class: `params.rs` tests them).
fn diffusers_presets() -> Vec<String> {
    family_preset_names()
        .into_iter()
        .filter(|n| preset_config(n).is_some())
        .collect()
}

#[test]
fn every_preset_matches_the_diffusers_class_tensor_for_tensor() {
    let peer = peer();
    let presets = diffusers_presets();
    assert_eq!(presets.len(), 13);
    for name in &presets {
        let entry = &peer["presets"][name.as_str()];
        assert!(entry.is_object(), "{name} is not in the peer's output");
        assert_same_table(name, &family_preset(name).unwrap(), entry);
    }
}

#[test]
fn published_totals_pinned() {
    // sum(p.numel() for p in model.parameters()) of each diffusers class for the preset's config
    // (count_params.py, diffusers 0.42.1), and the buffer elements (fixed position / RoPE tables).
    for (name, params, buffers) in [
        ("dit-xl-2-256", 749_826_464u64, 294_912u64),
        ("dit-xl-2-512", 749_826_464, 1_179_648),
        ("pixart-alpha-1024", 611_349_152, 4_718_592),
        ("pixart-sigma-1024", 610_856_096, 4_718_592),
        ("sd3-medium", 2_028_328_000, 56_623_104),
        ("sd3.5-medium", 2_243_171_520, 226_492_416),
        ("sd3.5-large", 8_056_627_520, 89_653_248),
        ("flux.1-dev", 11_901_408_320, 0),
        ("flux.1-schnell", 11_891_178_560, 0),
        ("sana-600m", 591_747_872, 0),
        ("sana-1600m", 1_604_462_752, 0),
        ("wan2.1-1.3b", 1_418_996_800, 262_144),
        ("wan2.1-14b", 14_288_491_584, 262_144),
    ] {
        let c = family_preset(name).unwrap().dims.counts();
        assert_eq!((c.parameters, c.buffers), (params, buffers), "{name}");
        assert_eq!(
            c.trainable, c.parameters,
            "{name}: every diffusers parameter trains"
        );
    }
    // The original DiT as params.rs counts it: its sin-cos table is a fixed nn.Parameter.
    let c = family_preset("dit-xl-2").unwrap().dims.counts();
    assert_eq!(c.parameters, 675_129_632);
    assert_eq!(c.trainable, 674_834_720);
    assert_eq!(c.buffers, 0);
}

#[test]
fn variants_match_the_diffusers_class() {
    let peer = peer();
    let mut n = 0;
    for (name, entry) in peer["presets"].as_object().unwrap() {
        let Some(config) = entry.get("config") else {
            continue;
        };
        let text = serde_json::to_string(config).unwrap();
        let model = from_config_json(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_same_table(name, &model, entry);
        n += 1;
    }
    assert_eq!(n, 7, "seven variants");
}

#[test]
fn reads_every_config_the_peer_saved() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/saved_configs");
    let peer = peer();
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_str().unwrap().to_string();
        let text = std::fs::read_to_string(&path).unwrap();
        let read = from_config_json(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        // save_config writes the class diffusers built (DiT/PixArt, not Transformer2DModel) with
        // every __init__ key; it must read to the same model as the preset's own config.
        if preset_config(&name).is_some() {
            let preset = family_preset(&name).unwrap();
            assert_eq!(read.dims, preset.dims, "{name}");
        }
        assert_same_table(&name, &read, &peer["presets"][name.as_str()]);
        n += 1;
    }
    assert_eq!(n, 20);
}

#[test]
fn block_formulas_of_dit_facts() {
    // dit-facts §3: Flux double block 36D² + 30D + 512, single 15D² + 11D + 256 (D = 3072);
    // SD3 joint block 36D² + 30D, the context-pre-only last block 23D² + 20D (D = 1536);
    // PixArt 16D² + 19D... + the cross-attention's k/v over the caption width (D = 1152).
    let per_block = |m: &FamilyModel, prefix: &str, i: u32| -> u64 {
        m.dims
            .table()
            .iter()
            .filter(|t| t.block == Some(i) && t.name.starts_with(prefix))
            .map(|t| t.numel())
            .sum()
    };
    let flux = family_preset("flux.1-dev").unwrap();
    let d = 3072u64;
    assert_eq!(
        per_block(&flux, "transformer_blocks.", 0),
        36 * d * d + 30 * d + 512
    );
    assert_eq!(
        per_block(&flux, "single_transformer_blocks.", 0),
        15 * d * d + 11 * d + 256
    );
    let sd3 = family_preset("sd3-medium").unwrap();
    let d = 1536u64;
    assert_eq!(
        per_block(&sd3, "transformer_blocks.", 0),
        36 * d * d + 30 * d
    );
    assert_eq!(
        per_block(&sd3, "transformer_blocks.", 23),
        23 * d * d + 20 * d
    );
    let Dims::Sd3(dims) = &sd3.dims else {
        panic!("sd3 family")
    };
    assert_eq!(dims.pos_embed_max_size, Some(192));
}

#[test]
fn buffers_are_kept_apart_from_parameters() {
    let sd3 = family_preset("sd3.5-medium").unwrap();
    let pos: Vec<_> = sd3
        .dims
        .table()
        .into_iter()
        .filter(|t| t.kind != TensorKind::Param)
        .collect();
    assert_eq!(pos.len(), 1);
    assert_eq!(pos[0].name, "pos_embed.pos_embed");
    assert_eq!(pos[0].shape, vec![1, 384 * 384, 1536]);
    assert_eq!(
        pos[0].kind,
        TensorKind::Buffer,
        "SD3's cropped table is persistent"
    );
    let c = sd3.dims.counts();
    assert_eq!(c.persistent_buffers, 384 * 384 * 1536);
    let wan = family_preset("wan2.1-14b").unwrap().dims.counts();
    assert_eq!(
        wan.persistent_buffers, 0,
        "Wan's RoPE tables are not in the checkpoint"
    );
}
