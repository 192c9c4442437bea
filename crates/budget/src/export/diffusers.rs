//! The diffusers target: the launch command of the family's diffusers example script (with
//! only the flags it has, what it cannot do said), or a placeholder for your own script, and
//! the shell file around it.

use super::accelerate::launcher;
use super::scripts::{script_for, NoScript, Script, DIFFUSERS_COMMIT, DIFFUSERS_TAG};
use super::types::{header, s, Command, ExportOptions, Target};
use crate::sharding::{Offload, Sharder};
use crate::spec::{AttentionMode, Latents, Optimizer, Precision, Recompute, Spec, TextEncoders};

/// The launch command: the family's diffusers script with only the flags it has, or a
/// placeholder script where diffusers has none.
pub(super) fn command(
    spec: &Spec,
    o: &ExportOptions,
    mp: &str,
    ckpt: bool,
    config_file: bool,
    notes: &mut Vec<String>,
    cannot: &mut Vec<String>,
) -> Command {
    let r = &spec.recipe;
    // ZeRO-Offload with the scripts' torch AdamW needs "zero_force_ds_cpu_optimizer": false
    // (deepspeed 0.19.8 runtime/engine.py _configure_basic_optimizer), which no launch flag sets:
    // such a plan launches through the config files.
    let offload_ds =
        r.zero_stage > 0 && o.sharder == Sharder::Deepspeed && o.offload != Offload::None;
    if offload_ds && !config_file {
        notes.push(format!(
            "ZeRO-Offload launches through {} and {} (--emit accelerate, --emit deepspeed): the \
             script's torch AdamW needs \"zero_force_ds_cpu_optimizer\": false, which no launch \
             flag sets",
            Target::Accelerate.file_name(),
            Target::Deepspeed.file_name()
        ));
    }
    let launcher = launcher(spec, o, mp, config_file || offload_ds);
    let found = if o.launcher.runs_script() {
        script_for(o.family, r.lora.is_some())
    } else {
        Err(NoScript {
            reason: "launcher custom: your own train script, which pulls the levers no diffusers \
                     script flag does; ditmem_recipe.py (--emit-dir) holds the code for them",
        })
    };
    let script = match found {
        Ok(s) => s,
        Err(e) => {
            own_script_notes(spec, mp, ckpt, e, notes);
            return Command {
                launcher,
                script: "your_train_script.py".into(),
                script_source: None,
                script_args: Vec::new(),
            };
        }
    };
    let args = script_args(spec, o, (mp, ckpt), &script, notes, cannot);
    Command {
        launcher,
        script: script.file_name().into(),
        script_source: Some(format!(
            "huggingface/diffusers {DIFFUSERS_TAG} ({DIFFUSERS_COMMIT}) {}",
            script.path
        )),
        script_args: args,
    }
}

/// The notes for your own train script, where diffusers has none for the plan (`e` says why):
/// what the script must do to be the plan that was counted.
fn own_script_notes(spec: &Spec, mp: &str, ckpt: bool, e: NoScript, notes: &mut Vec<String>) {
    let r = &spec.recipe;
    let w = &spec.workload;
    notes.push(format!("{} (diffusers {DIFFUSERS_TAG})", e.reason));
    if let Some(id) = model_id(spec) {
        notes.push(format!("the model: {id}"));
    }
    let depth = spec.model.depth;
    if !matches!(
        r.recompute,
        Recompute::None | Recompute::All | Recompute::AttentionOnly
    ) {
        let blocks: Vec<u32> = (0..depth)
            .filter(|&i| r.recompute.recomputes_block(i))
            .collect();
        notes.push(format!(
            "recompute exactly {} of {depth} blocks ({}, in the order the model runs \
             them): ditmem_recipe.checkpoint_blocks(transformer, {:?}) wraps each in \
             torch.utils.checkpoint (use_reentrant=False); do not call \
             enable_gradient_checkpointing()",
            blocks.len(),
            r.recompute,
            blocks
        ));
    }
    notes.push(format!(
        "your script: microbatch {} per process, gradient accumulation {} \
         (Accelerator(gradient_accumulation_steps={})), mixed precision {mp}{}{}",
        w.microbatch,
        w.accumulation,
        w.accumulation,
        if ckpt {
            ", gradient checkpointing on"
        } else {
            ""
        },
        if r.optimizer == Optimizer::AdamW8bit {
            ", bitsandbytes.optim.AdamW8bit"
        } else {
            ""
        }
    ));
    if let Some(l) = &r.lora {
        let on = if !l.modules.is_empty() {
            l.modules.join(", ")
        } else if spec.model.diffusers.is_some() {
            // spec.rs LoraSpec::modules: empty is the family's default.
            "to_q, to_k, to_v, to_out.0 (the family's default)".to_string()
        } else {
            l.targets
                .iter()
                .map(|t| format!("{t:?}").to_ascii_lowercase())
                .collect::<Vec<_>>()
                .join(", ")
        };
        notes.push(format!(
            "LoRA rank {} on {on} with the base frozen: peft LoraConfig(r={}, \
             target_modules=…) (ditmem_recipe.add_lora)",
            l.rank, l.rank
        ));
    }
    if r.latents == Latents::Cached {
        notes.push(
            "latents cached: encode the dataset with the VAE beforehand and feed latents \
             (no VAE in the step)"
                .into(),
        );
    }
    if let Some(n) = base_quant_note(r.base_quant) {
        notes.push(n);
    }
    if let Some(n) = text_encoders_note(r.text_encoders) {
        notes.push(n);
    }
    if r.attention == AttentionMode::MemoryEfficient {
        notes.push(
            "attention memory-efficient: PyTorch SDPA (diffusers' default attention \
             processor) or xformers; no config key"
                .into(),
        );
    }
    if r.ema.enabled {
        notes.push(
            "EMA: keep an EMA copy in your script (diffusers.training_utils.EMAModel)".into(),
        );
    }
}

/// The arguments of a diffusers script being built: a flag goes in where the script has it,
/// else what it cannot do goes to `cannot`.
struct Args<'a> {
    script: &'a Script,
    args: Vec<String>,
}

impl Args<'_> {
    fn flag(&mut self, name: &str, value: Option<String>, missing: &str, cannot: &mut Vec<String>) {
        if self.script.has(name) {
            self.args.push(s(name));
            if let Some(v) = value {
                self.args.push(v);
            }
        } else {
            let file = self.script.file_name();
            cannot.push(format!("{missing} ({file} has no {name})"));
        }
    }
}

/// The arguments of the family's diffusers `script` for the plan: its required ones (the model
/// where the plan names it), then the workload's and the recipe's flags
/// ([`workload_flags`], [`recipe_flags`]), with the notes on what it does and cannot do.
fn script_args(
    spec: &Spec,
    o: &ExportOptions,
    (mp, ckpt): (&str, bool),
    script: &Script,
    notes: &mut Vec<String>,
    cannot: &mut Vec<String>,
) -> Vec<String> {
    let r = &spec.recipe;
    let mut args: Vec<String> = Vec::new();
    let id = model_id(spec);
    for (flag, value) in script.required {
        match (*flag, &id) {
            ("--pretrained_model_name_or_path", Some(id)) => args.extend([s(flag), id.clone()]),
            _ => args.extend([s(flag), s(value)]),
        }
    }
    for b in crate::launch::behaviours(script) {
        notes.push(format!(
            "the plan follows {}: {} ({})",
            script.file_name(),
            b.what,
            b.source
        ));
    }
    notes.push(format!(
        "{} and its data are placeholders: {} (diffusers {DIFFUSERS_TAG}) trains on \
         --instance_data_dir images with --instance_prompt; edit them",
        script
            .required
            .iter()
            .map(|(f, _)| *f)
            .collect::<Vec<_>>()
            .join(", "),
        script.path
    ));
    let file = script.file_name();
    if r.paged_optimizer {
        cannot.push(format!(
            "use the paged 8-bit AdamW ({file}'s --use_8bit_adam builds bnb.optim.AdamW8bit; \
             construct bnb.optim.PagedAdamW8bit in your copy)"
        ));
    }
    if let Some(n) = base_quant_note(r.base_quant) {
        cannot.push(format!(
            "store the frozen base quantized ({file} has no flag for it): {n}"
        ));
    }
    if let Some(n) = script_text_encoders_note(file, r.text_encoders) {
        notes.push(n);
    }
    let mut a = Args { script, args };
    workload_flags(&mut a, spec, (mp, ckpt), cannot);
    recipe_flags(&mut a, spec, o, notes, cannot);
    a.args
}

/// The workload's flags: precision, resolution, microbatch, accumulation, checkpointing, the
/// text tokens, TF32.
fn workload_flags(a: &mut Args, spec: &Spec, (mp, ckpt): (&str, bool), cannot: &mut Vec<String>) {
    let r = &spec.recipe;
    let w = &spec.workload;
    let file = a.script.file_name();
    a.flag(
        "--mixed_precision",
        Some(s(mp)),
        "set the precision",
        cannot,
    );
    a.flag(
        "--resolution",
        Some(s(w.height.max(w.width))),
        "set the resolution",
        cannot,
    );
    a.flag(
        "--train_batch_size",
        Some(s(w.microbatch)),
        "set the microbatch",
        cannot,
    );
    a.flag(
        "--gradient_accumulation_steps",
        Some(s(w.accumulation)),
        "accumulate gradients",
        cannot,
    );
    if ckpt {
        a.flag(
            "--gradient_checkpointing",
            None,
            "recompute activations",
            cannot,
        );
    }
    // The text tokens the plan counts reach the script as its --max_sequence_length (T5 for
    // Flux and SD3, Gemma-2 for Sana; CLIP's 77 are fixed by its tokenizer): without it the
    // script pads to its own default (`launch::script_text_tokens`), whatever the plan counted.
    if let (Some(tokens), Some(default)) = (
        &w.text_tokens,
        crate::launch::script_text_tokens(file, spec),
    ) {
        if tokens.as_slice() != default {
            let fixed = &default[..default.len() - 1];
            match tokens.split_last() {
                Some((last, head)) if head == fixed => a.flag(
                    "--max_sequence_length",
                    Some(s(last)),
                    "set the text tokens",
                    cannot,
                ),
                _ => cannot.push(format!(
                    "encode {tokens:?} text tokens ({file} pads its last text encoder to \
                     --max_sequence_length; the tokens before it are fixed at {fixed:?})"
                )),
            }
        }
    }
    if r.tf32 {
        // The plan's times price fp32 matmuls at the TF32 rate (`recipe.tf32`).
        a.flag("--allow_tf32", None, "allow TF32 matmuls", cannot);
    }
}

/// The recipe's flags: optimizer, LoRA, text encoders, latents, EMA, attention; and what the
/// script cannot train (precision, non-square crops, ZeRO's save-state trap).
fn recipe_flags(
    a: &mut Args,
    spec: &Spec,
    o: &ExportOptions,
    notes: &mut Vec<String>,
    cannot: &mut Vec<String>,
) {
    let r = &spec.recipe;
    let w = &spec.workload;
    let script = a.script;
    let file = script.file_name();
    match r.optimizer {
        Optimizer::AdamW => {}
        Optimizer::AdamW8bit => a.flag("--use_8bit_adam", None, "use 8-bit AdamW", cannot),
        Optimizer::Sgd => cannot.push(format!(
            "train with SGD ({} builds AdamW or Prodigy: --optimizer)",
            file
        )),
    }
    if let Some(l) = &r.lora {
        a.flag("--rank", Some(s(l.rank)), "set the LoRA rank", cannot);
        if l.modules.is_empty() {
            notes.push(format!(
                "LoRA targets: the plan counts the family's default modules; {} adapts its own \
                 defaults (--lora_layers to choose)",
                script.file_name()
            ));
        } else {
            a.flag(
                "--lora_layers",
                Some(l.modules.join(",")),
                "choose the LoRA targets",
                cannot,
            );
            notes.push(format!(
                "LoRA targets (PEFT target_modules, {} module names): {}",
                o.family.name(),
                l.modules.join(", ")
            ));
        }
    }
    if r.text_encoders == TextEncoders::Offloaded {
        a.flag(
            "--offload",
            None,
            "offload the text encoders to the CPU between encodes",
            cannot,
        );
    }
    if r.latents == Latents::Cached {
        a.flag("--cache_latents", None, "cache the latents", cannot);
    }
    if r.ema.enabled {
        a.flag(
            "--use_ema",
            None,
            "keep an EMA copy of the weights: the plan counts one, the run will not hold it \
             (peak below the plan's)",
            cannot,
        );
    }
    const XFORMERS: &str = "--enable_xformers_memory_efficient_attention";
    if r.attention == AttentionMode::MemoryEfficient {
        if script.has(XFORMERS) {
            a.flag(XFORMERS, None, "select xformers attention", cannot);
        } else {
            // Not a limit: the plan's memory-efficient attention is what the script runs anyway.
            notes.push(format!(
                "memory-efficient attention needs no flag: diffusers' default processor calls \
                 PyTorch SDPA, which picks a memory-efficient kernel on CUDA by itself ({file} \
                 has no {XFORMERS})"
            ));
        }
    }
    if matches!(r.precision, Precision::Fp64 | Precision::Bf16Pure) {
        cannot.push(format!(
            "train in {} ({} trains with --mixed_precision no, fp16 or bf16 only)",
            r.precision,
            script.file_name()
        ));
    }
    if w.height != w.width {
        notes.push(format!(
            "{} trains square crops (--resolution {}); the plan is {}×{}",
            script.file_name(),
            w.height.max(w.width),
            w.height,
            w.width
        ));
    }
    if r.zero_stage > 0 {
        if let Some(trap) = save_state_trap(script) {
            notes.push(trap);
        }
    }
}

/// The checkpoint a plan loads: the preset's checkpoint, or the config's `_name_or_path` (its
/// pipeline folder when it names the `transformer/` subfolder).
pub(crate) fn model_id(spec: &Spec) -> Option<String> {
    if let Some(src) = crate::families::preset_source(&spec.model.name) {
        return src.split_whitespace().next().map(str::to_string);
    }
    let p = spec
        .model
        .diffusers
        .as_ref()?
        .get("_name_or_path")?
        .as_str()?;
    let p = p.trim_end_matches('/');
    let p = p.strip_suffix("/transformer").unwrap_or(p);
    (!p.is_empty()).then(|| p.to_string())
}

/// What goes wrong when the script saves its state under DeepSpeed or FSDP (a sharded plan).
pub(super) fn save_state_trap(script: &Script) -> Option<String> {
    let (pop, save) = match script.file_name() {
        "train_dreambooth_flux.py" => ("1237", "1750"),
        "train_dreambooth_sd3.py" => ("1204", "1705"),
        "train_dreambooth_lora_flux.py" => ("1313", "1889"),
        "train_dreambooth_lora_sana.py" => ("1075", "1496"),
        // train_dreambooth_lora_sd3.py guards the pop (`if weights:`, 1320) and saves on every
        // rank under DeepSpeed (1869).
        _ => return None,
    };
    Some(format!(
        "trap at --checkpointing_steps: under DeepSpeed and FSDP accelerate's save_state hands \
         the save hook an empty `weights` list, and {f} pops from it unguarded (line {pop}: \
         IndexError); it also calls save_state on the main process only (line {save}) while \
         ZeRO's save_checkpoint needs every rank (a hang). Set --checkpointing_steps above \
         --max_train_steps, or guard the pop (`if weights: weights.pop()`) and call save_state \
         on every rank",
        f = script.file_name()
    ))
}

pub(super) fn diffusers_sh(
    spec: &Spec,
    cmd: &Command,
    notes: &[String],
    cannot: &[String],
) -> String {
    let mut t = format!("#!/usr/bin/env bash\n# {}\n", header(spec));
    match &cmd.script_source {
        Some(src) => t.push_str(&format!("# script: {src}\n")),
        None => t.push_str("# script: none in diffusers for this family (see the notes)\n"),
    }
    for n in notes {
        t.push_str(&format!("# note: {n}\n"));
    }
    for c in cannot {
        t.push_str(&format!("# the script cannot: {c}\n"));
    }
    t.push_str(&cmd.render());
    t
}

/// How a quantized LoRA base is loaded (diffusers' bitsandbytes quantization, peft's QLoRA
/// preparation); None when the base is not quantized.
pub(super) fn base_quant_note(q: crate::spec::BaseQuant) -> Option<String> {
    use crate::spec::BaseQuant;
    let how = match q {
        BaseQuant::None => return None,
        BaseQuant::Nf4 => {
            "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\", \
             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=weight_dtype)"
        }
        BaseQuant::Int8 => "BitsAndBytesConfig(load_in_8bit=True)",
        BaseQuant::Fp8 => "transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn)",
    };
    Some(format!(
        "base {}: load the transformer with {how} (diffusers' quantization), then \
         peft.prepare_model_for_kbit_training before adding the LoRA adapters",
        q.name()
    ))
}

/// Where the plan's text encoders are, as the named diffusers script places them.
/// `train_dreambooth_lora_flux.py` keeps CLIP and T5 in its `text_encoders` list and encodes the
/// prompts of every batch, a fixed `--instance_prompt` included (v0.40.0 :1738-1740; measured:
/// an encoder run in every step, bench/ecosystem/runs/2026-12-06-epyc-end-to-end).
pub(super) fn script_text_encoders_note(
    file: &str,
    t: crate::spec::TextEncoders,
) -> Option<String> {
    if file == "train_dreambooth_lora_flux.py" && t == crate::spec::TextEncoders::Online {
        return Some(
            "text encoders online: train_dreambooth_lora_flux.py keeps CLIP and T5 on the \
             device in weight_dtype and encodes every batch's prompts, a fixed \
             --instance_prompt included (:1738-1740)"
                .into(),
        );
    }
    text_encoders_note(t)
}

/// Where the plan's text encoders are, as the diffusers scripts place them.
pub(super) fn text_encoders_note(t: crate::spec::TextEncoders) -> Option<String> {
    use crate::spec::TextEncoders;
    match t {
        TextEncoders::Cached => None,
        TextEncoders::Online => Some(
            "text encoders online: per-image captions (--caption_column) keep them on the device \
             in weight_dtype and encode every batch; a fixed --instance_prompt is encoded once \
             and the encoders freed (cached)"
                .into(),
        ),
        TextEncoders::Offloaded => Some(
            "text encoders offloaded: the scripts' --offload keeps them (and the VAE) on the CPU \
             between encodes"
                .into(),
        ),
    }
}
