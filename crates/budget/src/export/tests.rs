//! The exports' tests.

use super::scripts::DIFFUSERS_COMMIT;
use super::types::*;
use super::yaml::tests::read_back;
use super::yaml::Yaml;
use super::*;
use crate::families::Family;
use crate::spec::{AttentionMode, Latents, Optimizer, Precision, Recompute};

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
                        // Memory-efficient attention is SDPA's default: a note, not a limit.
                        assert!(!e.cannot.iter().any(|c| c.contains("xformers")));
                        assert!(e.notes.iter().any(|n| n.contains("needs no flag")));
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
    let map = serde_json::from_str(crate::families::preset_config("flux.1-dev").unwrap()).unwrap();
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

/// The export's options and the recipe's own fields refuse the same (stage, sharder, offload)
/// combinations ([`crate::sharder::Conflict`]), each naming its own field.
#[test]
fn export_options_refuse_what_a_recipe_refuses() {
    let mut refused = 0;
    for z in 0..=3u8 {
        for sharder in [Sharder::Deepspeed, Sharder::Fsdp] {
            for offload in [
                Offload::None,
                Offload::Optimizer,
                Offload::OptimizerAndParams,
            ] {
                let recipe = crate::sharder::validate(z, sharder, offload, false);
                let exported = export(
                    &zero(z),
                    Target::Accelerate,
                    &opts(Family::Dit, sharder, offload),
                );
                assert_eq!(
                    recipe.is_err(),
                    exported.is_err(),
                    "{z} {sharder:?} {offload:?}"
                );
                if let (Err(r), Err(e)) = (recipe, exported) {
                    refused += 1;
                    assert!(r.field().is_some_and(|f| f.starts_with("recipe.")), "{r}");
                    assert!(
                        e.field().is_some_and(|f| f.starts_with("plan.emit-")),
                        "{e}"
                    );
                }
            }
        }
    }
    // Offload at stage 0 (2 × 2), DeepSpeed offload_param below stage 3 (stages 1, 2), FSDP at
    // stage 1 (3 offloads) and FSDP's optimizer-only offload (stages 2, 3).
    assert_eq!(refused, 4 + 2 + 3 + 2);
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
