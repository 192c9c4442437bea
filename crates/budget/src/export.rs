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

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::error::SpecError;
use crate::families::Family;
use crate::launch::Launcher;
use crate::spec::{AttentionMode, Latents, Optimizer, Precision, Recompute, Spec, TextEncoders};

mod recipe_py;
mod scripts;
mod yaml;

pub use scripts::{block_classes, script_for, NoScript, Script, DIFFUSERS_COMMIT, DIFFUSERS_TAG};
use yaml::Yaml;

/// Which stack to export for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    /// `accelerate launch --config_file accelerate_config.yaml` (DeepSpeed plans name
    /// `ds_config.json`, the [`Target::Deepspeed`] export, beside it).
    Accelerate,
    /// A DeepSpeed config for accelerate: `"auto"` where accelerate fills values, no optimizer.
    Deepspeed,
    /// A DeepSpeed config on its own (`deepspeed` launcher, the script calls
    /// `deepspeed.initialize`): fixed values, valid at the plan's world size only.
    DeepspeedStandalone,
    /// The `accelerate launch` command of the diffusers script that trains the family.
    Diffusers,
}

impl Target {
    pub const ALL: [Target; 4] = [
        Target::Accelerate,
        Target::Deepspeed,
        Target::DeepspeedStandalone,
        Target::Diffusers,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Target::Accelerate => "accelerate",
            Target::Deepspeed => "deepspeed",
            Target::DeepspeedStandalone => "deepspeed-standalone",
            Target::Diffusers => "diffusers",
        }
    }

    /// The file name of the export (the accelerate config names `ds_config.json`).
    pub const fn file_name(self) -> &'static str {
        match self {
            Target::Accelerate => "accelerate_config.yaml",
            Target::Deepspeed => "ds_config.json",
            Target::DeepspeedStandalone => "ds_config_standalone.json",
            Target::Diffusers => "train.sh",
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Target {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "accelerate" => Ok(Target::Accelerate),
            "deepspeed" | "ds" => Ok(Target::Deepspeed),
            "deepspeed-standalone" | "ds-standalone" => Ok(Target::DeepspeedStandalone),
            "diffusers" => Ok(Target::Diffusers),
            _ => Err(SpecError::invalid(
                "plan.emit",
                format!(
                    "'{}' is not an export target; allowed: accelerate, deepspeed, \
                     deepspeed-standalone, diffusers",
                    s.chars().take(60).collect::<String>()
                ),
            )),
        }
    }
}

pub use crate::sharding::{Offload, Sharder};

/// What the export needs beyond the spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ExportOptions {
    /// The model's family: which diffusers script trains it and which block class FSDP wraps.
    /// The spec does not carry it yet; [`Family::Dit`] (what the budget models) by default.
    pub family: Family,
    /// How a sharded plan launches; the default (deepspeed) defers to the plan's
    /// `recipe.sharder`.
    pub sharder: Sharder,
    /// What a sharded plan offloads; the default (none) defers to the plan's `recipe.offload`.
    pub offload: Offload,
    /// Who launches it: the family's diffusers script (default, where the family has one) or
    /// your own script ([`Launcher::Custom`]: a placeholder, with the code for what no flag does).
    pub launcher: Launcher,
    /// GPUs per node: the plan's ranks run on `ceil(ranks / gpus_per_node)` machines.
    pub gpus_per_node: u32,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            family: Family::Dit,
            sharder: Sharder::Deepspeed,
            offload: Offload::None,
            launcher: Launcher::Diffusers,
            gpus_per_node: 8,
        }
    }
}

impl ExportOptions {
    /// Machines of a launch of `ranks` processes.
    pub fn machines(&self, ranks: u32) -> u32 {
        ranks.div_ceil(self.gpus_per_node.max(1))
    }
}

/// A command line: `launcher… script script_args…`, each element one argument (unquoted).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Command {
    /// `accelerate launch` and its arguments.
    pub launcher: Vec<String>,
    /// The train script (a diffusers example's file name, or a placeholder for your own).
    pub script: String,
    /// Where the script lives in diffusers, with the tag it was read from; `None` for a
    /// placeholder.
    pub script_source: Option<String>,
    pub script_args: Vec<String>,
}

impl Command {
    /// The command as one shell line, continued over lines, arguments quoted where needed.
    pub fn render(&self) -> String {
        // `accelerate launch` on the first line (after any `NAME=value` environment settings),
        // then one flag (and its value) per line.
        let env = self
            .launcher
            .iter()
            .take_while(|a| !a.starts_with('-') && a.contains('='))
            .count();
        let head = self.launcher.len().min(env + 2);
        let shown: Vec<String> = self.launcher[..head]
            .iter()
            .enumerate()
            .map(|(i, a)| match a.split_once('=') {
                Some((name, value)) if i < env => format!("{name}={}", sh_quote(value)),
                _ => a.clone(),
            })
            .collect();
        let mut lines = vec![shown.join(" ")];
        pairs(&self.launcher[head..], &mut lines);
        lines.push(format!("  {}", sh_quote(&self.script)));
        pairs(&self.script_args, &mut lines);
        lines.join(" \\\n") + "\n"
    }
}

/// `--flag value` pairs (or lone switches), one per line, quoted for the shell.
fn pairs(args: &[String], lines: &mut Vec<String>) {
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        match args.get(i + 1) {
            Some(v) if !v.starts_with("--") => {
                lines.push(format!("  {} {}", sh_quote(a), sh_quote(v)));
                i += 2;
            }
            _ => {
                lines.push(format!("  {}", sh_quote(a)));
                i += 1;
            }
        }
    }
}

/// `s` as one shell word.
fn sh_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./,:=+@".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The exported text and what it could not express.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Export {
    pub target: Target,
    pub file_name: &'static str,
    pub text: String,
    /// Levers of the plan with no (or only an approximate) equivalent in the target.
    pub notes: Vec<String>,
    /// What the train script named by the command cannot do that the plan counts (EMA, …).
    pub cannot: Vec<String>,
    /// The launch command (`None` for the standalone DeepSpeed config).
    pub command: Option<Command>,
    pub options: ExportOptions,
}

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
    if o.offload != Offload::None && z == 0 {
        return Err(SpecError::invalid(
            "plan.emit-offload",
            "offload needs a sharded plan (ZeRO stage 1-3); allowed: none without sharding",
        ));
    }
    match o.sharder {
        Sharder::Deepspeed => {
            // deepspeed 0.19.8 runtime/zero/config.py: offload_param is "valid only with stage 3".
            if o.offload == Offload::OptimizerAndParams && z < 3 {
                return Err(SpecError::invalid(
                    "plan.emit-offload",
                    format!(
                        "DeepSpeed offloads parameters only at ZeRO stage 3 (the plan has stage \
                         {z}); allowed: none, optimizer"
                    ),
                ));
            }
        }
        Sharder::Fsdp => {
            if z == 1 {
                return Err(SpecError::invalid(
                    "plan.emit-sharder",
                    "FSDP has no ZeRO-1 equivalent (it always shards gradients); allowed: \
                     deepspeed for a stage-1 plan",
                ));
            }
            // accelerate 1.15 utils/dataclasses.py FullyShardedDataParallelPlugin.cpu_offload:
            // FSDP offloads parameters, gradients and optimizer state together.
            if o.offload == Offload::Optimizer {
                return Err(SpecError::invalid(
                    "plan.emit-offload",
                    "FSDP offloads parameters, gradients and optimizer state together; allowed: \
                     none, optimizer+params",
                ));
            }
        }
    }
    Ok(())
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

fn s(x: impl ToString) -> String {
    x.to_string()
}

/// `accelerate launch` and its arguments (accelerate 1.15 `commands/launch.py`
/// `launch_command_parser`). With `config_file` the distribution comes from
/// `accelerate_config.yaml`; without, from flags: `--use_deepspeed --zero_stage N` for a ZeRO
/// plan, `--use_fsdp --fsdp_version 2` for FSDP, `--multi_gpu` only for plain DDP (it would start
/// unsharded data parallelism, every rank holding the whole model state).
fn launcher(spec: &Spec, o: &ExportOptions, mp: &str, config_file: bool) -> Vec<String> {
    let w = &spec.workload;
    let z = spec.recipe.zero_stage;
    let mut a = vec![s("accelerate"), s("launch")];
    // The allocator settings of a CUDA plan (the planner adds `expandable_segments:True` where
    // fragmentation breaks the fit): an environment setting of the launch.
    if let (crate::spec::Runtime::Pytorch { .. }, Some(c)) = (&spec.runtime, &spec.cuda) {
        if !c.alloc_conf.is_empty() {
            a.insert(0, format!("PYTORCH_CUDA_ALLOC_CONF={}", c.alloc_conf));
        }
    }
    if config_file {
        a.extend([s("--config_file"), s(Target::Accelerate.file_name())]);
    } else if z > 0 && o.sharder == Sharder::Deepspeed {
        let (opt, par) = offload_devices(o.offload);
        a.extend([
            s("--use_deepspeed"),
            s("--zero_stage"),
            s(z),
            s("--gradient_accumulation_steps"),
            s(w.accumulation),
            s("--offload_optimizer_device"),
            s(opt),
            s("--offload_param_device"),
            s(par),
        ]);
        if z == 3 {
            a.extend([s("--zero3_init_flag"), s("false")]);
        }
        a.extend([s("--num_processes"), s(w.ranks)]);
    } else if z > 0 {
        a.extend([
            s("--use_fsdp"),
            s("--fsdp_version"),
            s("2"),
            s("--fsdp_reshard_after_forward"),
            s(z == 3),
            s("--fsdp_offload_params"),
            s(o.offload == Offload::OptimizerAndParams),
            s("--fsdp_auto_wrap_policy"),
            s("TRANSFORMER_BASED_WRAP"),
            s("--fsdp_transformer_layer_cls_to_wrap"),
            s(block_classes(o.family)),
            s("--fsdp_state_dict_type"),
            s("SHARDED_STATE_DICT"),
            s("--num_processes"),
            s(w.ranks),
        ]);
    } else if w.ranks > 1 {
        a.extend([s("--multi_gpu"), s("--num_processes"), s(w.ranks)]);
    } else {
        a.extend([s("--num_processes"), s("1")]);
    }
    if !config_file {
        let machines = o.machines(w.ranks);
        a.extend([s("--num_machines"), s(machines)]);
        if machines > 1 {
            // One launch per node; this line is node 0's (see the notes for the others).
            a.extend([
                s("--machine_rank"),
                s("0"),
                s("--main_process_ip"),
                s(MAIN_NODE_IP),
                s("--main_process_port"),
                s(MAIN_PROCESS_PORT),
            ]);
        }
        a.extend([s("--dynamo_backend"), s("no")]);
    }
    // Passed on the command line, never from the YAML of a DeepSpeed plan: accelerate refuses a
    // mixed_precision read from the config file next to a deepspeed_config_file (1.15
    // commands/launch.py launch_command, utils/dataclasses.py _deepspeed_config_checks).
    a.extend([s("--mixed_precision"), s(mp)]);
    a
}

/// The main node's address in a multi-node launch: a placeholder to replace.
pub const MAIN_NODE_IP: &str = "MAIN_NODE_IP";
/// The rendezvous port of a multi-node launch (accelerate's default, 1.15 `commands/launch.py`).
pub const MAIN_PROCESS_PORT: &str = "29500";

fn offload_devices(o: Offload) -> (&'static str, &'static str) {
    match o {
        Offload::None => ("none", "none"),
        Offload::Optimizer => ("cpu", "none"),
        Offload::OptimizerAndParams => ("cpu", "cpu"),
    }
}

/// The launch command: the family's diffusers script with only the flags it has, or a
/// placeholder script where diffusers has none.
fn command(
    spec: &Spec,
    o: &ExportOptions,
    mp: &str,
    ckpt: bool,
    config_file: bool,
    notes: &mut Vec<String>,
    cannot: &mut Vec<String>,
) -> Command {
    let r = &spec.recipe;
    let w = &spec.workload;
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
                    "EMA: keep an EMA copy in your script (diffusers.training_utils.EMAModel)"
                        .into(),
                );
            }
            return Command {
                launcher,
                script: "your_train_script.py".into(),
                script_source: None,
                script_args: Vec::new(),
            };
        }
    };
    let mut args: Vec<String> = Vec::new();
    let id = model_id(spec);
    for (flag, value) in script.required {
        match (*flag, &id) {
            ("--pretrained_model_name_or_path", Some(id)) => args.extend([s(flag), id.clone()]),
            _ => args.extend([s(flag), s(value)]),
        }
    }
    for b in crate::launch::behaviours(&script) {
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
    let mut flag = |name: &str, value: Option<String>, missing: &str, cannot: &mut Vec<String>| {
        if script.has(name) {
            args.push(s(name));
            if let Some(v) = value {
                args.push(v);
            }
        } else {
            cannot.push(format!("{missing} ({file} has no {name})"));
        }
    };
    flag(
        "--mixed_precision",
        Some(s(mp)),
        "set the precision",
        cannot,
    );
    flag(
        "--resolution",
        Some(s(w.height.max(w.width))),
        "set the resolution",
        cannot,
    );
    flag(
        "--train_batch_size",
        Some(s(w.microbatch)),
        "set the microbatch",
        cannot,
    );
    flag(
        "--gradient_accumulation_steps",
        Some(s(w.accumulation)),
        "accumulate gradients",
        cannot,
    );
    if ckpt {
        flag(
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
                Some((last, head)) if head == fixed => flag(
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
        flag("--allow_tf32", None, "allow TF32 matmuls", cannot);
    }
    match r.optimizer {
        Optimizer::AdamW => {}
        Optimizer::AdamW8bit => flag("--use_8bit_adam", None, "use 8-bit AdamW", cannot),
        Optimizer::Sgd => cannot.push(format!(
            "train with SGD ({} builds AdamW or Prodigy: --optimizer)",
            file
        )),
    }
    if let Some(l) = &r.lora {
        flag("--rank", Some(s(l.rank)), "set the LoRA rank", cannot);
        if l.modules.is_empty() {
            notes.push(format!(
                "LoRA targets: the plan counts the family's default modules; {} adapts its own \
                 defaults (--lora_layers to choose)",
                script.file_name()
            ));
        } else {
            flag(
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
        flag(
            "--offload",
            None,
            "offload the text encoders to the CPU between encodes",
            cannot,
        );
    }
    if r.latents == Latents::Cached {
        flag("--cache_latents", None, "cache the latents", cannot);
    }
    if r.ema.enabled {
        flag(
            "--use_ema",
            None,
            "keep an EMA copy of the weights: the plan counts one, the run will not hold it \
             (peak below the plan's)",
            cannot,
        );
    }
    if r.attention == AttentionMode::MemoryEfficient {
        flag(
            "--enable_xformers_memory_efficient_attention",
            None,
            "select xformers attention; diffusers' default processor calls PyTorch SDPA, which \
             picks a memory-efficient kernel on CUDA by itself",
            cannot,
        );
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
        if let Some(trap) = save_state_trap(&script) {
            notes.push(trap);
        }
    }
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

/// The checkpoint a plan loads: the preset's checkpoint, or the config's `_name_or_path` (its
/// pipeline folder when it names the `transformer/` subfolder).
pub fn model_id(spec: &Spec) -> Option<String> {
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
fn save_state_trap(script: &Script) -> Option<String> {
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

fn header(spec: &Spec) -> String {
    let w = &spec.workload;
    format!(
        "{} at {}×{}: batch {} = microbatch {} × accumulation {} × {} processes",
        spec.model.name, w.height, w.width, w.batch, w.microbatch, w.accumulation, w.ranks
    )
}

/// The accelerate config (keys of accelerate 1.15 `commands/config/config_args.py`
/// `ClusterConfig`, strings quoted: see [`yaml`]).
fn accelerate_yaml(
    spec: &Spec,
    o: &ExportOptions,
    mp: &str,
    cmd: &Command,
    notes: &mut Vec<String>,
) -> String {
    let r = &spec.recipe;
    let w = &spec.workload;
    let z = r.zero_stage;
    let deepspeed = z > 0 && o.sharder == Sharder::Deepspeed;
    let fsdp = z > 0 && o.sharder == Sharder::Fsdp;
    let distributed = if deepspeed {
        "DEEPSPEED"
    } else if fsdp {
        "FSDP"
    } else if w.ranks > 1 {
        "MULTI_GPU"
    } else {
        "NO"
    };
    let mut m: Vec<(&'static str, Yaml)> = vec![
        ("compute_environment", Yaml::str("LOCAL_MACHINE")),
        ("debug", Yaml::Bool(false)),
    ];
    if deepspeed {
        // With a deepspeed_config_file, accelerate refuses the keys it reads from the file
        // (gradient_accumulation_steps, gradient_clipping, zero_stage, offload_*, mixed_precision:
        // utils/dataclasses.py DeepSpeedPlugin._deepspeed_config_checks); zero3_init_flag is not
        // among them. deepspeed.zero.Init is off: diffusers' from_pretrained builds the model on
        // each rank's CPU before accelerate partitions it, and the flag needs transformers.
        m.push((
            "deepspeed_config",
            Yaml::Map(vec![
                (
                    "deepspeed_config_file",
                    Yaml::str(Target::Deepspeed.file_name()),
                ),
                ("zero3_init_flag", Yaml::Bool(false)),
            ]),
        ));
        notes.push(format!(
            "accelerate_config.yaml names {}: keep both in the launch directory (--emit-dir \
             writes both); ZeRO stage, offload, accumulation and the precision (bf16/fp16 \
             enabled, for --mixed_precision {mp}) are in the JSON",
            Target::Deepspeed.file_name()
        ));
    }
    m.push(("distributed_type", Yaml::str(distributed)));
    m.push(("downcast_bf16", Yaml::str("no")));
    m.push(("enable_cpu_affinity", Yaml::Bool(false)));
    if fsdp {
        // FSDP2 keys as `accelerate config` writes them (1.15 commands/config/cluster.py).
        m.push((
            "fsdp_config",
            Yaml::Map(vec![
                ("fsdp_auto_wrap_policy", Yaml::str("TRANSFORMER_BASED_WRAP")),
                ("fsdp_cpu_ram_efficient_loading", Yaml::Bool(false)),
                (
                    "fsdp_offload_params",
                    Yaml::Bool(o.offload == Offload::OptimizerAndParams),
                ),
                ("fsdp_reshard_after_forward", Yaml::Bool(z == 3)),
                ("fsdp_state_dict_type", Yaml::str("SHARDED_STATE_DICT")),
                (
                    "fsdp_transformer_layer_cls_to_wrap",
                    Yaml::str(block_classes(o.family)),
                ),
                ("fsdp_version", Yaml::Int(2)),
            ]),
        ));
    }
    m.push(("gpu_ids", Yaml::str("all")));
    m.push(("machine_rank", Yaml::Int(0)));
    m.push(("main_training_function", Yaml::str("main")));
    if !deepspeed {
        m.push(("mixed_precision", Yaml::str(mp)));
    }
    let machines = o.machines(w.ranks);
    if machines > 1 {
        m.push(("main_process_ip", Yaml::str(MAIN_NODE_IP)));
        m.push((
            "main_process_port",
            Yaml::Int(MAIN_PROCESS_PORT.parse().unwrap_or(29500)),
        ));
    }
    m.push(("num_machines", Yaml::Int(i64::from(machines))));
    m.push(("num_processes", Yaml::Int(i64::from(w.ranks))));
    m.push(("rdzv_backend", Yaml::str("static")));
    m.push(("same_network", Yaml::Bool(true)));
    m.push(("use_cpu", Yaml::Bool(false)));

    let mut y = format!("# accelerate config for {}\n", header(spec));
    if machines > 1 {
        y.push_str(&format!(
            "# {machines} nodes × {} GPUs: copy this file to every node, set main_process_ip to \
             node 0's address and machine_rank to 0…{} on each node, then launch on every node\n",
            w.ranks / machines,
            machines - 1
        ));
    }
    if !deepspeed {
        // Outside DeepSpeed the file has no accumulation key; accelerate reads it from this
        // environment variable (or Accelerator(gradient_accumulation_steps=N), which the
        // diffusers scripts pass from --gradient_accumulation_steps).
        y.push_str(&format!(
            "# gradient_accumulation_steps {}: no key outside DeepSpeed; the script's \
             --gradient_accumulation_steps (or ACCELERATE_GRADIENT_ACCUMULATION_STEPS={})\n",
            w.accumulation, w.accumulation
        ));
    }
    y.push_str(&format!(
        "# per-process train batch (microbatch): {}\n# launch:\n",
        w.microbatch
    ));
    for line in cmd.render().lines() {
        y.push_str(&format!("#   {line}\n"));
    }
    y.push_str(&yaml::emit(&m));
    y
}

/// The DeepSpeed config. For accelerate (`standalone` false): `"auto"` for every value accelerate
/// fills (batch sizes and accumulation from the dataloader and Accelerator, clipping), explicit
/// fp16/bf16 (the YAML alone must keep the precision; accelerate checks a --mixed_precision
/// against them: accelerate 1.15 `accelerator.py` `_prepare_deepspeed`,
/// `utils/dataclasses.py` `DeepSpeedPlugin.set_mixed_precision`), so it works at any world size,
/// and no `optimizer` block: the diffusers scripts build their own optimizer, and accelerate
/// refuses both. Standalone: fixed values, valid at the plan's world size only (deepspeed 0.19.8
/// `runtime/config.py` `_configure_train_batch_size` checks batch = micro × accumulation × world).
fn deepspeed_json(
    spec: &Spec,
    o: &ExportOptions,
    standalone: bool,
    ckpt: bool,
    notes: &mut Vec<String>,
) -> String {
    use serde_json::{json, Value};
    let r = &spec.recipe;
    let w = &spec.workload;
    let (bf16, fp16) = match r.precision {
        Precision::Bf16Mixed => (true, false),
        Precision::Fp16Mixed => (false, true),
        Precision::Bf16Pure => {
            notes.push(
                "bf16-pure has no DeepSpeed equivalent (its bf16 mode keeps fp32 masters); \
                 bf16.enabled is the nearest"
                    .into(),
            );
            (true, false)
        }
        Precision::Fp32 | Precision::Fp64 => (false, false),
    };
    if r.precision == Precision::Bf16Mixed {
        notes.push(
            "DeepSpeed bf16 keeps bf16 weights plus fp32 master copies in the optimizer, not fp32 \
             weights cast per step as the plan's bf16-mixed: memory differs somewhat"
                .into(),
        );
    }
    let auto = || Value::from("auto");
    let mut zero = json!({
        "stage": r.zero_stage,
        "overlap_comm": true,
        "contiguous_gradients": true
    });
    let (opt_dev, par_dev) = offload_devices(o.offload);
    if opt_dev != "none" {
        zero["offload_optimizer"] = json!({ "device": opt_dev, "pin_memory": true });
    }
    if par_dev != "none" {
        zero["offload_param"] = json!({ "device": par_dev, "pin_memory": true });
    }
    // A standalone file carries the plan's batch figures; one beside accelerate's config leaves
    // them to accelerate ("auto").
    let (batch, micro, accumulation, clipping) = if standalone {
        (
            json!(w.batch),
            json!(w.microbatch),
            json!(w.accumulation),
            json!(1.0),
        )
    } else {
        (auto(), auto(), auto(), auto())
    };
    // Explicit, not "auto": `accelerate launch --config_file accelerate_config.yaml` alone (no
    // --mixed_precision) must keep the plan's precision, and the YAML cannot carry it beside a
    // deepspeed_config_file (see accelerate_yaml). A launch line's --mixed_precision that agrees
    // is accepted (accelerate 1.15 utils/dataclasses.py DeepSpeedPlugin.set_mixed_precision →
    // fill_match: only a differing value fails).
    let mut v = json!({
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clipping,
        "bf16": { "enabled": bf16 },
        "fp16": {
            "enabled": fp16,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1
        },
        "zero_optimization": zero,
        "steps_per_print": 100,
        "wall_clock_breakdown": false
    });
    if standalone {
        notes.push(format!(
            "{} holds fixed values for {} processes (train_batch_size {} = {} × {} × {}): \
             DeepSpeed refuses it at any other world size; launch your own script with \
             `deepspeed --num_gpus {} your_train_script.py --deepspeed --deepspeed_config {}`",
            Target::DeepspeedStandalone.file_name(),
            w.ranks,
            w.batch,
            w.microbatch,
            w.accumulation,
            w.ranks,
            w.ranks,
            Target::DeepspeedStandalone.file_name()
        ));
        match r.optimizer {
            Optimizer::AdamW => {
                v["optimizer"] = json!({
                    "type": "AdamW",
                    "params": { "lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0 }
                });
            }
            Optimizer::Sgd => v["optimizer"] = json!({ "type": "SGD", "params": { "lr": 1e-4 } }),
            Optimizer::AdamW8bit => notes.push(
                "8-bit AdamW is not a DeepSpeed optimizer: build bitsandbytes.optim.AdamW8bit in \
                 the script and pass it to deepspeed.initialize (no \"optimizer\" block is written)"
                    .into(),
            ),
        }
        if ckpt {
            let k = r.recompute.recomputed_count(spec.model.depth);
            v["activation_checkpointing"] = json!({
                "partition_activations": false,
                "cpu_checkpointing": false,
                "contiguous_memory_optimization": false,
                "number_checkpoints": k.max(1),
                "synchronize_checkpoint_boundary": false,
                "profile": false
            });
            notes.push(format!(
                "activation_checkpointing configures deepspeed.checkpointing; the model must call \
                 deepspeed.checkpointing.checkpoint on the {k} recomputed blocks itself"
            ));
        }
    } else {
        notes.push(
            "ds_config.json has no \"optimizer\" block: the diffusers scripts build their own \
             optimizer, and accelerate refuses an optimizer in both (accelerate 1.15 \
             accelerator.py _prepare_deepspeed)"
                .into(),
        );
        if ckpt {
            notes.push(
                "gradient checkpointing is the script's --gradient_checkpointing \
                 (torch.utils.checkpoint), not DeepSpeed's activation_checkpointing"
                    .into(),
            );
        }
    }
    if opt_dev != "none" && !standalone {
        // deepspeed 0.19.8 runtime/engine.py: ZeRO-Offload with a client optimizer that is not
        // DeepSpeedCPUAdam is refused unless this is false; the scripts pass torch's AdamW.
        v["zero_force_ds_cpu_optimizer"] = json!(false);
        notes.push(
            "ZeRO-Offload with the script's torch AdamW: zero_force_ds_cpu_optimizer is false \
             (DeepSpeed would refuse it otherwise); the optimizer step then runs torch's AdamW on \
             CPU, slower than DeepSpeedCPUAdam"
                .into(),
        );
    }
    serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
}

fn diffusers_sh(spec: &Spec, cmd: &Command, notes: &[String], cannot: &[String]) -> String {
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
fn base_quant_note(q: crate::spec::BaseQuant) -> Option<String> {
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
fn script_text_encoders_note(file: &str, t: crate::spec::TextEncoders) -> Option<String> {
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
fn text_encoders_note(t: crate::spec::TextEncoders) -> Option<String> {
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

#[cfg(test)]
mod tests {
    use super::yaml::tests::read_back;
    use super::*;

    /// LoRA of `rank` on the default targets, adapters in the default dtype.
    fn lora_of_rank(rank: u32) -> crate::spec::LoraSpec {
        crate::spec::LoraSpec {
            dtype: Default::default(),
            rank,
            targets: crate::spec::default_lora_targets(),
            modules: Vec::new(),
        }
    }

    fn xl() -> Spec {
        let mut s = Spec::default_xl();
        s.workload.microbatch = 8;
        s.workload.accumulation = 4;
        s
    }

    /// DiT-XL/2 over 8 ranks at ZeRO stage `z`.
    fn zero(z: u8) -> Spec {
        let mut s = xl();
        s.workload.ranks = 8;
        s.workload.accumulation = 1;
        s.workload.microbatch = 4;
        s.workload.batch = 32;
        s.recipe.zero_stage = z;
        s.validate().unwrap();
        s
    }

    fn opts(family: Family, sharder: Sharder, offload: Offload) -> ExportOptions {
        ExportOptions {
            family,
            sharder,
            offload,
            ..ExportOptions::default()
        }
    }

    fn get<'a>(m: &'a [(String, Yaml)], k: &str) -> Option<&'a Yaml> {
        m.iter().find(|(key, _)| key == k).map(|(_, v)| v)
    }

    #[test]
    fn accelerate_yaml_reads_back_with_the_intended_types() {
        let mut s = xl();
        s.recipe.precision = Precision::Fp32;
        let e = export(&s, Target::Accelerate, &ExportOptions::default()).unwrap();
        let m = read_back(&e.text);
        // The bug: `mixed_precision: no` read as False by PyYAML.
        assert_eq!(
            get(&m, "mixed_precision"),
            Some(&Yaml::str("no")),
            "{}",
            e.text
        );
        assert_eq!(get(&m, "distributed_type"), Some(&Yaml::str("NO")));
        assert_eq!(get(&m, "downcast_bf16"), Some(&Yaml::str("no")));
        assert_eq!(get(&m, "num_processes"), Some(&Yaml::Int(1)));
        assert_eq!(get(&m, "use_cpu"), Some(&Yaml::Bool(false)));
        // Every value is a quoted string, an integer or a boolean: nothing left to YAML 1.1.
        for line in e.text.lines().filter(|l| !l.starts_with('#')) {
            let v = line.split_once(": ").map(|(_, v)| v.trim());
            if let Some(v) = v {
                assert!(
                    v.starts_with('\'') || v.parse::<i64>().is_ok() || v == "true" || v == "false",
                    "{line}"
                );
            }
        }
    }

    #[test]
    fn a_deepspeed_yaml_names_the_json_and_repeats_none_of_its_keys() {
        for z in 1..=3 {
            let e = export(&zero(z), Target::Accelerate, &ExportOptions::default()).unwrap();
            let m = read_back(&e.text);
            assert_eq!(get(&m, "distributed_type"), Some(&Yaml::str("DEEPSPEED")));
            // accelerate 1.15 refuses these next to a deepspeed_config_file.
            assert_eq!(get(&m, "mixed_precision"), None, "{}", e.text);
            let Some(Yaml::Map(ds)) = get(&m, "deepspeed_config") else {
                panic!("no deepspeed_config in {}", e.text)
            };
            let keys: Vec<&str> = ds.iter().map(|(k, _)| *k).collect();
            assert_eq!(keys, ["deepspeed_config_file", "zero3_init_flag"]);
            assert_eq!(ds[0].1, Yaml::str("ds_config.json"));
            let cmd = e.command.unwrap();
            assert!(cmd.launcher.contains(&"--config_file".to_string()));
            assert!(!cmd.launcher.contains(&"--multi_gpu".to_string()));
            // The precision is on the launch line (it fills the JSON's "auto").
            let i = cmd
                .launcher
                .iter()
                .position(|a| a == "--mixed_precision")
                .unwrap();
            assert_eq!(cmd.launcher[i + 1], "bf16");
        }
    }

    #[test]
    fn the_deepspeed_json_is_auto_without_optimizer_at_the_plan_stage() {
        for z in 1..=3 {
            let e = export(&zero(z), Target::Deepspeed, &ExportOptions::default()).unwrap();
            let v: serde_json::Value = serde_json::from_str(&e.text).unwrap();
            for k in [
                "train_batch_size",
                "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps",
                "gradient_clipping",
            ] {
                assert_eq!(v[k], "auto", "{k}");
            }
            // The precision is explicit (issue 46: the YAML alone must keep it).
            assert_eq!(v["bf16"]["enabled"], true);
            assert_eq!(v["fp16"]["enabled"], false);
            assert!(v.get("optimizer").is_none(), "{}", e.text);
            assert!(v.get("zero_force_ds_cpu_optimizer").is_none());
            assert_eq!(v["zero_optimization"]["stage"], z);
        }
        let e = export(
            &zero(3),
            Target::Deepspeed,
            &opts(Family::Dit, Sharder::Deepspeed, Offload::OptimizerAndParams),
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_str(&e.text).unwrap();
        assert_eq!(v["zero_optimization"]["offload_optimizer"]["device"], "cpu");
        assert_eq!(v["zero_optimization"]["offload_param"]["device"], "cpu");
        assert_eq!(v["zero_force_ds_cpu_optimizer"], false);
        assert!(v.get("optimizer").is_none());
    }

    #[test]
    fn the_standalone_json_is_fixed_for_the_plan_world_size() {
        let mut s = zero(2);
        s.recipe.precision = Precision::Fp16Mixed;
        s.recipe.recompute = Recompute::Blocks((0..16).collect());
        let e = export(&s, Target::DeepspeedStandalone, &ExportOptions::default()).unwrap();
        let v: serde_json::Value = serde_json::from_str(&e.text).unwrap();
        let (b, m, a) = (
            v["train_batch_size"].as_u64().unwrap(),
            v["train_micro_batch_size_per_gpu"].as_u64().unwrap(),
            v["gradient_accumulation_steps"].as_u64().unwrap(),
        );
        assert_eq!(b, m * a * 8);
        assert_eq!(v["fp16"]["enabled"], true);
        assert_eq!(v["bf16"]["enabled"], false);
        assert_eq!(v["optimizer"]["type"], "AdamW");
        assert_eq!(v["activation_checkpointing"]["number_checkpoints"], 16);
        assert!(e.notes.iter().any(|n| n.contains("8 processes")));
        assert!(e.command.is_none());
    }

    #[test]
    fn a_zero3_launch_line_starts_deepspeed_stage_3() {
        let e = export(&zero(3), Target::Diffusers, &ExportOptions::default()).unwrap();
        let l = e.command.unwrap().launcher;
        assert_eq!(&l[..2], ["accelerate", "launch"]);
        assert!(!l.contains(&"--multi_gpu".to_string()), "{l:?}");
        let at = |f: &str| l.iter().position(|a| a == f).map(|i| l[i + 1].as_str());
        assert!(l.contains(&"--use_deepspeed".to_string()));
        assert_eq!(at("--zero_stage"), Some("3"));
        assert_eq!(at("--num_processes"), Some("8"));
        assert_eq!(at("--offload_optimizer_device"), Some("none"));
        assert!(
            e.text
                .contains("  --use_deepspeed \\\n  --zero_stage 3 \\\n"),
            "{}",
            e.text
        );
        // FSDP instead: reshard after forward for stage 3, not for stage 2.
        for (z, reshard) in [(3, "true"), (2, "false")] {
            let e = export(
                &zero(z),
                Target::Diffusers,
                &opts(Family::Flux, Sharder::Fsdp, Offload::None),
            )
            .unwrap();
            let l = e.command.unwrap().launcher;
            let at = |f: &str| l.iter().position(|a| a == f).map(|i| l[i + 1].as_str());
            assert!(l.contains(&"--use_fsdp".to_string()));
            assert!(!l.contains(&"--use_deepspeed".to_string()));
            assert_eq!(at("--fsdp_version"), Some("2"));
            assert_eq!(at("--fsdp_reshard_after_forward"), Some(reshard));
            assert_eq!(
                at("--fsdp_transformer_layer_cls_to_wrap"),
                Some("FluxTransformerBlock,FluxSingleTransformerBlock")
            );
        }
        // Plain DDP keeps --multi_gpu; one rank has none.
        let mut d = zero(0);
        d.recipe.zero_stage = 0;
        let l = export(&d, Target::Diffusers, &ExportOptions::default())
            .unwrap()
            .command
            .unwrap()
            .launcher;
        assert!(l.contains(&"--multi_gpu".to_string()));
        let l = export(&xl(), Target::Diffusers, &ExportOptions::default())
            .unwrap()
            .command
            .unwrap()
            .launcher;
        assert!(!l.contains(&"--multi_gpu".to_string()));
    }

    /// Specs that pull every lever the diffusers mapping knows.
    fn varied() -> Vec<Spec> {
        let mut out = Vec::new();
        for p in Precision::ALL {
            for lora in [None, Some(16)] {
                let mut s = xl();
                s.recipe.precision = p;
                s.recipe.lora = lora.map(lora_of_rank);
                s.recipe.recompute = Recompute::All;
                s.recipe.attention = AttentionMode::MemoryEfficient;
                s.recipe.latents = Latents::Cached;
                s.recipe.optimizer = if lora.is_some() {
                    Optimizer::AdamW8bit
                } else {
                    Optimizer::Sgd
                };
                out.push(s);
            }
        }
        out
    }

    #[test]
    fn no_flag_outside_the_script_list_is_emitted() {
        let mut with_script = 0;
        for f in Family::ALL {
            for s in varied() {
                for t in [Target::Diffusers, Target::Accelerate] {
                    let e = export(&s, t, &opts(f, Sharder::Deepspeed, Offload::None)).unwrap();
                    let cmd = e.command.unwrap();
                    match script_for(f, s.recipe.lora.is_some()) {
                        Ok(script) => {
                            with_script += 1;
                            assert_eq!(cmd.script, script.file_name());
                            for a in cmd.script_args.iter().filter(|a| a.starts_with("--")) {
                                assert!(script.has(a), "{a} is not a flag of {}", script.path);
                            }
                            // EMA is on in the default spec and no script keeps one.
                            assert!(
                                e.cannot.iter().any(|c| c.contains("--use_ema")),
                                "{:?}",
                                e.cannot
                            );
                            assert!(e.cannot.iter().any(|c| c.contains("xformers")));
                            assert!(!cmd.script_args.contains(&"--use_ema".to_string()));
                        }
                        Err(_) => {
                            assert!(cmd.script_args.is_empty());
                            assert_eq!(cmd.script, "your_train_script.py");
                            assert!(e.notes.iter().any(|n| n.contains("no fine-tune script")
                                || n.contains("no full fine-tune")));
                        }
                    }
                }
            }
        }
        assert!(with_script > 0);
    }

    #[test]
    fn diffusers_command_passes_the_plans_text_tokens() {
        // bench/ecosystem's end-to-end run: with --text-tokens 77,256 the Flux LoRA script
        // still padded T5 to its default 512 when the export passed no --max_sequence_length.
        let map =
            serde_json::from_str(crate::families::preset_config("flux.1-dev").unwrap()).unwrap();
        let mut s = crate::denoiser::with_family(Spec::default_xl(), "flux.1-dev", map).unwrap();
        s.recipe.lora = Some(lora_of_rank(8));
        let o = opts(Family::Flux, Sharder::Deepspeed, Offload::None);
        let run = |s: &Spec| export(s, Target::Diffusers, &o).unwrap();
        let msl = |e: &Export| {
            let a = &e.command.as_ref().unwrap().script_args;
            a.iter()
                .position(|x| x == "--max_sequence_length")
                .map(|i| a[i + 1].clone())
        };
        s.workload.text_tokens = Some(vec![77, 256]);
        let e = run(&s);
        assert_eq!(msl(&e).as_deref(), Some("256"));
        // The script's own default needs no flag.
        s.workload.text_tokens = Some(vec![77, 512]);
        assert_eq!(msl(&run(&s)), None);
        // CLIP's 77 are fixed: another count is something the script cannot do.
        s.workload.text_tokens = Some(vec![64, 256]);
        let e = run(&s);
        assert_eq!(msl(&e), None);
        assert!(
            e.cannot.iter().any(|c| c.contains("--max_sequence_length")),
            "{:?}",
            e.cannot
        );
        // The LoRA script's note says it encodes every batch.
        s.workload.text_tokens = None;
        s.recipe.text_encoders = crate::spec::TextEncoders::Online;
        let e = run(&s);
        assert!(
            e.notes.iter().any(|n| n.contains("encodes every batch")),
            "{:?}",
            e.notes
        );
        assert!(
            !e.notes.iter().any(|n| n.contains("encoded once")),
            "{:?}",
            e.notes
        );
    }

    #[test]
    fn diffusers_command_allows_tf32_as_the_recipe_says() {
        // The plan's times price fp32 matmuls at the TF32 rate when `recipe.tf32` is on.
        let mut s = xl();
        s.recipe.lora = Some(lora_of_rank(8));
        let o = opts(Family::Flux, Sharder::Deepspeed, Offload::None);
        let args = |s: &Spec| {
            export(s, Target::Diffusers, &o)
                .unwrap()
                .command
                .unwrap()
                .script_args
        };
        assert!(args(&s).contains(&"--allow_tf32".to_string()));
        s.recipe.tf32 = false;
        assert!(!args(&s).contains(&"--allow_tf32".to_string()));
    }

    #[test]
    fn flux_lora_command_names_its_script_and_flags() {
        let mut s = xl();
        s.recipe.lora = Some(lora_of_rank(8));
        s.recipe.recompute = Recompute::All;
        s.recipe.optimizer = Optimizer::AdamW8bit;
        let e = export(
            &s,
            Target::Diffusers,
            &opts(Family::Flux, Sharder::Deepspeed, Offload::None),
        )
        .unwrap();
        let c = e.command.unwrap();
        assert_eq!(c.script, "train_dreambooth_lora_flux.py");
        for pair in [
            ["--mixed_precision", "bf16"],
            ["--train_batch_size", "8"],
            ["--gradient_accumulation_steps", "4"],
            ["--rank", "8"],
        ] {
            assert!(
                c.script_args.windows(2).any(|w| w == pair),
                "{pair:?} in {:?}",
                c.script_args
            );
        }
        assert!(c
            .script_args
            .contains(&"--gradient_checkpointing".to_string()));
        assert!(c.script_args.contains(&"--use_8bit_adam".to_string()));
        assert!(c.script_source.unwrap().contains(DIFFUSERS_COMMIT));
        // The rendered text is the argv, quoted for the shell.
        assert!(
            e.text
                .contains("--instance_prompt 'a photo of sks subject'"),
            "{}",
            e.text
        );
    }

    #[test]
    fn zero_offload_launches_through_the_config_files() {
        let e = export(
            &zero(2),
            Target::Diffusers,
            &opts(Family::Flux, Sharder::Deepspeed, Offload::Optimizer),
        )
        .unwrap();
        let l = e.command.unwrap().launcher;
        assert!(l.contains(&"--config_file".to_string()), "{l:?}");
        assert!(!l.contains(&"--use_deepspeed".to_string()));
        let v: serde_json::Value = serde_json::from_str(
            &export(
                &zero(2),
                Target::Deepspeed,
                &opts(Family::Flux, Sharder::Deepspeed, Offload::Optimizer),
            )
            .unwrap()
            .text,
        )
        .unwrap();
        assert_eq!(v["zero_force_ds_cpu_optimizer"], false);
        assert_eq!(v["zero_optimization"]["offload_optimizer"]["device"], "cpu");
        assert!(v["zero_optimization"].get("offload_param").is_none());
    }

    /// The words a POSIX shell makes of `text` (single quotes, backslash-newline, blanks).
    fn shell_words(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut word: Option<String> = None;
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\\' if chars.peek() == Some(&'\n') => {
                    chars.next();
                }
                '\\' => word
                    .get_or_insert_with(String::new)
                    .push(chars.next().unwrap()),
                '\'' => {
                    let w = word.get_or_insert_with(String::new);
                    for q in chars.by_ref() {
                        if q == '\'' {
                            break;
                        }
                        w.push(q);
                    }
                }
                ' ' | '\n' => out.extend(word.take()),
                c => word.get_or_insert_with(String::new).push(c),
            }
        }
        out.extend(word);
        out
    }

    #[test]
    fn the_rendered_command_is_its_argv() {
        let mut s = zero(3);
        s.recipe.lora = Some(lora_of_rank(4));
        for f in [Family::Flux, Family::Sd3, Family::Sana, Family::Dit] {
            let e = export(
                &s,
                Target::Diffusers,
                &opts(f, Sharder::Deepspeed, Offload::None),
            )
            .unwrap();
            let c = e.command.unwrap();
            let body: String = e
                .text
                .lines()
                .filter(|l| !l.starts_with('#'))
                .map(|l| format!("{l}\n"))
                .collect();
            let mut want = c.launcher.clone();
            want.push(c.script.clone());
            want.extend(c.script_args.iter().cloned());
            assert_eq!(shell_words(&body), want, "{body}");
        }
        let mut odd = Command {
            launcher: vec!["accelerate".into(), "launch".into()],
            script: "t.py".into(),
            script_source: None,
            script_args: vec!["--instance_prompt".into(), "it's a \"sks\" $dog".into()],
        };
        assert_eq!(shell_words(&odd.render())[4], "it's a \"sks\" $dog");
        odd.script_args.clear();
        assert_eq!(shell_words(&odd.render()), ["accelerate", "launch", "t.py"]);
    }

    #[test]
    fn impossible_combinations_are_typed_errors() {
        let mut plain = zero(0);
        plain.recipe.zero_stage = 0;
        use {Offload as O, Sharder as S, Target as T};
        let (offload, sharder) = (Some("plan.emit-offload"), Some("plan.emit-sharder"));
        let (opt, both) = (O::Optimizer, O::OptimizerAndParams);
        // (plan, target, sharder, offload): the field the error names, or None: exported.
        let cases = [
            (&plain, T::Accelerate, S::Deepspeed, opt, offload),
            (&zero(2), T::Deepspeed, S::Deepspeed, both, offload),
            (&zero(1), T::Accelerate, S::Fsdp, O::None, sharder),
            (&zero(3), T::Accelerate, S::Fsdp, opt, offload),
            (&zero(3), T::Accelerate, S::Fsdp, both, None),
        ];
        for (plan, target, sharder, offload, field) in cases {
            let r = export(plan, target, &opts(Family::Dit, sharder, offload));
            match field {
                Some(f) => assert_eq!(r.unwrap_err().field(), Some(f)),
                None => assert!(r.is_ok()),
            }
        }
    }

    #[test]
    fn fsdp_yaml_reads_back() {
        let e = export(
            &zero(3),
            Target::Accelerate,
            &opts(Family::Sd3, Sharder::Fsdp, Offload::OptimizerAndParams),
        )
        .unwrap();
        let m = read_back(&e.text);
        assert_eq!(get(&m, "distributed_type"), Some(&Yaml::str("FSDP")));
        assert_eq!(get(&m, "mixed_precision"), Some(&Yaml::str("bf16")));
        let Some(Yaml::Map(f)) = get(&m, "fsdp_config") else {
            panic!("{}", e.text)
        };
        let at = |k: &str| f.iter().find(|(key, _)| *key == k).map(|(_, v)| v.clone());
        assert_eq!(at("fsdp_version"), Some(Yaml::Int(2)));
        assert_eq!(at("fsdp_reshard_after_forward"), Some(Yaml::Bool(true)));
        assert_eq!(at("fsdp_offload_params"), Some(Yaml::Bool(true)));
        assert_eq!(
            at("fsdp_transformer_layer_cls_to_wrap"),
            Some(Yaml::str("JointTransformerBlock"))
        );
    }

    #[test]
    fn unknown_names_name_the_flag() {
        assert_eq!(
            "megatron".parse::<Target>().unwrap_err().field(),
            Some("plan.emit")
        );
        assert_eq!(
            "ddp".parse::<Sharder>().unwrap_err().field(),
            Some("recipe.sharder")
        );
        assert_eq!(
            "gpu".parse::<Offload>().unwrap_err().field(),
            Some("recipe.offload")
        );
        assert_eq!(
            Sharder::parse("ddp", "plan.emit-sharder")
                .unwrap_err()
                .field(),
            Some("plan.emit-sharder")
        );
        for t in Target::ALL {
            assert_eq!(t.name().parse::<Target>().unwrap(), t);
        }
    }

    /// The export launches what the plan budgeted: the recipe's sharder and offload by default,
    /// and a note when the options launch something the budget did not count.
    #[test]
    fn the_export_launches_the_budgeted_sharding() {
        let mut s = zero(3);
        s.recipe.sharder = Sharder::Fsdp;
        s.recipe.offload = Offload::OptimizerAndParams;
        s.validate().unwrap();
        let e = export(&s, Target::Accelerate, &ExportOptions::default()).unwrap();
        assert_eq!(e.options.sharder, Sharder::Fsdp);
        assert_eq!(e.options.offload, Offload::OptimizerAndParams);
        assert!(e.text.contains("fsdp_offload_params: true"), "{}", e.text);
        assert!(!e.notes.iter().any(|n| n.contains("was budgeted for")));
        let plain = zero(2);
        let e = export(
            &plain,
            Target::Deepspeed,
            &opts(Family::Dit, Sharder::Deepspeed, Offload::Optimizer),
        )
        .unwrap();
        assert!(e.text.contains("offload_optimizer"));
        assert!(
            e.notes
                .iter()
                .any(|n| n.contains("was budgeted for deepspeed with offload none")),
            "{:?}",
            e.notes
        );
    }
}
