//! The `accelerate` target: `accelerate launch` and its arguments, and the accelerate config
//! file (`accelerate_config.yaml`).

use super::types::{header, s, Command, ExportOptions, Target};
use super::yaml::{self, Yaml};
use crate::sharding::{Offload, Sharder};
use crate::spec::Spec;

/// `accelerate launch` and its arguments (accelerate 1.15 `commands/launch.py`
/// `launch_command_parser`). With `config_file` the distribution comes from
/// `accelerate_config.yaml`; without, from flags: `--use_deepspeed --zero_stage N` for a ZeRO
/// plan, `--use_fsdp --fsdp_version 2` for FSDP, `--multi_gpu` only for plain DDP (it would start
/// unsharded data parallelism, every rank holding the whole model state).
pub(super) fn launcher(spec: &Spec, o: &ExportOptions, mp: &str, config_file: bool) -> Vec<String> {
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
            s(o.family.facts().fsdp_block_classes),
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
pub(crate) const MAIN_NODE_IP: &str = "MAIN_NODE_IP";
/// The rendezvous port of a multi-node launch (accelerate's default, 1.15 `commands/launch.py`).
pub(crate) const MAIN_PROCESS_PORT: &str = "29500";

pub(super) fn offload_devices(o: Offload) -> (&'static str, &'static str) {
    match o {
        Offload::None => ("none", "none"),
        Offload::Optimizer => ("cpu", "none"),
        Offload::OptimizerAndParams => ("cpu", "cpu"),
    }
}

/// The accelerate config (keys of accelerate 1.15 `commands/config/config_args.py`
/// `ClusterConfig`, strings quoted: see [`yaml`]): the comments that say how to launch it, then
/// the keys.
pub(super) fn accelerate_yaml(
    spec: &Spec,
    o: &ExportOptions,
    mp: &str,
    cmd: &Command,
    notes: &mut Vec<String>,
) -> String {
    let deepspeed = spec.recipe.zero_stage > 0 && o.sharder == Sharder::Deepspeed;
    let mut y = launch_comments(spec, o, cmd, deepspeed);
    y.push_str(&yaml::emit(&config_keys(spec, o, mp, deepspeed, notes)));
    y
}

/// The mapping of `accelerate_config.yaml`, key by key in the file's order.
fn config_keys(
    spec: &Spec,
    o: &ExportOptions,
    mp: &str,
    deepspeed: bool,
    notes: &mut Vec<String>,
) -> Vec<(&'static str, Yaml)> {
    let w = &spec.workload;
    let z = spec.recipe.zero_stage;
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
        m.push(("deepspeed_config", deepspeed_config(mp, notes)));
    }
    m.push(("distributed_type", Yaml::str(distributed)));
    m.push(("downcast_bf16", Yaml::str("no")));
    m.push(("enable_cpu_affinity", Yaml::Bool(false)));
    if fsdp {
        m.push(("fsdp_config", fsdp_config(z, o)));
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
    m
}

/// `deepspeed_config`: the file beside this one. With a deepspeed_config_file, accelerate
/// refuses the keys it reads from the file (gradient_accumulation_steps, gradient_clipping,
/// zero_stage, offload_*, mixed_precision: utils/dataclasses.py
/// DeepSpeedPlugin._deepspeed_config_checks); zero3_init_flag is not among them.
/// deepspeed.zero.Init is off: diffusers' from_pretrained builds the model on each rank's CPU
/// before accelerate partitions it, and the flag needs transformers.
fn deepspeed_config(mp: &str, notes: &mut Vec<String>) -> Yaml {
    notes.push(format!(
        "accelerate_config.yaml names {}: keep both in the launch directory (--emit-dir \
         writes both); ZeRO stage, offload, accumulation and the precision (bf16/fp16 \
         enabled, for --mixed_precision {mp}) are in the JSON",
        Target::Deepspeed.file_name()
    ));
    Yaml::Map(vec![
        (
            "deepspeed_config_file",
            Yaml::str(Target::Deepspeed.file_name()),
        ),
        ("zero3_init_flag", Yaml::Bool(false)),
    ])
}

/// `fsdp_config`: FSDP2 keys as `accelerate config` writes them (1.15
/// commands/config/cluster.py).
fn fsdp_config(stage: u8, o: &ExportOptions) -> Yaml {
    Yaml::Map(vec![
        ("fsdp_auto_wrap_policy", Yaml::str("TRANSFORMER_BASED_WRAP")),
        ("fsdp_cpu_ram_efficient_loading", Yaml::Bool(false)),
        (
            "fsdp_offload_params",
            Yaml::Bool(o.offload == Offload::OptimizerAndParams),
        ),
        ("fsdp_reshard_after_forward", Yaml::Bool(stage == 3)),
        ("fsdp_state_dict_type", Yaml::str("SHARDED_STATE_DICT")),
        (
            "fsdp_transformer_layer_cls_to_wrap",
            Yaml::str(o.family.facts().fsdp_block_classes),
        ),
        ("fsdp_version", Yaml::Int(2)),
    ])
}

/// The file's opening comments: what it is for, the nodes, the accumulation outside
/// DeepSpeed, the per-process batch and the launch line.
fn launch_comments(spec: &Spec, o: &ExportOptions, cmd: &Command, deepspeed: bool) -> String {
    let w = &spec.workload;
    let machines = o.machines(w.ranks);
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
    y
}
