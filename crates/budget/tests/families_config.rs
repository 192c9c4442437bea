//! The diffusers config.json reader: bad, unsupported and hostile configs are typed errors naming
//! the key and what is allowed; never a panic, never unbounded memory.

use ditmem_budget::{
    family_preset, from_config_json, preset_config, Family, SpecError, MAX_CONFIG_JSON_BYTES,
};

fn field(text: &str) -> (String, String) {
    match from_config_json(text) {
        Err(e @ SpecError::Invalid { .. }) => (e.field().unwrap().to_string(), e.to_string()),
        Err(e) => ("<parse>".into(), e.to_string()),
        Ok(m) => panic!("accepted: {m:?}"),
    }
}

/// A preset's config with one key set to a raw JSON value.
fn with(preset: &str, key: &str, value: &str) -> String {
    let mut v: serde_json::Value = serde_json::from_str(preset_config(preset).unwrap()).unwrap();
    v[key] = serde_json::from_str(value).unwrap();
    v.to_string()
}

#[test]
fn class_name_picks_the_family_and_remaps_transformer2d() {
    for (preset, family) in [
        ("dit-xl-2-256", Family::DitDiffusers),
        ("pixart-alpha-1024", Family::Pixart),
        ("sd3-medium", Family::Sd3),
        ("flux.1-dev", Family::Flux),
        ("sana-600m", Family::Sana),
        ("wan2.1-1.3b", Family::Wan),
    ] {
        assert_eq!(family_preset(preset).unwrap().family, family, "{preset}");
    }
    let (f, msg) = field(&with("dit-xl-2-256", "norm_type", "\"layer_norm\""));
    assert_eq!(f, "norm_type");
    assert!(
        msg.contains("ada_norm_zero") && msg.contains("ada_norm_single"),
        "{msg}"
    );
    let (f, msg) = field(r#"{"_class_name": "UNet2DConditionModel"}"#);
    assert_eq!(f, "_class_name");
    assert!(msg.contains("FluxTransformer2DModel"), "{msg}");
    assert_eq!(field(r#"{"num_layers": 2}"#).0, "_class_name");
    assert_eq!(field(r#"{"_class_name": 3}"#).0, "_class_name");
}

#[test]
fn bookkeeping_keys_are_ignored_and_unknown_keys_refused() {
    let mut v: serde_json::Value =
        serde_json::from_str(preset_config("flux.1-dev").unwrap()).unwrap();
    v["_diffusers_version"] = "0.30.0.dev0".into();
    v["_name_or_path"] = "/home/me/flux".into();
    assert!(from_config_json(&v.to_string()).is_ok());
    let (f, msg) = field(&with("flux.1-dev", "num_experts", "8"));
    assert_eq!(f, "num_experts");
    assert!(
        msg.contains("unknown key for FluxTransformer2DModel"),
        "{msg}"
    );
    assert!(
        msg.contains("num_single_layers"),
        "names what is allowed: {msg}"
    );
}

#[test]
fn values_the_family_does_not_model_are_refused_by_key() {
    for (preset, key, value) in [
        ("pixart-alpha-1024", "cross_attention_dim", "4096"),
        ("sana-600m", "cross_attention_dim", "2304"),
        ("sd3-medium", "caption_projection_dim", "1152"),
        ("sd3-medium", "qk_norm", "\"layer_norm\""),
        ("sd3-medium", "dual_attention_layers", "[0, 24]"),
        ("flux.1-dev", "axes_dims_rope", "[16, 56, 48]"),
        ("wan2.1-14b", "image_dim", "1280"),
        ("wan2.1-14b", "added_kv_proj_dim", "5120"),
        ("sana-600m", "guidance_embeds", "true"),
        ("dit-xl-2-256", "activation_fn", "\"geglu\""),
        ("dit-xl-2-256", "only_cross_attention", "true"),
        ("dit-xl-2-256", "cross_attention_dim", "1152"),
        ("pixart-sigma-1024", "norm_elementwise_affine", "true"),
        ("pixart-sigma-1024", "dropout", "0.1"),
        ("dit-xl-2-256", "sample_size", "33"),
    ] {
        let (f, msg) = field(&with(preset, key, value));
        assert_eq!(f, key, "{preset} {key}={value}: {msg}");
        assert!(msg.contains("allowed") || msg.contains("must"), "{msg}");
    }
}

#[test]
fn hostile_input_is_a_typed_error() {
    for (key, value) in [
        ("num_layers", "-1"),
        ("num_layers", "1e30"),
        ("num_layers", "100000"),
        ("num_layers", "2.5"),
        ("num_layers", "\"28\""),
        ("num_attention_heads", "18446744073709551615"),
        ("attention_head_dim", "0"),
        ("num_attention_heads", "65536"),
        ("in_channels", "[]"),
        ("axes_dims_rope", "[1,2,3,4,5,6,7]"),
        ("guidance_embeds", "\"yes\""),
    ] {
        let (f, _) = field(&with("flux.1-dev", key, value));
        assert_eq!(f, key, "{key}={value}");
    }
    // Not an object, not JSON, nested too deep, too big.
    assert_eq!(field("[1, 2]").0, "config.json");
    assert_eq!(field("{").0, "<parse>");
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    assert_eq!(field(&deep).0, "<parse>");
    let big = format!(
        "{{\"_class_name\": \"{}\"}}",
        "x".repeat(MAX_CONFIG_JSON_BYTES)
    );
    assert_eq!(field(&big).0, "config.json");
    // A long unknown key is cut in the message.
    let (_, msg) = field(&with("flux.1-dev", &"k".repeat(10_000), "1"));
    assert!(msg.len() < 2_000, "{}", msg.len());
}

#[test]
fn largest_accepted_config_stays_countable() {
    // 512 layers × 65,536 hidden: counts in u64 without overflow, table built lazily by the caller.
    let text = r#"{"_class_name": "SanaTransformer2DModel", "num_layers": 2,
        "num_attention_heads": 2048, "attention_head_dim": 32, "cross_attention_dim": 65536,
        "num_cross_attention_heads": 2048, "cross_attention_head_dim": 32, "mlp_ratio": 16}"#;
    let m = from_config_json(text).unwrap();
    assert!(m.dims.counts().parameters > 1 << 36);
}

#[test]
fn legacy_transformer2d_configs_with_no_op_keys_are_read() {
    // The shape of the Hub's facebook/DiT-XL-2-256 transformer/config.json, written by diffusers
    // 0.12 as a Transformer2DModel: the keys DiTTransformer2DModel drops at their no-op values.
    let dit = r#"{"_class_name": "Transformer2DModel", "_diffusers_version": "0.12.0.dev0",
        "activation_fn": "gelu-approximate", "attention_bias": true, "attention_head_dim": 72,
        "cross_attention_dim": null, "dropout": 0.0, "in_channels": 4,
        "norm_elementwise_affine": false, "norm_num_groups": 32, "norm_type": "ada_norm_zero",
        "num_attention_heads": 16, "num_embeds_ada_norm": 1000, "num_layers": 28,
        "num_vector_embeds": null, "only_cross_attention": false, "out_channels": 8,
        "patch_size": 2, "sample_size": 32, "upcast_attention": false,
        "use_linear_projection": false}"#;
    let m = from_config_json(dit).unwrap();
    assert_eq!(m.dims, family_preset("dit-xl-2-256").unwrap().dims);
    assert_eq!(m.dims.counts().parameters, 749_826_464);
    // The same for PixArt-α 1024-MS (diffusers 0.22): use_additional_conditions absent → on.
    let pixart = r#"{"_class_name": "Transformer2DModel", "_diffusers_version": "0.22.0.dev0",
        "activation_fn": "gelu-approximate", "attention_bias": true, "attention_head_dim": 72,
        "attention_type": "default", "caption_channels": 4096, "cross_attention_dim": 1152,
        "double_self_attention": false, "dropout": 0.0, "in_channels": 4,
        "norm_elementwise_affine": false, "norm_eps": 1e-06, "norm_num_groups": 32,
        "norm_type": "ada_norm_single", "num_attention_heads": 16, "num_embeds_ada_norm": 1000,
        "num_layers": 28, "num_vector_embeds": null, "only_cross_attention": false,
        "out_channels": 8, "patch_size": 2, "sample_size": 128, "upcast_attention": false,
        "use_linear_projection": false}"#;
    let m = from_config_json(pixart).unwrap();
    assert_eq!(m.family, Family::Pixart);
    assert_eq!(m.dims.counts().parameters, 611_349_152);
    // A legacy key at a value that would change the model is refused.
    let bad = pixart.replace("\"num_vector_embeds\": null", "\"num_vector_embeds\": 1024");
    assert_eq!(field(&bad).0, "num_vector_embeds");
}
