//! `ditmem plan` as a user runs it: bad input, infeasible budgets, the base that fits, monotone
//! plans, exports, and — on the engine — every plan's measured peak within its budget.

use std::path::PathBuf;
mod common;

use common::{argv, argv_with, ditmem, exits_naming, json, strs, temp_dir};

/// A spec small enough to run in seconds on 2 cores: depth 3, hidden 128, 4 heads, patch 2,
/// 128×128 images (16×16 latents, 64 tokens), batch 8, fp32, materialized attention.
const SMALL: &str = r#"
[model]
name = "small"
depth = 3
hidden = 128
heads = 4
patch = 2
num_classes = 10

[workload]
height = 128
width = 128
batch = 8
microbatch = 8

[recipe]
precision = "fp32"
attention = "materialized"
recompute = "none"
"#;

/// A fresh folder for `test` with [`SMALL`] in it: (the folder, the spec file's path).
fn small_config(test: &str) -> (PathBuf, String) {
    let d = temp_dir("plan", test);
    let p = d.join("small.toml");
    std::fs::write(&p, SMALL).unwrap();
    (d, p.display().to_string())
}

fn plan_json(config: &str, budget: &str, extra: &[&str]) -> (i32, serde_json::Value) {
    let mut a = vec!["plan", "--config", config, "--budget", budget, "--json"];
    a.extend_from_slice(extra);
    let (code, out, err) = ditmem(&a);
    assert!(code == 0 || code == 3, "exit {code}; stderr: {err}");
    (
        code,
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("JSON: {e}\n{out}")),
    )
}

fn u(v: &serde_json::Value) -> u64 {
    v.as_u64().expect("an unsigned integer")
}

/// The plan of `config` (with `extra`) under a budget nothing fits: (the smallest peak the
/// search finds, the base's peak).
fn floor_and_base(config: &str, extra: &[&str]) -> (u64, u64) {
    let (_, v) = plan_json(config, "64KiB", extra);
    (u(&v["predicted_peak_bytes"]), u(&v["base_peak_bytes"]))
}

#[test]
fn bad_budget_exits_2_naming_the_flag() {
    for bad in ["lots", "0", "-4GiB", "24 parsecs"] {
        exits_naming(&["plan", "--budget", bad], 2, "--budget");
    }
    exits_naming(&argv("plan --budget 24GiB --headroom 1.5"), 2, "--headroom");
    exits_naming(&argv("plan --budget 24GiB --allow fp8"), 2, "--allow");
    exits_naming(
        &argv("plan --budget 24GiB --emit megatron"),
        2,
        "accelerate, deepspeed, deepspeed-standalone, diffusers",
    );
}

#[test]
fn infeasible_budget_exits_3_with_the_floor() {
    let (d, cfg) = small_config("infeasible");
    let out = d.join("never.toml");
    let (code, v) = plan_json(&cfg, "64KiB", &["--out", out.to_str().unwrap()]);
    assert_eq!(code, 3);
    assert_eq!(v["feasible"], false);
    let floor = u(&v["predicted_peak_bytes"]);
    assert!(floor > 64 << 10);
    assert!(floor <= u(&v["base_peak_bytes"]));
    assert!(v["reason"].as_str().unwrap().contains("smallest peak"));
    assert!(v["dominant"].is_string());
    assert!(!out.exists(), "an infeasible plan writes no spec");
    // The human form says it too, on stderr with the floor.
    let (code, _, err) = ditmem(&["plan", "--config", &cfg, "--budget", "64KiB"]);
    assert_eq!(code, 3);
    assert!(err.contains("the smallest found needs"), "{err}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn json_has_the_documented_fields_and_the_plan_runs_as_written() {
    let (d, cfg) = small_config("fields");
    let out = d.join("plan.toml");
    let (code, v) = plan_json(&cfg, "1GiB", &["--out", out.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert_eq!(v["feasible"], true);
    assert!(v["plan"]["recipe"]["precision"].is_string());
    assert!(u(&v["predicted_peak_bytes"]) <= u(&v["usable_bytes"]));
    assert!(v["predicted_step_time_s"].as_f64().unwrap() > 0.0);
    assert!(!v["pareto"].as_array().unwrap().is_empty());
    // The file is a spec that `ditmem spec --config` reads back to the same plan.
    let (code, back, err) = ditmem(&["spec", "--config", out.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let back: serde_json::Value = serde_json::from_str(&back).unwrap();
    assert_eq!(back, v["plan"]);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_budget_that_fits_the_base_returns_it_unchanged() {
    let (d, cfg) = small_config("fits");
    // The fastest recipe of the space under an ample budget...
    let best = d.join("best.toml");
    let (_, v) = plan_json(&cfg, "8GiB", &["--out", best.to_str().unwrap()]);
    let peak = u(&v["predicted_peak_bytes"]);
    // ...given back as the base, under any budget it fits, comes back unchanged.
    for budget in [peak * 2, (peak as f64 / 0.95).ceil() as u64 + 16] {
        let (code, w) = plan_json(best.to_str().unwrap(), &budget.to_string(), &[]);
        assert_eq!(code, 0);
        assert_eq!(w["base_fits"], true);
        assert_eq!(w["plan"], v["plan"], "budget {budget}");
        assert!(w["changes"].as_array().unwrap().is_empty());
        assert!(w["reason"].as_str().unwrap().contains("already fits"));
    }
    // A base that fits but is not the fastest is replaced only by a strictly faster plan that
    // fits (else a smaller budget could yield a faster plan).
    let (_, w) = plan_json(&cfg, "8GiB", &[]);
    if !w["changes"].as_array().unwrap().is_empty() {
        assert!(
            w["predicted_step_time_s"].as_f64().unwrap() < w["base_step_time_s"].as_f64().unwrap()
        );
    }
    std::fs::remove_dir_all(&d).ok();
}

/// Within the levers that keep what is trained (LoRA and 8-bit AdamW are used only when nothing
/// fits without them, and LoRA is faster, so across that line a smaller budget can be faster).
#[test]
fn a_smaller_budget_never_yields_a_faster_plan() {
    let (d, cfg) = small_config("monotone");
    let keep = ["--allow", "sharding,bf16-pure,precision"];
    let (floor, base) = floor_and_base(&cfg, &keep);
    let (floor, base) = (floor as f64, base as f64);
    let mut last = 0.0f64;
    for i in (0..=12).rev() {
        let budget = ((floor + (base * 1.2 - floor) * i as f64 / 12.0) / 0.95) as u64 + 1;
        let (code, p) = plan_json(&cfg, &budget.to_string(), &keep);
        assert_eq!(code, 0, "budget {budget} is above the floor");
        let t = p["predicted_step_time_s"].as_f64().unwrap();
        assert!(t >= last * (1.0 - 1e-12), "budget {budget}: {t} < {last}");
        assert!(u(&p["predicted_peak_bytes"]) <= u(&p["usable_bytes"]));
        last = t;
        // With every lever allowed, the same budget gives the same plan: LoRA and 8-bit AdamW
        // are not used where the plan without them fits.
        let (code, all) = plan_json(&cfg, &budget.to_string(), &["--allow", "all"]);
        assert_eq!(code, 0);
        assert_eq!(all["plan"], p["plan"], "budget {budget}");
    }
    // Below that floor, only LoRA or 8-bit AdamW fits.
    let below = (floor * 0.97 / 0.95) as u64;
    let (code, p) = plan_json(&cfg, &below.to_string(), &["--allow", "all"]);
    if code == 0 {
        let r = &p["plan"]["recipe"];
        assert!(
            !r["lora"].is_null() || r["optimizer"] == "adamw-8bit",
            "{}",
            p["reason"]
        );
        assert!(p["reason"]
            .as_str()
            .unwrap()
            .contains("used because nothing fits without"));
    }
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn exports_and_the_pareto_plot_are_written() {
    let (d, cfg) = small_config("export");
    let svg = d.join("pareto.svg");
    let yaml = d.join("accelerate.yaml");
    let (code, out, err) = ditmem(&argv_with(
        "plan --config {} --budget 1GiB --plot {} --emit accelerate --emit-out {}",
        &[&cfg, svg.to_str().unwrap(), yaml.to_str().unwrap()],
    ));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("Pareto front"));
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    let y = std::fs::read_to_string(&yaml).unwrap();
    // Quoted: PyYAML reads a plain `no` as False, which accelerate launch crashes on.
    assert!(y.contains("mixed_precision: 'no'"), "{y}");
    assert!(y.contains("gradient_accumulation_steps"), "{y}");
    for target in ["deepspeed", "deepspeed-standalone", "diffusers"] {
        let (code, out, err) = ditmem(&[
            "plan", "--config", &cfg, "--budget", "1GiB", "--emit", target,
        ]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("gradient_accumulation"), "{target}: {out}");
    }
    std::fs::remove_dir_all(&d).ok();
}

/// The plans of several budgets, each run on the engine (counting allocator in the binary):
/// the measured peak of the step (process peak − the baseline before the trainer existed) must be
/// within the budget. Plans come from the default space (no 8-bit AdamW, ZeRO or VAE), which the
/// engine executes.
#[test]
fn plans_run_on_the_engine_within_their_budget() {
    let (d, cfg) = small_config("engine");
    let engine = ["--runtime", "ditmem-cpu"];
    let (floor, base) = floor_and_base(&cfg, &engine);
    let mut failures = Vec::new();
    for frac in [1.3, 0.75, 0.55, 0.35, 0.0] {
        // Budgets between the floor (÷ headroom, so it is feasible) and above the base.
        let budget = ((floor as f64 + (base as f64 - floor as f64) * frac) / 0.95) as u64 + 1;
        let out = d.join(format!("plan-{frac}.toml"));
        let (code, p) = plan_json(
            &cfg,
            &budget.to_string(),
            &[&engine[..], &["--out", out.to_str().unwrap()]].concat(),
        );
        assert_eq!(code, 0);
        assert_eq!(p["engine_runnable"], true);
        let (code, run, err) = ditmem(&argv_with(
            "run --config {} --warmup 1 --steps 1 --json",
            &[out.to_str().unwrap()],
        ));
        assert_eq!(code, 0, "run of {}: {err}", out.display());
        let r: serde_json::Value = serde_json::from_str(&run).unwrap();
        assert_eq!(r["spec"], p["plan"], "the run executes the plan exactly");
        let measured = u(&r["peak_bytes"]) - u(&r["baseline_bytes"]);
        let predicted = u(&p["predicted_peak_bytes"]);
        eprintln!(
            "budget {budget} B: plan {:?} → predicted {predicted} B, measured {measured} B ({:+.2} % vs predicted, {:.1} % of the budget)",
            p["changes"],
            100.0 * (measured as f64 / predicted as f64 - 1.0),
            100.0 * measured as f64 / budget as f64
        );
        if measured > budget {
            failures.push(format!(
                "budget {budget} B: measured {measured} B exceeds it by {} B ({:.2} %)",
                measured - budget,
                100.0 * (measured as f64 / budget as f64 - 1.0)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    std::fs::remove_dir_all(&d).ok();
}

/// `--precision fp16-mixed` is what a T4 or V100 can run: the planner keeps it (it used to
/// switch to bf16-mixed), unless `--allow precision`.
#[test]
fn a_requested_precision_is_kept_unless_allowed() {
    let plan = |extra: &[&str]| {
        // On the engine's CPU, where bf16 is the faster half precision.
        let mut args =
            argv("plan --runtime ditmem-cpu --precision fp16-mixed --budget 24GiB --json");
        args.extend_from_slice(extra);
        json(&args)
    };
    let kept = plan(&[]);
    assert_eq!(kept["plan"]["recipe"]["precision"], "fp16-mixed");
    assert_eq!(kept["allow"]["precision"], false);
    let free = plan(&["--allow", "precision"]);
    assert_eq!(free["allow"]["precision"], true);
    assert_eq!(free["plan"]["recipe"]["precision"], "bf16-mixed");
    // Without --precision, the default may change.
    let v = json(&argv("plan --budget 24GiB --json"));
    assert_eq!(v["allow"]["precision"], true);
}

/// A ZeRO-3 plan's launch line starts DeepSpeed stage 3 (it used to say --multi_gpu, plain DDP).
#[test]
fn a_zero3_plan_launches_deepspeed_stage_3() {
    let v = json(&argv(
        "plan --ranks 8 --batch 256 --budget 8GiB --allow sharding --emit diffusers --json",
    ));
    assert_eq!(v["plan"]["recipe"]["zero_stage"], 3, "{}", v["reason"]);
    let launcher = strs(&v["export"]["command"]["launcher"]);
    assert!(launcher.contains(&"--use_deepspeed"), "{launcher:?}");
    assert!(!launcher.contains(&"--multi_gpu"), "{launcher:?}");
    let i = launcher.iter().position(|a| *a == "--zero_stage").unwrap();
    assert_eq!(launcher[i + 1], "3");
}
