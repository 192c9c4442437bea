//! `model.keep_blocks` (`--depth`): a model with fewer blocks and every other dimension kept.

use ditmem_budget::{family_preset_names, from_config_json, preset_config, Dims, FamilyTensor};
use serde_json::Value;

fn dims(text: &str) -> Dims {
    from_config_json(text).expect("config").dims
}

/// The preset's config with some keys replaced.
fn edited(name: &str, keys: &[(&str, Value)]) -> Dims {
    let mut v: Value = serde_json::from_str(preset_config(name).unwrap()).unwrap();
    for (k, x) in keys {
        v[*k] = x.clone();
    }
    dims(&v.to_string())
}

fn outside_blocks(t: &[FamilyTensor]) -> Vec<(String, Vec<u64>)> {
    t.iter()
        .filter(|x| !x.name.contains("blocks."))
        .map(|x| (x.name.clone(), x.shape.clone()))
        .collect()
}

#[test]
fn one_block_keeps_every_other_tensor() {
    for name in family_preset_names() {
        let Some(text) = preset_config(&name) else {
            continue;
        };
        let full = dims(text);
        let one = full.with_depth(&[1], "model.keep_blocks").unwrap();
        assert_eq!(one.hidden(), full.hidden(), "{name}");
        assert_eq!(
            outside_blocks(&one.table()),
            outside_blocks(&full.table()),
            "{name}"
        );
        let kinds = one.block_kinds();
        assert!(kinds.iter().all(|&(_, n)| n == 1), "{name}: {kinds:?}");
        assert!(one.table().len() < full.table().len(), "{name}");
    }
}

#[test]
fn reduced_models_are_the_configs_with_fewer_layers() {
    use serde_json::json;
    let flux = dims(preset_config("flux.1-dev").unwrap())
        .with_depth(&[2, 3], "f")
        .unwrap();
    assert_eq!(
        flux,
        edited(
            "flux.1-dev",
            &[("num_layers", json!(2)), ("num_single_layers", json!(3))]
        )
    );
    // SD3.5-medium: 13 dual-attention blocks (0–12) then 11 joint blocks.
    let sd35 = dims(preset_config("sd3.5-medium").unwrap());
    assert_eq!(
        sd35.block_kinds(),
        vec![("dual-attention block", 13), ("joint block", 11)]
    );
    assert_eq!(
        sd35.with_depth(&[2, 1], "f").unwrap(),
        edited(
            "sd3.5-medium",
            &[
                ("num_layers", json!(3)),
                ("dual_attention_layers", json!([0, 1]))
            ]
        )
    );
    let pixart = dims(preset_config("pixart-alpha-1024").unwrap());
    assert_eq!(
        pixart.with_depth(&[2], "f").unwrap(),
        edited("pixart-alpha-1024", &[("num_layers", json!(2))])
    );
}

#[test]
fn counts_outside_the_model_are_refused_by_name() {
    let sd35 = dims(preset_config("sd3.5-medium").unwrap());
    for keep in [&[0u32][..], &[14], &[1, 12], &[1, 1, 1], &[]] {
        let e = sd35.with_depth(keep, "model.keep_blocks").unwrap_err();
        assert_eq!(e.field(), Some("model.keep_blocks"), "{keep:?}");
        assert!(e.to_string().contains("allowed"), "{e}");
    }
    let wan = dims(preset_config("wan2.1-1.3b").unwrap());
    assert!(wan.with_depth(&[1, 1], "f").is_err());
    assert!(wan.with_depth(&[30], "f").is_ok());
    assert!(wan.with_depth(&[31], "f").is_err());
}
