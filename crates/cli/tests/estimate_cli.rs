//! The `ditmem estimate` command as a user runs it: JSON fields, defaults, and bad input.

use std::path::PathBuf;
mod common;

use common::{argv, argv_with, ditmem, json_of};

fn temp_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ditmem-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn default_estimate_has_the_documented_json_fields() {
    let v = json_of(&["estimate"]);
    assert_eq!(v["params"]["total"], 675_129_632u64);
    assert_eq!(v["params"]["trained"], 674_834_720u64);
    assert_eq!(v["tokens"], 256);
    let peak = v["peak_bytes"].as_u64().unwrap();
    let sum: u64 = v["breakdown"]
        .as_object()
        .unwrap()
        .values()
        .map(|x| x.as_u64().unwrap())
        .sum();
    assert_eq!(sum, peak, "the breakdown adds up to the peak");
    assert!(v["peak_phase"].is_string());
    assert_eq!(v["spec"]["recipe"]["precision"], "bf16-mixed");
    assert_eq!(v["spec"]["workload"]["batch"], 32);
}

#[test]
fn no_arguments_runs_the_default_estimate() {
    let (code, out, _) = ditmem(&[]);
    assert_eq!(code, 0);
    assert!(out.contains("DiT-XL/2 256×256 (256 tokens)"));
    // The comparison with the rule of thumb is a detail: --verbose.
    assert!(!out.contains("weights × 4"));
    let (code, out, _) = ditmem(&["estimate", "--verbose"]);
    assert_eq!(code, 0);
    assert!(out.contains("weights × 4"));
}

#[test]
fn tokens_follow_resolution_and_patch() {
    for (res, preset, tokens) in [
        ("256", "dit-xl-2", 256),
        ("512", "dit-xl-2", 1024),
        ("256", "dit-xl-4", 64),
        ("256x512", "dit-s-2", 512),
    ] {
        let v = json_of(&argv_with(
            "estimate --preset {} --resolution {} --batch 1",
            &[preset, res],
        ));
        assert_eq!(v["tokens"], tokens, "{preset} at {res}");
    }
}

#[test]
fn spec_round_trips_through_a_file() {
    let (code, toml_text, _) = ditmem(&argv("spec --preset dit-s-4 --batch 8 --microbatch 2"));
    assert_eq!(code, 0);
    let p = temp_file("round.toml", &toml_text);
    let v = json_of(&["estimate", "--config", p.to_str().unwrap()]);
    assert_eq!(v["spec"]["workload"]["accumulation"], 4);
    assert_eq!(v["spec"]["model"]["patch"], 4);
}

/// Every class of bad input: exit 2, one line, naming the field.
#[test]
fn bad_input_names_the_field_and_exits_2() {
    let spec = |model: &str, workload: &str, recipe: &str| {
        format!("[model]\n{model}\n[workload]\n{workload}\n[recipe]\n{recipe}\n")
    };
    let ok_model = "depth = 2\nhidden = 64\nheads = 4\npatch = 2";
    let ok_work = "height = 128\nwidth = 128\nbatch = 2\nmicrobatch = 2";
    let files = [
        (
            "zero.toml",
            spec("depth = 0\nhidden = 64\nheads = 4\npatch = 2", ok_work, ""),
            "model.depth",
        ),
        (
            "neg.toml",
            spec("depth = -3\nhidden = 64\nheads = 4\npatch = 2", ok_work, ""),
            "model.depth",
        ),
        (
            "heads.toml",
            spec("depth = 2\nhidden = 64\nheads = 5\npatch = 2", ok_work, ""),
            "model.heads",
        ),
        (
            "res.toml",
            spec(
                ok_model,
                "height = 120\nwidth = 128\nbatch = 2\nmicrobatch = 2",
                "",
            ),
            "workload.height",
        ),
        (
            "split.toml",
            spec(
                ok_model,
                "height = 128\nwidth = 128\nbatch = 6\nmicrobatch = 2\naccumulation = 2",
                "",
            ),
            "workload.batch",
        ),
        (
            "field.toml",
            spec(ok_model, ok_work, "precison = \"fp32\""),
            "precison",
        ),
        (
            "lora.toml",
            spec(ok_model, ok_work, "[recipe.lora]\nrank = 65"),
            "recipe.lora.rank",
        ),
        (
            "blocks.toml",
            spec(ok_model, ok_work, "recompute = \"blocks:0,2\""),
            "recipe.recompute",
        ),
        ("malformed.toml", "[model\ndepth = 2".to_string(), "TOML"),
        ("bad.json", "{\"model\": {\"depth\": 2}".to_string(), "JSON"),
    ];
    for (name, text, field) in files {
        let p = temp_file(name, &text);
        let (code, out, err) = ditmem(&["estimate", "--config", p.to_str().unwrap()]);
        assert_eq!(code, 2, "{name}: exit code (stderr {err})");
        assert!(out.is_empty(), "{name}: nothing on stdout");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{name}: one line, got {err}"
        );
        assert!(err.contains(field), "{name}: '{err}' should name {field}");
        assert!(!err.contains("panicked"), "{name}: no panic");
    }
    let flags: [(&[&str], &str); 7] = [
        (&["--preset", "dit-xxl-2"], "--preset"),
        (&["--resolution", "300"], "workload.height"),
        (
            &["--batch", "32", "--microbatch", "8", "--accumulation", "3"],
            "workload.batch",
        ),
        (&["--recompute", "blocks:1,28"], "recipe.recompute"),
        (&["--lora-rank", "2000"], "recipe.lora.rank"),
        (&["--precision", "fp8"], "recipe.precision"),
        (
            &["--config", "/nonexistent/spec.toml"],
            "/nonexistent/spec.toml",
        ),
    ];
    for (args, field) in flags {
        let mut a = vec!["estimate"];
        a.extend_from_slice(args);
        let (code, _, err) = ditmem(&a);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(field), "{args:?}: '{err}' should name {field}");
    }
}

/// bitsandbytes' paged 8-bit AdamW keeps the 8-bit state of every tensor of at least 1e5
/// elements in CUDA managed memory: outside the caching allocator, so the allocated peak drops
/// by about those bytes (2 per element), which the report names apart; any other optimizer, or
/// another runtime, exits 2 naming the field.
#[test]
fn a_paged_optimizer_keeps_its_state_outside_the_allocator() {
    let run = |paged: &str| {
        let (code, out, err) = common::ditmem(&argv_with("estimate --preset dit-b-2 --batch 8 --optimizer adamw-8bit --paged-optimizer {} --json", &[paged]));
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let (off, on) = (run("off"), run("on"));
    assert_eq!(off["cuda"]["paged_bytes"], 0);
    let paged = on["cuda"]["paged_bytes"].as_u64().unwrap();
    // The bytes requested from the allocator drop by exactly the paged state (the state is
    // there at every event of the measured step); the allocated blocks by about as much (their
    // packing into segments changes too).
    let req = |v: &serde_json::Value| v["cuda"]["max_requested_bytes"].as_u64().unwrap();
    let alloc = |v: &serde_json::Value| v["cuda"]["max_allocated_bytes"].as_u64().unwrap();
    // DiT-B/2's large tensors (≥ 1e5 elements) hold nearly all of its ~130 M parameters.
    assert!(
        paged > 2 * 120_000_000 && paged < 2 * 131_000_000,
        "{paged}"
    );
    assert_eq!(req(&off) - req(&on), paged);
    let drop = alloc(&off) - alloc(&on);
    assert!(
        (drop as f64 - paged as f64).abs() <= 0.1 * paged as f64,
        "allocated drops by {drop}, paged {paged}"
    );
    for bad in [
        vec!["estimate", "--paged-optimizer", "on"],
        argv("estimate --optimizer adamw-8bit --paged-optimizer on --runtime ditmem-cpu"),
    ] {
        let (code, _, err) = common::ditmem(&bad);
        assert_eq!(code, 2, "{bad:?}: {err}");
        assert!(err.contains("recipe.paged_optimizer"), "{err}");
    }
}
