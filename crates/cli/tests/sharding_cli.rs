//! Sharding as a user plans it: `plan --ranks 8` under a budget that only ZeRO-3 (or FSDP2 with
//! resharding) meets picks that stage, and its exports start it; the sharding flags in `--json`.

mod common;

use common::{argv, ditmem, json, json_exit};

fn plan(extra: &[&str]) -> serde_json::Value {
    let mut args = argv("plan --runtime pytorch --ranks 8 --batch 8 --allow sharding --json");
    args.extend_from_slice(extra);
    json(&args)
}

fn launcher(v: &serde_json::Value) -> Vec<String> {
    v["export"]["command"]["launcher"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// The smallest peak a plan reaches at a fixed stage (the planner's floor, exit 3).
fn floor(extra: &[&str]) -> u64 {
    let mut args = argv("plan --runtime pytorch --ranks 8 --batch 8 --budget 256MiB --json");
    args.extend_from_slice(extra);
    json_exit(&args, 3)["predicted_peak_bytes"]
        .as_u64()
        .unwrap()
}

/// DeepSpeed: 5 GiB (4.75 usable) is below every ZeRO-2 recipe of DiT-XL/2 over 8 ranks and
/// above ZeRO-3's floor; the plan picks stage 3, its DeepSpeed JSON and launch start it.
#[test]
fn a_budget_only_zero3_meets_gives_a_stage_3_plan_and_export() {
    let usable = 5.0 * 0.95 * (1u64 << 30) as f64;
    assert!(floor(&["--zero", "2"]) as f64 > usable);
    assert!((floor(&["--zero", "3"]) as f64) < usable);
    let v = plan(&["--budget", "5GiB", "--emit", "deepspeed"]);
    assert_eq!(v["feasible"], true);
    assert_eq!(v["plan"]["recipe"]["zero_stage"], 3, "{}", v["reason"]);
    let json: serde_json::Value =
        serde_json::from_str(v["export"]["text"].as_str().unwrap()).unwrap();
    assert_eq!(json["zero_optimization"]["stage"], 3);
    let d = plan(&["--budget", "5GiB", "--emit", "diffusers"]);
    let l = launcher(&d);
    let i = l.iter().position(|a| a == "--zero_stage").unwrap();
    assert_eq!(l[i + 1], "3", "{l:?}");
    assert!(l.contains(&"--use_deepspeed".to_string()) && !l.contains(&"--multi_gpu".to_string()));
    // The offload caveat is gone: nothing was offloaded, nothing is uncounted.
    assert!(!v["export"]["notes"]
        .to_string()
        .contains("not in the budget"));
}

/// FSDP2: 2.5 GiB is below FSDP2 without resharding (stage 2) and above FSDP2 with it; the
/// plan picks stage 3 and the accelerate config reshards after forward.
#[test]
fn a_budget_only_fsdp2_with_resharding_meets_gives_reshard_after_forward() {
    let usable = 2.5 * 0.95 * (1u64 << 30) as f64;
    assert!(floor(&["--zero", "2", "--sharder", "fsdp"]) as f64 > usable);
    assert!((floor(&["--zero", "3", "--sharder", "fsdp"]) as f64) < usable);
    let v = plan(&argv("--budget 2.5GiB --sharder fsdp --emit accelerate"));
    assert_eq!(v["plan"]["recipe"]["zero_stage"], 3, "{}", v["reason"]);
    assert_eq!(v["plan"]["recipe"]["sharder"], "fsdp");
    let yaml = v["export"]["text"].as_str().unwrap();
    assert!(yaml.contains("distributed_type: 'FSDP'"), "{yaml}");
    assert!(yaml.contains("fsdp_reshard_after_forward: true"), "{yaml}");
    assert!(yaml.contains("fsdp_version: 2"), "{yaml}");
}

/// Offload is budgeted: the estimate moves the optimizer state to the host, and the plan's
/// export no longer says offload is not in the budget.
#[test]
fn offload_is_in_the_budget_and_its_export() {
    let est = |extra: &[&str]| -> serde_json::Value {
        let mut a = argv("estimate --runtime pytorch --ranks 8 --batch 8 --zero 2 --json");
        a.extend_from_slice(extra);
        json(&a)
    };
    let on = est(&[]);
    let off = est(&["--offload", "optimizer"]);
    assert_eq!(off["static_bytes"]["optimizer_state"], 0);
    assert!(off["static_bytes"]["host_bytes"].as_u64().unwrap() > 0);
    assert!(off["peak_bytes"].as_u64().unwrap() < on["peak_bytes"].as_u64().unwrap());
    assert_eq!(off["spec"]["recipe"]["offload"], "optimizer");
    let v = plan(&argv(
        "--zero 2 --budget 40GiB --emit deepspeed --emit-offload optimizer",
    ));
    assert_eq!(v["plan"]["recipe"]["offload"], "optimizer");
    let json: serde_json::Value =
        serde_json::from_str(v["export"]["text"].as_str().unwrap()).unwrap();
    assert_eq!(
        json["zero_optimization"]["offload_optimizer"]["device"],
        "cpu"
    );
    assert!(!v["export"]["notes"]
        .to_string()
        .contains("not in the budget"));
}

/// Bad sharding input names the flag or field and what is allowed (exit 2).
#[test]
fn bad_sharding_input_names_the_field() {
    for (args, field) in [
        (
            &argv("estimate --ranks 8 --batch 8 --offload optimizer")[..],
            "recipe.offload",
        ),
        (
            &argv("estimate --ranks 8 --batch 8 --zero 1 --sharder fsdp")[..],
            "recipe.sharder",
        ),
        (
            &argv("estimate --ranks 8 --batch 8 --sharder megatron")[..],
            "--sharder",
        ),
        (
            &argv("estimate --ranks 8 --batch 8 --gradient-as-bucket-view maybe")[..],
            "--gradient-as-bucket-view",
        ),
    ] {
        let (code, _, err) = ditmem(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.contains(field) && err.contains("allowed"),
            "{args:?}: {err}"
        );
    }
}
