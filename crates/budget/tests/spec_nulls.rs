//! The spec's TOML round trip of a family's diffusers config (moved from `ditmem-spec`'s
//! `spec.rs` tests: it needs the family presets, which are the budget's).

use ditmem_budget::Spec;

/// A family spec whose config has nulls (Wan's `added_kv_proj_dim`, …) writes as TOML and
/// reads back to the same spec; deeper nulls (bookkeeping only) are left out; what TOML
/// cannot hold is an error, never a panic.
#[test]
fn nulls_of_a_diffusers_config_survive_toml() {
    for name in ditmem_budget::family_preset_names() {
        let Some(text) = ditmem_budget::preset_config(&name) else {
            continue;
        };
        let map = serde_json::from_str(text).unwrap();
        let s = ditmem_budget::denoiser::with_family(Spec::default_xl(), &name, map).unwrap();
        let toml = s.to_toml().unwrap();
        let back = Spec::from_toml(&toml).unwrap_or_else(|e| panic!("{name}: {e}\n{toml}"));
        assert_eq!(back, s, "{name}:\n{toml}");
    }
    let text = ditmem_budget::preset_config("sd3-medium").unwrap();
    let mut map: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text).unwrap();
    map.insert("pos_embed_max_size".into(), serde_json::Value::Null);
    map.insert(
        "_note".into(),
        serde_json::json!({"a": null, "b": [1, null, {"c": null}]}),
    );
    let s = ditmem_budget::denoiser::with_family(Spec::default_xl(), "sd3-nulls", map).unwrap();
    let toml = s.to_toml().unwrap();
    assert!(
        toml.contains("diffusers_null = [\"pos_embed_max_size\"]"),
        "{toml}"
    );
    let back = Spec::from_toml(&toml).unwrap();
    let d = back.model.diffusers.as_ref().unwrap();
    assert_eq!(d["pos_embed_max_size"], serde_json::Value::Null);
    assert_eq!(d["_note"], serde_json::json!({"b": [1, {}]}));
    assert!(back.model.diffusers_null.is_empty());
    // A listed key that also has a value, and a list without a config, are refused.
    let bad = toml.replace(
        "diffusers_null = [\"pos_embed_max_size\"]",
        "diffusers_null = [\"patch_size\"]",
    );
    let e = Spec::from_toml(&bad).unwrap_err();
    assert_eq!(e.field(), Some("model.diffusers_null"), "{e}");
    let mut dit = Spec::default_xl();
    dit.model.diffusers_null = vec!["x".into()];
    let e = Spec::from_toml(&dit.to_toml().unwrap()).unwrap_err();
    assert_eq!(e.field(), Some("model.diffusers_null"), "{e}");
    // An integer TOML cannot hold.
    let mut big = s.clone();
    big.model
        .diffusers
        .as_mut()
        .unwrap()
        .insert("_big".into(), serde_json::json!(u64::MAX));
    let e = big.to_toml().unwrap_err();
    assert_eq!(e.field(), Some("model.diffusers"), "{e}");
}
