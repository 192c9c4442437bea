//! What the families' tiny test models (`families/<family>/mod.rs`: `tiny_config`,
//! `tiny_spec`) build alike: a `config.json` object from its text, and a spec of it on
//! [`Spec::small`]'s workload with materialized attention.

use ditmem_spec::Spec;

use crate::error::Result;

/// A diffusers `config.json` object from its text; an empty map for text that is not one
/// (the family's reader then names what is missing).
pub(crate) fn config_map(text: &str) -> serde_json::Map<String, serde_json::Value> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    }
}

/// The spec of model `name` with `config` on [`Spec::small`]'s workload, materialized
/// attention, and `text_tokens` per text encoder (none given: the family's default).
pub(crate) fn tiny_family_spec(
    name: &str,
    config: serde_json::Map<String, serde_json::Value>,
    text_tokens: &[u32],
) -> Result<Spec> {
    let mut s = ditmem_budget::denoiser::with_family(Spec::small(), name, config)?;
    if !text_tokens.is_empty() {
        s.workload.text_tokens = Some(text_tokens.to_vec());
    }
    s.recipe.attention = ditmem_budget::AttentionMode::Materialized;
    Ok(s)
}
