//! The DeepSpeed target: the `ds_config.json` an accelerate launch names, or a standalone one.

use super::accelerate::offload_devices;
use super::types::{ExportOptions, Target};
use crate::spec::{Optimizer, Precision, Spec};
use serde_json::{json, Value};

/// The DeepSpeed config. For accelerate (`standalone` false): `"auto"` for every value accelerate
/// fills (batch sizes and accumulation from the dataloader and Accelerator, clipping), explicit
/// fp16/bf16 (the YAML alone must keep the precision; accelerate checks a --mixed_precision
/// against them: accelerate 1.15 `accelerator.py` `_prepare_deepspeed`,
/// `utils/dataclasses.py` `DeepSpeedPlugin.set_mixed_precision`), so it works at any world size,
/// and no `optimizer` block: the diffusers scripts build their own optimizer, and accelerate
/// refuses both. Standalone: fixed values, valid at the plan's world size only (deepspeed 0.19.8
/// `runtime/config.py` `_configure_train_batch_size` checks batch = micro × accumulation × world).
pub(super) fn deepspeed_json(
    spec: &Spec,
    o: &ExportOptions,
    standalone: bool,
    ckpt: bool,
    notes: &mut Vec<String>,
) -> String {
    let w = &spec.workload;
    let (bf16, fp16) = precision_flags(spec.recipe.precision, notes);
    let auto = || Value::from("auto");
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
        "zero_optimization": zero_optimization(spec.recipe.zero_stage, o),
        "steps_per_print": 100,
        "wall_clock_breakdown": false
    });
    if standalone {
        standalone_sections(spec, ckpt, &mut v, notes);
    } else {
        beside_accelerate(o, ckpt, &mut v, notes);
    }
    serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
}

/// DeepSpeed's `bf16.enabled` and `fp16.enabled` for a precision, with what they do not keep of
/// it.
fn precision_flags(precision: Precision, notes: &mut Vec<String>) -> (bool, bool) {
    let flags = match precision {
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
    if precision == Precision::Bf16Mixed {
        notes.push(
            "DeepSpeed bf16 keeps bf16 weights plus fp32 master copies in the optimizer, not fp32 \
             weights cast per step as the plan's bf16-mixed: memory differs somewhat"
                .into(),
        );
    }
    flags
}

/// The `zero_optimization` block: the stage, and where the export offloads.
fn zero_optimization(stage: u8, o: &ExportOptions) -> Value {
    let mut zero = json!({
        "stage": stage,
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
    zero
}

/// What only a standalone config holds: the optimizer block and DeepSpeed's activation
/// checkpointing, with how to launch it.
fn standalone_sections(spec: &Spec, ckpt: bool, v: &mut Value, notes: &mut Vec<String>) {
    let r = &spec.recipe;
    let w = &spec.workload;
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
}

/// What a config beside accelerate's leaves to the script (its optimizer, its checkpointing),
/// and the flag ZeRO-Offload needs with the script's torch optimizer.
fn beside_accelerate(o: &ExportOptions, ckpt: bool, v: &mut Value, notes: &mut Vec<String>) {
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
    if offload_devices(o.offload).0 != "none" {
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
}
