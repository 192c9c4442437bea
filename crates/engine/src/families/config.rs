//! What the families' config readers (`families/<family>/params.rs`, `*Geom::new`) check and
//! read alike.

use ditmem_spec::Spec;

use crate::error::{EngineError, Result};

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
