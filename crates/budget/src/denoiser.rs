//! The denoiser of a spec: the original DiT that `model`'s own fields describe, or a diffusers
//! model of a family read from `model.diffusers` (its transformer `config.json` object).
//!
//! Above both `params` (the original DiT's table) and `families` (the diffusers classes' tables):
//! the spec itself stays below them and holds the config as it was given. [`resolve`] derives
//! the spec's model fields and VAE geometry from the family, [`check`] holds the workload and
//! the recipe against it, and [`param_table`] lists every tensor the step holds for either kind.

use crate::error::SpecError;
use crate::families::{self, FamilyModel, FamilyTensor, Geometry, Group, TensorKind};
use crate::params::{self, Module, ParamRole, ParamTensor};
use crate::spec::{Runtime, Spec};

/// The diffusers model of a spec (None: the original DiT).
pub fn family(spec: &Spec) -> Result<Option<FamilyModel>, SpecError> {
    let Some(map) = spec.model.diffusers_config() else {
        return Ok(None);
    };
    let mut m = families::from_config_map(map).map_err(|e| match e {
        SpecError::Invalid { field, message } => SpecError::Invalid {
            field: format!("model.diffusers.{field}"),
            message,
        },
        other => other,
    })?;
    m.name = spec.model.name.clone();
    if !spec.model.keep_blocks.is_empty() {
        m.dims = m
            .dims
            .with_depth(&spec.model.keep_blocks, "model.keep_blocks")?;
    }
    Ok(Some(m))
}

/// A spec of the given diffusers model (a preset or a read config.json): the config goes into
/// `model.diffusers` and the derived fields are filled.
pub fn with_family(
    mut spec: Spec,
    name: &str,
    config: serde_json::Map<String, serde_json::Value>,
) -> Result<Spec, SpecError> {
    spec.model.name = name.to_string();
    spec.model.diffusers = Some(config);
    // diffusers' attention processors call `scaled_dot_product_attention` (a flag may still ask
    // for the explicit softmax).
    spec.recipe.attention = crate::spec::AttentionMode::MemoryEfficient;
    // None of diffusers' SD3 / Flux / Sana training scripts keeps an EMA (no `--use_ema`; a flag
    // may still ask for one).
    spec.recipe.ema.enabled = false;
    resolve(&mut spec)?;
    Ok(spec)
}

/// Derive the model fields the generic code reads (depth, hidden, heads, patch, channels) and
/// the VAE geometry from the family: the VAE is the one the model was trained with, so a
/// spec's `workload.vae_factor`, `latent_channels` and `vae_temporal_factor` follow the model.
/// A no-op for the original DiT.
pub fn resolve(spec: &mut Spec) -> Result<(), SpecError> {
    let Some(fm) = family(spec)? else {
        return Ok(());
    };
    let g = fm.geometry();
    let narrow = |field: &str, v: u64| {
        u32::try_from(v).map_err(|_| SpecError::invalid(field, format!("{v} is too large")))
    };
    let m = &mut spec.model;
    m.depth = narrow("model.diffusers.num_layers", g.blocks)?;
    m.hidden = narrow("model.diffusers.attention_head_dim", g.hidden)?;
    m.heads = narrow("model.diffusers.num_attention_heads", g.heads)?;
    m.patch = narrow("model.diffusers.patch_size", g.patch)?;
    m.in_channels = narrow("model.diffusers.in_channels", g.latent_channels)?;
    m.mlp_ratio = narrow("model.diffusers", g.mlp.div_ceil(g.hidden.max(1)).max(1))?;
    // Not class-conditional (or, for diffusers' DiT, its label table is in the family's table).
    m.num_classes = 1;
    m.class_dropout_prob = 0.0;
    m.learn_sigma = false;
    let w = &mut spec.workload;
    w.vae_factor = narrow("workload.vae_factor", g.vae_factor)?;
    w.latent_channels = m.in_channels;
    w.vae_temporal_factor = narrow("workload.vae_temporal_factor", g.vae_temporal_factor)?;
    Ok(())
}

/// The workload a spec's model trains at by default ([`FamilyModel::training_defaults`]): None
/// for the original DiT and diffusers' DiT.
pub fn training_defaults(spec: &Spec) -> Result<Option<families::TrainingDefaults>, SpecError> {
    Ok(family(spec)?.and_then(|fm| fm.training_defaults()))
}

/// The text tokens per encoder of a spec's model: the spec's, or the family's defaults.
pub fn text_tokens(spec: &Spec, g: &Geometry) -> Vec<u64> {
    match &spec.workload.text_tokens {
        Some(t) => t.iter().map(|&n| u64::from(n)).collect(),
        None => g.text.iter().map(|e| e.default_tokens).collect(),
    }
}

/// Check a resolved spec against its family: the runtime, the text encoders, frames, LoRA
/// modules.
pub fn check(spec: &Spec) -> Result<(), SpecError> {
    spec.validate()?;
    let class_conditional = |class: &str| {
        SpecError::invalid(
            "recipe.text_encoders",
            format!(
                "'{}', but {class} is class-conditional: it has no text encoder; allowed: cached",
                spec.recipe.text_encoders.name()
            ),
        )
    };
    let Some(fm) = family(spec)? else {
        if !spec.recipe.text_encoders.is_cached() {
            return Err(class_conditional("the original DiT"));
        }
        return Ok(());
    };
    if spec.runtime == Runtime::DitmemCpu {
        check_engine(spec, &fm)?;
    }
    let g = fm.geometry();
    if g.text.is_empty() && !spec.recipe.text_encoders.is_cached() {
        return Err(class_conditional(fm.class_name));
    }
    check_workload(spec, &fm, &g)?;
    if spec.recipe.lora.is_some() {
        check_lora_modules(spec, &fm)?;
    }
    Ok(())
}

/// What the ditmem-cpu engine runs: its families, and each family's configs.
fn check_engine(spec: &Spec, fm: &FamilyModel) -> Result<(), SpecError> {
    let engine_runs = matches!(
        fm.family,
        families::Family::Pixart
            | families::Family::Sd3
            | families::Family::Flux
            | families::Family::Sana
            | families::Family::Wan
            | families::Family::DitDiffusers
    );
    if !engine_runs {
        return Err(SpecError::invalid(
            "runtime",
            format!(
                "ditmem-cpu runs only the original DiT, diffusers' DiT, PixArt, SD3, Flux, Sana and Wan so far, not {} ({}); allowed: \
                 pytorch, pytorch:cpu, pytorch:cuda[:flash|efficient|math]",
                fm.class_name,
                fm.family.name()
            ),
        ));
    }
    check_engine_pixart(spec, fm)?;
    check_engine_sd3(spec, fm)?;
    check_engine_flux(spec, fm)?;
    check_engine_sana(spec, fm)?;
    check_engine_wan(spec, fm)?;
    check_engine_lora(spec, fm)
}

/// The model fields, text tokens and frames against the family's geometry.
fn check_workload(spec: &Spec, fm: &FamilyModel, g: &Geometry) -> Result<(), SpecError> {
    let m = &spec.model;
    if u64::from(m.depth) != g.blocks || u64::from(m.hidden) != g.hidden {
        return Err(SpecError::invalid(
            "model.depth",
            format!(
                "depth {} / hidden {} do not follow from model.diffusers ({} blocks, hidden {}); \
                 allowed: leave them out (they are derived from the config)",
                m.depth, m.hidden, g.blocks, g.hidden
            ),
        ));
    }
    let w = &spec.workload;
    if let Some(tt) = &w.text_tokens {
        if tt.len() != g.text.len() {
            let names: Vec<&str> = g.text.iter().map(|e| e.name).collect();
            return Err(SpecError::invalid(
                "workload.text_tokens",
                if g.text.is_empty() {
                    format!(
                        "is given, but {} has no text encoder; allowed: none",
                        fm.class_name
                    )
                } else {
                    format!(
                        "lists {} counts; allowed: {} (one per text encoder: {})",
                        tt.len(),
                        g.text.len(),
                        names.join(", ")
                    )
                },
            ));
        }
    }
    if w.frames != 1 && g.vae_temporal_factor == 1 {
        return Err(SpecError::invalid(
            "workload.frames",
            format!(
                "{} for {} (an image model); allowed: 1",
                w.frames, fm.class_name
            ),
        ));
    }
    if let families::Dims::Wan(d) = &fm.dims {
        if d.patch_size[0] != 1 {
            return Err(SpecError::invalid(
                "model.diffusers.patch_size",
                format!(
                    "{:?} patches {} latent frames together; allowed: a temporal patch of 1 (Wan 2.1)",
                    d.patch_size, d.patch_size[0]
                ),
            ));
        }
    }
    Ok(())
}

/// Every LoRA module name names a Linear of the model.
fn check_lora_modules(spec: &Spec, fm: &FamilyModel) -> Result<(), SpecError> {
    let modules = lora_modules(spec);
    let table = fm.dims.table();
    for name in &modules {
        if !table
            .iter()
            .any(|t| is_linear_weight(t) && matches_module(module_of(&t.name), name))
        {
            return Err(SpecError::invalid(
                "recipe.lora.modules",
                format!(
                    "'{}' names no Linear of {}; allowed: module names such as to_q, to_k, \
                     to_v, to_out.0 (PEFT matches a full name or its last components)",
                    name, fm.class_name
                ),
            ));
        }
    }
    Ok(())
}

/// A config the ditmem-cpu engine does not execute: `why`, then the runtime that does.
fn engine_refusal(field: &str, why: impl std::fmt::Display) -> SpecError {
    SpecError::invalid(field, format!("{why}; allowed: --runtime pytorch for it"))
}

/// The ditmem-cpu engine's families run without dropout.
fn refuse_engine_dropout(spec: &Spec, family: &str) -> Result<(), SpecError> {
    if spec.model.attn_dropout > 0.0 || spec.model.mlp_dropout > 0.0 {
        return Err(engine_refusal(
            "model.attn_dropout",
            format!("dropout in {family} is not in the ditmem-cpu engine; allowed: 0"),
        ));
    }
    Ok(())
}

/// What the ditmem-cpu engine runs of PixArt (`ditmem_engine::families::pixart`): the budget
/// of that runtime describes the engine's step, so a config it does not execute is refused.
fn check_engine_pixart(spec: &Spec, fm: &FamilyModel) -> Result<(), SpecError> {
    let families::Dims::Pixart(d) = &fm.dims else {
        return Ok(());
    };
    if d.use_additional_conditions && d.inner() % 3 != 0 {
        return Err(engine_refusal(
            "model.diffusers.use_additional_conditions",
            format!(
                "true with a hidden size of {} that 3 does not divide: diffusers adds the \
                 resolution (2·D/3) and aspect-ratio (D/3) embeddings to the timestep's (D); \
                 allowed: false, or a hidden size divisible by 3",
                d.inner()
            ),
        ));
    }
    if !d.attention_bias {
        return Err(engine_refusal(
            "model.diffusers.attention_bias",
            "false: the ditmem-cpu engine's PixArt has biased q/k/v; allowed: true",
        ));
    }
    refuse_engine_dropout(spec, "PixArt")
}

/// What the ditmem-cpu engine runs of SD3 (`ditmem_engine::families::sd3`): a config it does
/// not execute is refused, naming the field.
fn check_engine_sd3(spec: &Spec, fm: &FamilyModel) -> Result<(), SpecError> {
    let families::Dims::Sd3(d) = &fm.dims else {
        return Ok(());
    };
    refuse_engine_dropout(spec, "SD3")?;
    if d.out_channels < d.in_channels {
        return Err(engine_refusal(
            "model.diffusers.out_channels",
            format!(
                "{} is below in_channels {}: the engine's loss reads the first in_channels of the \
                 prediction; allowed: at least {}",
                d.out_channels, d.in_channels, d.in_channels
            ),
        ));
    }
    let grid = spec.token_grid()?;
    let side = u64::from(grid.rows.max(grid.cols));
    match d.pos_embed_max_size {
        Some(m) if m < side => {
            return Err(SpecError::invalid(
                "model.diffusers.pos_embed_max_size",
                format!(
                    "{m} is smaller than the token grid's side {side}; allowed: at least {side}"
                ),
            ))
        }
        None if grid.rows != grid.cols => {
            return Err(engine_refusal(
                "workload.image_size",
                format!(
                    "a {}×{} token grid without pos_embed_max_size; allowed: a square grid",
                    grid.rows, grid.cols
                ),
            ))
        }
        _ => {}
    }
    let tokens = text_tokens(spec, &fm.geometry());
    if tokens.contains(&0) {
        return Err(engine_refusal(
            "workload.text_tokens",
            format!("{tokens:?}: the engine's SD3 reads every encoder's tokens; allowed: counts of 1 or more"),
        ));
    }
    Ok(())
}

/// What the ditmem-cpu engine runs of Sana (`ditmem_engine::families::sana`): the budget of
/// that runtime describes the engine's step, so a config it does not execute is refused.
fn check_engine_sana(spec: &Spec, fm: &FamilyModel) -> Result<(), SpecError> {
    let families::Dims::Sana(d) = &fm.dims else {
        return Ok(());
    };
    if d.qk_norm {
        return Err(engine_refusal(
            "model.diffusers.qk_norm",
            "rms_norm_across_heads: the ditmem-cpu engine's Sana has no q/k norms yet; allowed: null",
        ));
    }
    if d.pos_embed {
        return Err(engine_refusal(
            "model.diffusers.interpolation_scale",
            "set: the ditmem-cpu engine's Sana has no sin-cos position table yet; allowed: null",
        ));
    }
    refuse_engine_dropout(spec, "Sana")
}

/// What the ditmem-cpu engine runs of Wan (`ditmem_engine::families::wan`): a square spatial
/// patch, no dropout.
fn check_engine_wan(spec: &Spec, fm: &FamilyModel) -> Result<(), SpecError> {
    let families::Dims::Wan(d) = &fm.dims else {
        return Ok(());
    };
    if d.patch_size[1] != d.patch_size[2] {
        return Err(engine_refusal(
            "model.diffusers.patch_size",
            format!(
                "{:?}: the ditmem-cpu engine's Wan has a square spatial patch; allowed: [1, p, p]",
                d.patch_size
            ),
        ));
    }
    refuse_engine_dropout(spec, "Wan")
}

/// What the ditmem-cpu engine runs of a Flux config (the engine's `FluxGeom::new` refuses the
/// same).
fn check_engine_flux(spec: &Spec, fm: &FamilyModel) -> Result<(), SpecError> {
    let families::Dims::Flux(d) = &fm.dims else {
        return Ok(());
    };
    if d.patch_size != 1 || d.out_channels != d.in_channels {
        return Err(engine_refusal(
            "model.diffusers.patch_size",
            format!(
                "{} with out_channels {} (in {}): the ditmem-cpu engine packs 2×2 latent pixels \
                 per token and predicts the packed latent; allowed: patch_size 1, out_channels = \
                 in_channels",
                d.patch_size, d.out_channels, d.in_channels
            ),
        ));
    }
    if d.num_single_layers == 0 {
        return Err(engine_refusal(
            "model.diffusers.num_single_layers",
            "0: the ditmem-cpu engine's Flux ends on the joint stream; allowed: 1 or more",
        ));
    }
    refuse_engine_dropout(spec, "Flux")
}

/// The LoRA modules of a family spec: the spec's, or its family's script default.
pub fn lora_modules(spec: &Spec) -> Vec<String> {
    let default: &[&str] = match family(spec).ok().flatten() {
        Some(fm) => fm.family.facts().lora_modules,
        None => &families::DEFAULT_LORA_MODULES,
    };
    match &spec.recipe.lora {
        Some(l) if !l.modules.is_empty() => l.modules.clone(),
        Some(_) => default.iter().map(|s| s.to_string()).collect(),
        None => Vec::new(),
    }
}

/// A block tensor's name relative to its block (`transformer_blocks.3.attn.to_q.weight` →
/// `attn.to_q.weight`): what follows the first all-digit component.
fn in_block(name: &str) -> Option<&str> {
    let mut rest = name;
    while let Some((head, tail)) = rest.split_once('.') {
        if !head.is_empty() && head.bytes().all(|c| c.is_ascii_digit()) {
            return Some(tail);
        }
        rest = tail;
    }
    None
}

/// The ditmem-cpu budget replays one block of each kind for every block of the model, so LoRA
/// must adapt the same linears in each: a module key that names a block (`--lora_blocks`'s
/// `transformer_blocks.12.attn.to_q`) is refused, naming the field.
fn check_engine_lora(spec: &Spec, fm: &FamilyModel) -> Result<(), SpecError> {
    if spec.recipe.lora.is_none() {
        return Ok(());
    }
    let modules = lora_modules(spec);
    let adapts = |m: &str| modules.iter().any(|k| matches_module(m, k));
    for t in fm.dims.table() {
        let Some(rel) = in_block(&t.name) else {
            continue;
        };
        let (full, rel) = (module_of(&t.name), module_of(rel));
        if is_linear_weight(&t) && adapts(full) != adapts(rel) {
            return Err(SpecError::invalid(
                "recipe.lora.modules",
                format!(
                    "{modules:?} adapts {full} but not the same linear of every block: the \
                     ditmem-cpu budget replays one block for all; allowed: names every block \
                     shares (to_q, attn.to_k, ff.net.2 …), or --runtime pytorch"
                ),
            ));
        }
    }
    Ok(())
}

/// PEFT's `check_target_module_exists` for a list of names: the module's full name equals the
/// key or ends with `.key`.
pub fn matches_module(module: &str, key: &str) -> bool {
    module == key
        || (module.len() > key.len()
            && module.ends_with(key)
            && module.as_bytes()[module.len() - key.len() - 1] == b'.')
}

fn module_of(tensor: &str) -> &str {
    tensor.rsplit_once('.').map_or(tensor, |(m, _)| m)
}

/// A 2-D `.weight` of a module: the tables hold Linear weights as (out, in) and nothing else
/// 2-D under a `.weight` name except embedding tables, which no LoRA default names.
fn is_linear_weight(t: &FamilyTensor) -> bool {
    t.kind == TensorKind::Param && t.shape.len() == 2 && t.name.ends_with(".weight")
}

fn module_for(g: Group) -> Module {
    match g {
        Group::PatchEmbed => Module::PatchEmbed,
        Group::PosEmbed | Group::Rope => Module::PosEmbed,
        Group::TimeEmbed => Module::TimestepEmbed,
        Group::ClassEmbed => Module::LabelEmbed,
        Group::TextEmbed => Module::TextEmbed,
        Group::Blocks => Module::TransformerBlocks,
        Group::SingleBlocks => Module::SingleBlocks,
        Group::FinalLayer => Module::FinalLayer,
    }
}

/// Every tensor the model holds under the spec: the original DiT's table, or the family's
/// table with the recipe's roles (LoRA freezes the base and adds A (r × in) and B (out × r) to
/// every matched Linear, as PEFT's `lora_A` / `lora_B`), buffers marked as such.
pub fn param_table(spec: &Spec) -> Vec<ParamTensor> {
    let fm = match family(spec) {
        Ok(Some(fm)) => fm,
        // The original DiT, or a config `check` refuses (estimate checks before it counts).
        _ => return params::param_table(spec),
    };
    let lora = spec.recipe.lora.as_ref();
    let modules = lora_modules(spec);
    let base = if lora.is_some() {
        ParamRole::Frozen
    } else {
        ParamRole::Trained
    };
    let mut v = Vec::new();
    for t in fm.dims.table() {
        let module = module_for(t.group);
        let buffer = t.kind != TensorKind::Param;
        let role = if buffer || t.fixed {
            ParamRole::Frozen
        } else {
            base
        };
        let adapted = lora.filter(|_| {
            is_linear_weight(&t)
                && modules
                    .iter()
                    .any(|k| matches_module(module_of(&t.name), k))
        });
        let (out, inp) = (t.shape[0], *t.shape.last().unwrap_or(&0));
        let prefix = module_of(&t.name).to_string();
        v.push(ParamTensor {
            name: t.name,
            shape: t.shape,
            role,
            module,
            block: t.block,
            buffer,
        });
        if let Some(l) = adapted {
            let r = u64::from(l.rank);
            for (name, shape) in [
                (format!("{prefix}.lora_A.default.weight"), vec![r, inp]),
                (format!("{prefix}.lora_B.default.weight"), vec![out, r]),
            ] {
                v.push(ParamTensor {
                    name,
                    shape,
                    role: ParamRole::Trained,
                    module: Module::Lora,
                    block: v.last().and_then(|p: &ParamTensor| p.block),
                    buffer: false,
                });
            }
        }
    }
    v
}
