//! Export a plan to the configuration of a training stack: an `accelerate` config file, a
//! DeepSpeed JSON config, or the command-line flags of the diffusers/accelerate example train
//! scripts (`train_text_to_image.py` and friends).
//!
//! Every lever of the spec is mapped where the target has an equivalent; where it has none (a
//! partial block-recompute count, attention-only recompute, bf16-pure, cached latents, …) the
//! export says so in [`Export::notes`] — and, inside the text, as comments where the format has
//! them — instead of pretending.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::error::SpecError;
use crate::spec::{AttentionMode, Latents, Optimizer, Precision, Recompute, Spec};

/// Which stack to export for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    /// `accelerate launch --config_file <yaml>`.
    Accelerate,
    /// A DeepSpeed config (`--deepspeed_config ds.json`, or `deepspeed_config_file` in accelerate).
    Deepspeed,
    /// Flags of the diffusers example train scripts, run through `accelerate launch`.
    Diffusers,
}

impl Target {
    pub const fn name(self) -> &'static str {
        match self {
            Target::Accelerate => "accelerate",
            Target::Deepspeed => "deepspeed",
            Target::Diffusers => "diffusers",
        }
    }

    /// A conventional file name for the export.
    pub const fn file_name(self) -> &'static str {
        match self {
            Target::Accelerate => "accelerate_config.yaml",
            Target::Deepspeed => "ds_config.json",
            Target::Diffusers => "train_flags.sh",
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
            "diffusers" => Ok(Target::Diffusers),
            _ => Err(SpecError::invalid(
                "plan.emit",
                format!("'{s}' is not an export target; allowed: accelerate, deepspeed, diffusers"),
            )),
        }
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
}

/// The `mixed_precision` value of accelerate / diffusers and what it cannot express.
fn mixed_precision(p: Precision, notes: &mut Vec<String>) -> &'static str {
    match p {
        Precision::Bf16Mixed => "bf16",
        Precision::Fp16Mixed => "fp16",
        Precision::Fp32 => "no",
        Precision::Fp64 => {
            notes.push(
                "precision fp64 has no mixed_precision value: use \"no\" and cast the model with \
                 model.double()"
                    .into(),
            );
            "no"
        }
        Precision::Bf16Pure => {
            notes.push(
                "precision bf16-pure (weights stored in bf16) has no mixed_precision value: use \
                 \"no\" and cast the model with model.to(torch.bfloat16), keeping AdamW state in fp32"
                    .into(),
            );
            "no"
        }
    }
}

/// How the spec's recompute maps onto whole-model gradient checkpointing.
fn checkpointing(spec: &Spec, notes: &mut Vec<String>) -> bool {
    let depth = spec.model.depth;
    match &spec.recipe.recompute {
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

fn common_notes(spec: &Spec, notes: &mut Vec<String>) {
    let r = &spec.recipe;
    if r.attention == AttentionMode::MemoryEfficient {
        notes.push(
            "attention memory-efficient: PyTorch ≥ 2 SDPA (diffusers' default attention processor) \
             or --enable_xformers_memory_efficient_attention; no config key"
                .into(),
        );
    }
    if r.latents == Latents::Cached {
        notes.push(
            "latents cached: encode the dataset with the VAE beforehand and feed latents; the \
             example scripts encode in the step and have no flag for it"
                .into(),
        );
    }
    if let Some(l) = &r.lora {
        let targets: Vec<String> = l
            .targets
            .iter()
            .map(|t| format!("{t:?}").to_ascii_lowercase())
            .collect();
        notes.push(format!(
            "LoRA rank {} on {}: peft LoraConfig(r={}, target_modules=…) with the base frozen \
             (train_text_to_image_lora.py: --rank {})",
            l.rank,
            targets.join(", "),
            l.rank,
            l.rank
        ));
    }
}

/// Export the spec for a target.
pub fn export(spec: &Spec, target: Target) -> Export {
    let mut notes = Vec::new();
    let text = match target {
        Target::Accelerate => accelerate(spec, &mut notes),
        Target::Deepspeed => deepspeed(spec, &mut notes),
        Target::Diffusers => diffusers(spec, &mut notes),
    };
    Export {
        target,
        file_name: target.file_name(),
        text,
        notes,
    }
}

fn accelerate(spec: &Spec, notes: &mut Vec<String>) -> String {
    let r = &spec.recipe;
    let w = &spec.workload;
    let mp = mixed_precision(r.precision, notes);
    let ckpt = checkpointing(spec, notes);
    common_notes(spec, notes);
    let distributed = if r.zero_stage > 0 {
        "DEEPSPEED"
    } else if w.ranks > 1 {
        "MULTI_GPU"
    } else {
        "'NO'"
    };
    let mut y = String::new();
    y.push_str(&format!(
        "# accelerate config for {} at {}×{}: batch {} = microbatch {} × accumulation {} × {} processes\n",
        spec.model.name, w.height, w.width, w.batch, w.microbatch, w.accumulation, w.ranks
    ));
    y.push_str("compute_environment: LOCAL_MACHINE\n");
    if r.zero_stage > 0 {
        y.push_str("deepspeed_config:\n");
        y.push_str(&format!(
            "  gradient_accumulation_steps: {}\n",
            w.accumulation
        ));
        y.push_str("  offload_optimizer_device: none\n  offload_param_device: none\n");
        y.push_str(&format!("  zero3_init_flag: {}\n", r.zero_stage == 3));
        y.push_str(&format!("  zero_stage: {}\n", r.zero_stage));
    } else {
        // Outside deepspeed_config the file has no accumulation key; accelerate reads it from
        // this environment variable (or Accelerator(gradient_accumulation_steps=N)).
        y.push_str(&format!(
            "# gradient_accumulation_steps: {} — no key outside deepspeed_config: set \
             ACCELERATE_GRADIENT_ACCUMULATION_STEPS={} or Accelerator(gradient_accumulation_steps={})\n",
            w.accumulation, w.accumulation, w.accumulation
        ));
        notes.push(format!(
            "gradient_accumulation_steps {} has no accelerate config key without DeepSpeed: set \
             ACCELERATE_GRADIENT_ACCUMULATION_STEPS={} or pass it to Accelerator()",
            w.accumulation, w.accumulation
        ));
    }
    y.push_str(&format!("distributed_type: {distributed}\n"));
    y.push_str("downcast_bf16: 'no'\n");
    y.push_str("machine_rank: 0\nmain_training_function: main\n");
    y.push_str(&format!("mixed_precision: {mp}\n"));
    y.push_str("num_machines: 1\n");
    y.push_str(&format!("num_processes: {}\n", w.ranks));
    y.push_str("rdzv_backend: static\nsame_network: true\nuse_cpu: false\n");
    y.push_str(&format!(
        "# per-process train batch (microbatch): {}\n",
        w.microbatch
    ));
    if ckpt {
        y.push_str("# gradient checkpointing: model.enable_gradient_checkpointing() in the script (no config key)\n");
        notes.push(
            "gradient checkpointing has no accelerate config key: call \
             model.enable_gradient_checkpointing() (diffusers --gradient_checkpointing)"
                .into(),
        );
    }
    if r.optimizer == Optimizer::AdamW8bit {
        y.push_str("# optimizer: bitsandbytes.optim.AdamW8bit in the script (no config key)\n");
        notes.push("8-bit AdamW has no accelerate config key: use bitsandbytes.optim.AdamW8bit (diffusers --use_8bit_adam)".into());
    }
    y
}

fn deepspeed(spec: &Spec, notes: &mut Vec<String>) -> String {
    let r = &spec.recipe;
    let w = &spec.workload;
    let ckpt = checkpointing(spec, notes);
    common_notes(spec, notes);
    let (bf16, fp16) = match r.precision {
        Precision::Bf16Mixed => {
            notes.push(
                "DeepSpeed bf16 keeps bf16 weights plus fp32 master copies in the optimizer, not \
                 fp32 weights cast per step as the plan's bf16-mixed: memory differs somewhat"
                    .into(),
            );
            (true, false)
        }
        Precision::Fp16Mixed => (false, true),
        Precision::Bf16Pure => {
            notes.push(
                "bf16-pure has no DeepSpeed equivalent (its bf16 mode keeps fp32 masters); \
                 bf16.enabled is the nearest"
                    .into(),
            );
            (true, false)
        }
        Precision::Fp32 => (false, false),
        Precision::Fp64 => {
            notes.push(
                "fp64 has no DeepSpeed precision setting: cast the model with model.double()"
                    .into(),
            );
            (false, false)
        }
    };
    let optimizer = match r.optimizer {
        Optimizer::AdamW => serde_json::json!({
            "type": "AdamW",
            "params": { "lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0 }
        }),
        Optimizer::AdamW8bit => {
            notes.push(
                "8-bit AdamW is not a DeepSpeed optimizer: build bitsandbytes.optim.AdamW8bit in \
                 the script and pass it to deepspeed.initialize (no \"optimizer\" block is written)"
                    .into(),
            );
            serde_json::Value::Null
        }
        Optimizer::Sgd => serde_json::json!({ "type": "SGD", "params": { "lr": 1e-4 } }),
    };
    let k = r.recompute.recomputed_count(spec.model.depth);
    let mut v = serde_json::json!({
        "train_batch_size": w.batch,
        "train_micro_batch_size_per_gpu": w.microbatch,
        "gradient_accumulation_steps": w.accumulation,
        "bf16": { "enabled": bf16 },
        "fp16": {
            "enabled": fp16,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1
        },
        "zero_optimization": {
            "stage": r.zero_stage,
            "overlap_comm": true,
            "contiguous_gradients": true
        },
        "activation_checkpointing": {
            "partition_activations": false,
            "cpu_checkpointing": false,
            "contiguous_memory_optimization": false,
            "number_checkpoints": if ckpt { serde_json::json!(k.max(1)) } else { serde_json::Value::Null },
            "synchronize_checkpoint_boundary": false,
            "profile": false
        },
        "steps_per_print": 100,
        "wall_clock_breakdown": false
    });
    if !optimizer.is_null() {
        v["optimizer"] = optimizer;
    }
    if ckpt {
        notes.push(format!(
            "activation_checkpointing configures deepspeed.checkpointing; the model must call \
             deepspeed.checkpointing.checkpoint on the {} recomputed blocks itself",
            k
        ));
    } else if let Some(obj) = v.as_object_mut() {
        obj.remove("activation_checkpointing");
    }
    serde_json::to_string_pretty(&v).expect("a JSON value always serialises") + "\n"
}

fn diffusers(spec: &Spec, notes: &mut Vec<String>) -> String {
    let r = &spec.recipe;
    let w = &spec.workload;
    let mp = mixed_precision(r.precision, notes);
    let ckpt = checkpointing(spec, notes);
    let mut launch = vec!["accelerate launch".to_string()];
    if w.ranks > 1 {
        launch.push("--multi_gpu".into());
        launch.push(format!("--num_processes {}", w.ranks));
    }
    launch.push(format!("--mixed_precision {mp}"));
    let script = if r.lora.is_some() {
        "train_text_to_image_lora.py"
    } else {
        "train_text_to_image.py"
    };
    let mut flags = vec![
        format!("--mixed_precision {mp}"),
        format!("--resolution {}", w.height.max(w.width)),
        format!("--train_batch_size {}", w.microbatch),
        format!("--gradient_accumulation_steps {}", w.accumulation),
    ];
    if w.height != w.width {
        notes.push(format!(
            "the scripts train square crops (--resolution {}); the plan is {}×{}",
            w.height.max(w.width),
            w.height,
            w.width
        ));
    }
    if ckpt {
        flags.push("--gradient_checkpointing".into());
    }
    if r.optimizer == Optimizer::AdamW8bit {
        flags.push("--use_8bit_adam".into());
    }
    if r.ema.enabled {
        flags.push("--use_ema".into());
    }
    if let Some(l) = &r.lora {
        flags.push(format!("--rank {}", l.rank));
    }
    if r.attention == AttentionMode::MemoryEfficient {
        flags.push("--enable_xformers_memory_efficient_attention".into());
    }
    if r.zero_stage > 0 {
        notes.push(format!(
            "ZeRO stage {} has no script flag: launch with an accelerate config that has \
             distributed_type DEEPSPEED and zero_stage {} (--emit accelerate)",
            r.zero_stage, r.zero_stage
        ));
    }
    if r.optimizer == Optimizer::Sgd {
        notes.push("SGD has no flag: the scripts build AdamW".into());
    }
    common_notes(spec, notes);
    let mut text = format!(
        "# {} at {}×{}: batch {} = microbatch {} × accumulation {} × {} processes\n",
        spec.model.name, w.height, w.width, w.batch, w.microbatch, w.accumulation, w.ranks
    );
    for n in notes.iter() {
        text.push_str(&format!("# note: {n}\n"));
    }
    text.push_str(&format!(
        "{} {} \\\n  {}\n",
        launch.join(" "),
        script,
        flags.join(" \\\n  ")
    ));
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xl() -> Spec {
        let mut s = Spec::default_xl();
        s.workload.microbatch = 8;
        s.workload.accumulation = 4;
        s
    }

    #[test]
    fn accelerate_has_precision_and_accumulation() {
        let e = export(&xl(), Target::Accelerate);
        assert!(e.text.contains("mixed_precision: bf16"));
        assert!(e.text.contains("ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4"));
        let mut z = xl();
        z.workload.ranks = 4;
        z.workload.accumulation = 1;
        z.recipe.zero_stage = 2;
        let e = export(&z, Target::Accelerate);
        assert!(e.text.contains("distributed_type: DEEPSPEED"));
        assert!(e.text.contains("  zero_stage: 2"));
        assert!(e.text.contains("  gradient_accumulation_steps: 1"));
        assert!(e.text.contains("num_processes: 4"));
    }

    #[test]
    fn deepspeed_is_json_with_the_plan() {
        let mut s = xl();
        s.recipe.recompute = Recompute::Blocks((0..16).collect());
        s.recipe.precision = Precision::Fp16Mixed;
        let e = export(&s, Target::Deepspeed);
        let v: serde_json::Value = serde_json::from_str(&e.text).unwrap();
        assert_eq!(v["train_batch_size"], 32);
        assert_eq!(v["train_micro_batch_size_per_gpu"], 8);
        assert_eq!(v["gradient_accumulation_steps"], 4);
        assert_eq!(v["fp16"]["enabled"], true);
        assert_eq!(v["bf16"]["enabled"], false);
        assert_eq!(v["zero_optimization"]["stage"], 0);
        assert_eq!(v["activation_checkpointing"]["number_checkpoints"], 16);
        assert!(e.notes.iter().any(|n| n.contains("16 of 28 blocks")));
    }

    #[test]
    fn diffusers_flags() {
        let mut s = xl();
        s.recipe.recompute = Recompute::All;
        s.recipe.optimizer = Optimizer::AdamW8bit;
        let e = export(&s, Target::Diffusers);
        for f in [
            "--mixed_precision bf16",
            "--gradient_checkpointing",
            "--gradient_accumulation_steps 4",
            "--train_batch_size 8",
            "--use_8bit_adam",
            "--use_ema",
        ] {
            assert!(e.text.contains(f), "missing {f} in {}", e.text);
        }
        // Nothing partial to confess for `all`.
        assert!(!e.notes.iter().any(|n| n.contains("blocks (")));
    }

    #[test]
    fn unknown_target_names_the_flag() {
        let e = "megatron".parse::<Target>().unwrap_err();
        assert_eq!(e.field(), Some("plan.emit"));
    }
}
