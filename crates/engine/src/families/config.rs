//! What the families' config readers (`families/<family>/params.rs`, `*Geom::new`) check and
//! read alike, and the patch embedding their parameter inventories list alike.

use ditmem_spec::Spec;

use crate::error::{EngineError, Result};
use crate::shapes::{Dims, Init, Inventory};

/// The engine runs `family`'s q/k/v projections with biases: an error for a config without
/// them (`attention_bias = false`).
pub(crate) fn biased_qkv(attention_bias: bool, family: &str) -> Result<()> {
    if !attention_bias {
        return Err(EngineError::unsupported(
            "model.diffusers.attention_bias = false",
            format!(
                "the engine's {family} has biased q/k/v projections; use attention_bias = true"
            ),
        ));
    }
    Ok(())
}

/// The patch embedding `prefix` (a Conv2d with kernel (p, p), Wan's Conv3d with (1, p, p)):
/// its weight (D, C, kernel…) xavier-uniform, its bias zeros.
pub(crate) fn patch_conv(inv: &mut Inventory, prefix: &str, d: &Dims, kernel: &[usize]) {
    let shape = [&[d.hidden, d.in_channels][..], kernel].concat();
    inv.tensor(format!("{prefix}.weight"), shape, Init::XavierUniform);
    inv.tensor(format!("{prefix}.bias"), vec![d.hidden], Init::Zeros);
}

/// The engine trains the diffusers families without dropout: an error for a spec with any,
/// naming the model (`with`: "a PixArt model") and the family (`family`: "PixArt").
pub(crate) fn no_dropout(spec: &Spec, with: &str, family: &str) -> Result<()> {
    if spec.model.attn_dropout > 0.0 || spec.model.mlp_dropout > 0.0 {
        return Err(EngineError::unsupported(
            format!("model.attn_dropout / model.mlp_dropout with {with}"),
            format!("{family} trains without dropout in the engine; set both to 0"),
        ));
    }
    Ok(())
}

/// The caption's token count of a family with one text encoder (`encoder`: "T5"), from
/// `workload.text_tokens` or the family's default: one positive count.
pub(crate) fn caption_tokens(spec: &Spec, encoder: &str) -> Result<usize> {
    let fm = ditmem_budget::denoiser::family(spec)?
        .ok_or_else(|| EngineError::bad_input("model.diffusers", "is missing"))?;
    let tokens = ditmem_budget::denoiser::text_tokens(spec, &fm.geometry());
    match tokens.as_slice() {
        [t] if *t > 0 => Ok(*t as usize),
        other => Err(EngineError::bad_input(
            "workload.text_tokens",
            format!("{other:?}; allowed: one positive count (the {encoder} caption)"),
        )),
    }
}
