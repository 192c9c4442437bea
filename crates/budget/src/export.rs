//! Export a plan to the configuration of a training stack: an `accelerate` config file, a
//! DeepSpeed JSON config (for accelerate, or on its own), or the `accelerate launch` command of
//! the diffusers example script that trains the model's family.
//!
//! Every lever of the spec is mapped where the target has an equivalent; where it has none (a
//! partial block-recompute count, attention-only recompute, bf16-pure, …) the export says so in
//! [`Export::notes`], and what the named train script cannot do (EMA, an xformers flag, SGD, …)
//! in [`Export::cannot`], instead of pretending. Each rule names the file it comes from in
//! accelerate 1.15.0, DeepSpeed 0.19.8 or diffusers v0.40.0; `bench/ecosystem/check.py` loads
//! every export with those libraries.

use crate::error::SpecError;
use crate::launch::Launcher;
use crate::sharder::Conflict;
use crate::spec::{Precision, Recompute, Spec};

mod accelerate;
mod deepspeed;
mod diffusers;
mod recipe_py;
mod scripts;
#[cfg(test)]
mod tests;
mod types;
mod yaml;

pub(crate) use crate::sharding::{Offload, Sharder};
pub(crate) use diffusers::model_id;
pub(crate) use scripts::script_for;
pub(crate) use scripts::Script;
pub(crate) use scripts::DIFFUSERS_TAG;
pub use types::{Command, Export, ExportOptions, Target};

use accelerate::accelerate_yaml;
use deepspeed::deepspeed_json;
use diffusers::{command, diffusers_sh};

/// The `--mixed_precision` value of accelerate and the diffusers scripts (accelerate 1.15
/// `utils/dataclasses.py` `PrecisionType`: no, fp8, fp16, bf16) and what it cannot express.
fn mixed_precision(p: Precision, notes: &mut Vec<String>) -> &'static str {
    match p {
        Precision::Bf16Mixed => "bf16",
        Precision::Fp16Mixed => "fp16",
        Precision::Fp32 => "no",
        Precision::Fp64 => {
            notes.push(
                "precision fp64 has no mixed_precision value: \"no\" (fp32), and cast the model \
                 with model.double() in your script"
                    .into(),
            );
            "no"
        }
        Precision::Bf16Pure => {
            notes.push(
                "precision bf16-pure (weights stored in bf16) has no mixed_precision value: \"no\", \
                 and cast the model with model.to(torch.bfloat16) in your script, keeping AdamW \
                 state in fp32"
                    .into(),
            );
            "no"
        }
    }
}

/// How the spec's recompute maps onto whole-model gradient checkpointing (your own script under
/// `--launcher custom` wraps exactly the plan's blocks instead: see `command`).
fn checkpointing(spec: &Spec, custom: bool, notes: &mut Vec<String>) -> bool {
    let depth = spec.model.depth;
    match &spec.recipe.recompute {
        Recompute::EveryK(_) | Recompute::Blocks(_) if custom => false,
        Recompute::None => false,
        Recompute::All => true,
        Recompute::AttentionOnly => {
            notes.push(
                "recompute attention-only has no flag: wrap only the attention core in \
                 torch.utils.checkpoint (gradient checkpointing of whole blocks would save more \
                 memory and cost more time than planned)"
                    .into(),
            );
            false
        }
        rc => {
            let k = rc.recomputed_count(depth);
            notes.push(format!(
                "the plan recomputes {k} of {depth} blocks ({rc}); gradient checkpointing is all or \
                 nothing in these tools: enabling it (as exported) recomputes all {depth} — peak at \
                 or below the plan's, step slower than predicted; for exactly {k}, wrap those blocks \
                 in torch.utils.checkpoint"
            ));
            true
        }
    }
}

/// The combinations of sharder, offload and ZeRO stage that exist.
fn check_options(spec: &Spec, o: &ExportOptions) -> Result<(), SpecError> {
    let z = spec.recipe.zero_stage;
    let ranks = spec.workload.ranks;
    let g = o.gpus_per_node;
    // accelerate launch starts num_processes / num_machines processes per machine (1.15
    // commands/launch.py, prepare_multi_gpu_env: nproc_per_node).
    if g == 0 || (ranks > g && !ranks.is_multiple_of(g)) {
        return Err(SpecError::invalid(
            "plan.gpus-per-node",
            format!(
                "{g} GPUs per node do not divide the plan's {ranks} ranks; allowed: a divisor \
                 of the ranks, or at least the ranks (one node)"
            ),
        ));
    }
    let Some(c) = Conflict::of(z, o.sharder, o.offload) else {
        return Ok(());
    };
    let (field, message) = match c {
        Conflict::OffloadUnsharded => (
            "plan.emit-offload",
            "offload needs a sharded plan (ZeRO stage 1-3); allowed: none without sharding".into(),
        ),
        Conflict::DeepspeedParamsBelowStage3 => (
            "plan.emit-offload",
            format!(
                "DeepSpeed offloads parameters only at ZeRO stage 3 (the plan has stage {z}); \
                 allowed: none, optimizer"
            ),
        ),
        Conflict::FsdpStage1 => (
            "plan.emit-sharder",
            "FSDP has no ZeRO-1 equivalent (it always shards gradients); allowed: deepspeed for \
             a stage-1 plan"
                .into(),
        ),
        Conflict::FsdpOptimizerOnly => (
            "plan.emit-offload",
            "FSDP offloads parameters, gradients and optimizer state together; allowed: none, \
             optimizer+params"
                .into(),
        ),
    };
    Err(SpecError::invalid(field, message))
}

/// The sharder and offload an export writes: the options' where they name one, else the
/// plan's own (`recipe.sharder`, `recipe.offload`, which the budget counted).
fn effective_options(spec: &Spec, options: &ExportOptions) -> ExportOptions {
    let r = &spec.recipe;
    ExportOptions {
        sharder: if options.sharder.is_default() {
            r.sharder
        } else {
            options.sharder
        },
        offload: if options.offload.is_none() {
            r.offload
        } else {
            options.offload
        },
        ..*options
    }
}

/// Export the plan `spec` for `target`.
pub fn export(spec: &Spec, target: Target, options: &ExportOptions) -> Result<Export, SpecError> {
    let effective = effective_options(spec, options);
    let o = &effective;
    check_options(spec, o)?;
    let mut notes = Vec::new();
    let mut cannot = Vec::new();
    let mp = mixed_precision(spec.recipe.precision, &mut notes);
    let ckpt = checkpointing(spec, options.launcher == Launcher::Custom, &mut notes);
    let sharded = spec.recipe.zero_stage > 0;
    if o.offload != spec.recipe.offload || (sharded && o.sharder != spec.recipe.sharder) {
        notes.push(format!(
            "the export launches {} with offload {}, the plan was budgeted for {} with offload {}: \
             plan with --sharder {} --offload {} to count what this launch keeps on the device",
            o.sharder,
            o.offload,
            spec.recipe.sharder,
            spec.recipe.offload,
            o.sharder,
            o.offload
        ));
    }
    let (text, command) = match target {
        Target::Accelerate => {
            let cmd = command(spec, o, mp, ckpt, true, &mut notes, &mut cannot);
            (accelerate_yaml(spec, o, mp, &cmd, &mut notes), Some(cmd))
        }
        Target::Deepspeed => {
            if !sharded || o.sharder != Sharder::Deepspeed {
                notes.push(
                    "the plan is not launched with DeepSpeed (no ZeRO stage, or FSDP): this \
                     config is what a DeepSpeed launch of it would read"
                        .into(),
                );
            }
            let cmd = command(spec, o, mp, ckpt, true, &mut notes, &mut cannot);
            (deepspeed_json(spec, o, false, ckpt, &mut notes), Some(cmd))
        }
        Target::DeepspeedStandalone => (deepspeed_json(spec, o, true, ckpt, &mut notes), None),
        Target::Diffusers => {
            let cmd = command(spec, o, mp, ckpt, false, &mut notes, &mut cannot);
            (diffusers_sh(spec, &cmd, &notes, &cannot), Some(cmd))
        }
    };
    Ok(Export {
        target,
        file_name: target.file_name(),
        text,
        notes,
        cannot,
        command,
        options: *o,
    })
}

/// Every file one plan's launch needs, by file name: the `exports`, the `ds_config.json` an
/// accelerate DeepSpeed config names (and the accelerate config a ZeRO-Offload launch goes
/// through), and for your own script `ditmem_recipe.py`.
pub fn export_files(
    spec: &Spec,
    exports: &[Export],
    options: &ExportOptions,
) -> Result<Vec<(String, String)>, SpecError> {
    let mut out: Vec<(String, String)> = exports
        .iter()
        .map(|e| (e.file_name.to_string(), e.text.clone()))
        .collect();
    let o = effective_options(spec, options);
    let ds = spec.recipe.zero_stage > 0 && o.sharder == Sharder::Deepspeed;
    let offload_ds = ds && o.offload != Offload::None;
    let launches_yaml = exports.iter().any(|e| {
        e.command
            .as_ref()
            .is_some_and(|c| c.launcher.iter().any(|a| a == "--config_file"))
    });
    let mut need = Vec::new();
    if offload_ds && launches_yaml {
        need.push(Target::Accelerate);
    }
    if ds && (launches_yaml || need.contains(&Target::Accelerate)) {
        need.push(Target::Deepspeed);
    }
    for t in need {
        if !out.iter().any(|(n, _)| n == t.file_name()) {
            let e = export(spec, t, options)?;
            out.push((e.file_name.to_string(), e.text));
        }
    }
    if options.launcher == Launcher::Custom {
        out.push((
            "ditmem_recipe.py".to_string(),
            recipe_py::recipe_py(spec, model_id(spec).as_deref()),
        ));
    }
    Ok(out)
}
