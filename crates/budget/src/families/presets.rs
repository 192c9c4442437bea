//! Presets: the published checkpoints' transformer `config.json` values, read through the same
//! reader as `--model`. The Hub is not reachable from here; every value comes from the diffusers
//! repository (huggingface/diffusers, `scripts/convert_*_to_diffusers.py` and the classes'
//! `__init__` defaults), named per preset. `bench/torch_peer/count_params.py` holds the same
//! configs, and the test `families_params.rs` holds both against each other and against the
//! diffusers class's own count.

use std::sync::OnceLock;

use serde_json::{Map, Value};

use super::model::FamilyModel;
use super::read::from_config_json;
use crate::error::SpecError;
use crate::spec::ModelSpec;

/// (name, checkpoint and source, the preset whose config.json it changes (None: its own),
/// config.json or the keys it changes). A checkpoint the same conversion script makes with
/// other arguments is written as the keys those change.
const PRESETS: &[(&str, &str, Option<&str>, &str)] = &[
    (
        "dit-xl-2-256",
        // scripts/convert_dit_to_diffusers.py with --image_size 256 (sample_size = 256 // 8).
        "facebook/DiT-XL-2-256 (convert_dit_to_diffusers.py)",
        None,
        r#"{"_class_name": "Transformer2DModel", "sample_size": 32, "num_layers": 28,
            "attention_head_dim": 72, "in_channels": 4, "out_channels": 8, "patch_size": 2,
            "attention_bias": true, "num_attention_heads": 16, "activation_fn": "gelu-approximate",
            "num_embeds_ada_norm": 1000, "norm_type": "ada_norm_zero",
            "norm_elementwise_affine": false}"#,
    ),
    (
        "dit-xl-2-512",
        // The same script with --image_size 512.
        "facebook/DiT-XL-2-512 (convert_dit_to_diffusers.py)",
        Some("dit-xl-2-256"),
        r#"{"sample_size": 64}"#,
    ),
    (
        "pixart-alpha-1024",
        // scripts/convert_pixart_alpha_to_diffusers.py, --image_size 1024: sample_size 128, so
        // use_additional_conditions (null) is on: the multi-scale (MS) size embedders.
        "PixArt-alpha/PixArt-XL-2-1024-MS (convert_pixart_alpha_to_diffusers.py)",
        None,
        r#"{"_class_name": "Transformer2DModel", "sample_size": 128, "num_layers": 28,
            "attention_head_dim": 72, "in_channels": 4, "out_channels": 8, "patch_size": 2,
            "attention_bias": true, "num_attention_heads": 16, "cross_attention_dim": 1152,
            "activation_fn": "gelu-approximate", "num_embeds_ada_norm": 1000,
            "norm_type": "ada_norm_single", "norm_elementwise_affine": false, "norm_eps": 1e-6,
            "caption_channels": 4096}"#,
    ),
    (
        "pixart-sigma-1024",
        // scripts/convert_pixart_sigma_to_diffusers.py, --image_size 1024 (interpolation_scale
        // 2), without --micro_condition: use_additional_conditions false.
        "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS (convert_pixart_sigma_to_diffusers.py)",
        Some("pixart-alpha-1024"),
        r#"{"interpolation_scale": 2, "use_additional_conditions": false}"#,
    ),
    (
        "sd3-medium",
        // scripts/convert_sd3_to_diffusers.py: 24 joint blocks, heads = num_layers, caption dim
        // from context_embedder (1536), pos_embed_max_size 192 (its comment: "sd3.0 and sd3.5 8b
        // use 192"), no ln_q (qk_norm null), no attn2.
        "stabilityai/stable-diffusion-3-medium-diffusers (convert_sd3_to_diffusers.py)",
        None,
        r#"{"_class_name": "SD3Transformer2DModel", "sample_size": 128, "patch_size": 2,
            "in_channels": 16, "num_layers": 24, "attention_head_dim": 64,
            "num_attention_heads": 24, "joint_attention_dim": 4096,
            "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "out_channels": 16,
            "pos_embed_max_size": 192}"#,
    ),
    (
        "sd3.5-medium",
        // convert_sd3_to_diffusers.py: "sd3.5 2b use pos_embed_max_size=384"; ln_q present
        // (rms_norm); attn2 in joint blocks 0-12 (SD3Transformer2DModel's dual_attention_layers
        // comment: "(0, 1, ..., 12) for sd3.5").
        "stabilityai/stable-diffusion-3.5-medium (convert_sd3_to_diffusers.py)",
        Some("sd3-medium"),
        r#"{"pos_embed_max_size": 384, "qk_norm": "rms_norm",
            "dual_attention_layers": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]}"#,
    ),
    (
        "sd3.5-large",
        // convert_sd3_to_diffusers.py: 38 joint blocks and heads, caption dim 38 × 64 = 2432,
        // pos_embed_max_size 192, ln_q present, no attn2.
        "stabilityai/stable-diffusion-3.5-large (convert_sd3_to_diffusers.py)",
        Some("sd3-medium"),
        r#"{"num_layers": 38, "num_attention_heads": 38, "caption_projection_dim": 2432,
            "qk_norm": "rms_norm", "dual_attention_layers": []}"#,
    ),
    (
        "flux.1-dev",
        // scripts/convert_flux_to_diffusers.py: 19 double + 38 single blocks, inner 3072
        // (24 × 128), in_channels 64 (2×2-packed 16-channel latent), guidance_in present;
        // joint_attention_dim, pooled_projection_dim, axes_dims_rope: class defaults.
        "black-forest-labs/FLUX.1-dev (convert_flux_to_diffusers.py)",
        None,
        r#"{"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 64,
            "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
            "num_attention_heads": 24, "joint_attention_dim": 4096,
            "pooled_projection_dim": 768, "guidance_embeds": true,
            "axes_dims_rope": [16, 56, 56]}"#,
    ),
    (
        "flux.1-schnell",
        // The same script: schnell has no guidance_in (timestep-distilled).
        "black-forest-labs/FLUX.1-schnell (convert_flux_to_diffusers.py)",
        Some("flux.1-dev"),
        r#"{"guidance_embeds": false}"#,
    ),
    (
        "sana-600m",
        // scripts/convert_sana_to_diffusers.py, SanaMS_600M_P1_D28 at --image_size 1024:
        // sample_size 1024 // 32, interpolation_scale None (no position table), qk_norm None.
        "Efficient-Large-Model/Sana_600M_1024px_diffusers (convert_sana_to_diffusers.py)",
        None,
        r#"{"_class_name": "SanaTransformer2DModel", "in_channels": 32, "out_channels": 32,
            "num_attention_heads": 36, "attention_head_dim": 32, "num_layers": 28,
            "num_cross_attention_heads": 16, "cross_attention_head_dim": 72,
            "cross_attention_dim": 1152, "caption_channels": 2304, "mlp_ratio": 2.5,
            "attention_bias": false, "sample_size": 32, "patch_size": 1,
            "norm_elementwise_affine": false, "norm_eps": 1e-6, "interpolation_scale": null}"#,
    ),
    (
        "sana-1600m",
        // The same script, SanaMS_1600M_P1_D20 at 1024.
        "Efficient-Large-Model/Sana_1600M_1024px_diffusers (convert_sana_to_diffusers.py)",
        Some("sana-600m"),
        r#"{"num_attention_heads": 70, "num_layers": 20, "num_cross_attention_heads": 20,
            "cross_attention_head_dim": 112, "cross_attention_dim": 2240}"#,
    ),
    (
        "wan2.1-1.3b",
        // scripts/convert_wan_to_diffusers.py, get_transformer_config("Wan-T2V-1.3B").
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers (convert_wan_to_diffusers.py)",
        None,
        r#"{"_class_name": "WanTransformer3DModel", "added_kv_proj_dim": null,
            "attention_head_dim": 128, "cross_attn_norm": true, "eps": 1e-06, "ffn_dim": 8960,
            "freq_dim": 256, "in_channels": 16, "num_attention_heads": 12, "num_layers": 30,
            "out_channels": 16, "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads",
            "text_dim": 4096}"#,
    ),
    (
        "wan2.1-14b",
        // convert_wan_to_diffusers.py, get_transformer_config("Wan-T2V-14B").
        "Wan-AI/Wan2.1-T2V-14B-Diffusers (convert_wan_to_diffusers.py)",
        Some("wan2.1-1.3b"),
        r#"{"ffn_dim": 13824, "num_attention_heads": 40, "num_layers": 40}"#,
    ),
];

/// Every preset name: the diffusers checkpoints, then the original DiTs (`dit-xl-2` at 256²).
pub fn preset_names() -> Vec<String> {
    let mut v: Vec<String> = PRESETS.iter().map(|p| p.0.to_string()).collect();
    v.extend(ModelSpec::preset_names());
    v
}

/// The checkpoint a preset describes and where its values come from.
pub fn preset_source(name: &str) -> Option<&'static str> {
    PRESETS.iter().find(|p| p.0 == name).map(|p| p.1)
}

/// The config.json text of a diffusers preset (None for an unknown name, or a derived preset
/// whose text does not merge: caught by the tests).
pub fn preset_config(name: &str) -> Option<&'static str> {
    let i = PRESETS.iter().position(|p| p.0 == name)?;
    configs()[i].as_deref()
}

/// Every preset's config.json text, in [`PRESETS`]' order: its own, or its base's with the keys
/// it changes.
fn configs() -> &'static [Option<String>] {
    static CONFIGS: OnceLock<Vec<Option<String>>> = OnceLock::new();
    CONFIGS.get_or_init(|| {
        PRESETS
            .iter()
            .map(|&(_, _, base, text)| match base {
                None => Some(text.to_string()),
                Some(b) => {
                    let (.., base_text) = PRESETS.iter().find(|p| p.0 == b && p.2.is_none())?;
                    changed(base_text, text)
                }
            })
            .collect()
    })
}

/// The config.json `base` with the keys of `changes` set as there.
fn changed(base: &str, changes: &str) -> Option<String> {
    let mut map: Map<String, Value> = serde_json::from_str(base).ok()?;
    let changes: Map<String, Value> = serde_json::from_str(changes).ok()?;
    map.extend(changes);
    serde_json::to_string(&map).ok()
}

/// A preset by name (case-insensitive). The original DiTs are at 256² (their position table
/// depends on the resolution).
pub fn preset(name: &str) -> Result<FamilyModel, SpecError> {
    let lower = name.to_ascii_lowercase();
    if let Some(text) = preset_config(&lower) {
        let mut m = from_config_json(text)?;
        m.name = lower;
        return Ok(m);
    }
    if let Ok(model) = ModelSpec::preset(&lower) {
        let mut m = FamilyModel::original_dit(model, 256)?;
        m.name = lower;
        return Ok(m);
    }
    Err(unknown_preset(name))
}

/// The refusal of a preset name that is none of [`preset_names`]: it names the flag and lists
/// every preset, the diffusers checkpoints and the original DiTs (the spec crate's own refusal,
/// `model.preset`, knows only the DiTs).
pub fn unknown_preset(name: &str) -> SpecError {
    SpecError::invalid(
        "--preset",
        format!(
            "unknown preset '{}'; allowed: {}",
            super::config::cut(name),
            preset_names().join(", ")
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every preset reads; a derived one is its base but for the keys it names, each of which
    /// changes a value of the base (or adds a key), so no change is a no-op.
    #[test]
    fn derived_presets_are_their_base_with_what_they_change() {
        let parse = |t: &str| serde_json::from_str::<Map<String, Value>>(t).unwrap();
        for &(name, _, base, text) in PRESETS {
            assert!(preset(name).is_ok(), "{name}");
            let full = parse(preset_config(name).unwrap());
            let Some(base) = base else {
                assert_eq!(full, parse(text), "{name}");
                continue;
            };
            let (base, changes) = (parse(preset_config(base).unwrap()), parse(text));
            for (k, v) in &changes {
                assert_ne!(base.get(k), Some(v), "{name}: {k} changes nothing");
            }
            let mut expected = base;
            expected.extend(changes);
            assert_eq!(full, expected, "{name}");
        }
    }
}
