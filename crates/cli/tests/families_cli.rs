//! The diffusers families through the binary: the `pytorch` runtime held against the real
//! diffusers classes (the peer's measurements, committed in `bench/torch_peer/results/`), the
//! engine's refusal, and the CUDA side on a family (fits, quantized bases, plans on a GPU).

mod common;

use common::ditmem;
use serde_json::Value;

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root")
}

fn json(args: &[&str]) -> Value {
    let (code, out, err) = ditmem(args);
    assert_eq!(code, 0, "{args:?}: {err}");
    serde_json::from_str(&out).expect("JSON")
}

/// `bench/torch_peer/family_peer.py` measured 34 tiny specs of the six diffusers families on the
/// CPU (torch 2.15, diffusers 0.42.1, peft 0.21.2; `results/families.json`); the estimate of
/// each spec file is held against its measured peak. fp32 specs within 2 % each. bf16 specs
/// within 10 %: where one misses 2 % its peak falls inside a bf16 `mm`/`addmm` whose oneDNN
/// scratchpad the SD3 and Flux rules do not model (the note of issue 14 lists them); the median
/// over all within 0.5 %.
#[test]
fn the_pytorch_runtime_holds_against_the_diffusers_classes() {
    let root = root();
    let results: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("bench/torch_peer/results/families.json"))
            .expect("the peer's results"),
    )
    .expect("JSON");
    let rows = results["rows"].as_array().expect("rows");
    assert!(rows.len() >= 30, "{} specs", rows.len());
    let mut errs = Vec::new();
    let mut families = std::collections::BTreeSet::new();
    for row in rows {
        let file = root.join(row["file"].as_str().expect("file"));
        let measured = row["measured"].as_u64().expect("measured peak");
        let b = json(&[
            "estimate",
            "--config",
            file.to_str().unwrap(),
            "--runtime",
            "pytorch",
            "--json",
        ]);
        let pred = b["peak_bytes"].as_u64().expect("peak");
        let err = pred as f64 / measured as f64 - 1.0;
        let spec = row["spec"].as_str().unwrap();
        families.insert(row["family"].as_str().unwrap().to_string());
        let limit = if spec.contains("fp32") { 0.02 } else { 0.10 };
        assert!(
            err.abs() <= limit,
            "{spec}: predicted {pred} vs measured {measured} ({:+.2} %)",
            err * 100.0
        );
        errs.push(err.abs());
    }
    errs.sort_by(f64::total_cmp);
    let median = errs[errs.len() / 2];
    assert!(median <= 0.005, "median |pred/meas − 1| {median}");
    assert_eq!(families.len(), 6, "{families:?}");
}

#[test]
fn the_engine_refuses_a_family_and_the_pytorch_runtime_takes_it() {
    let (code, _, err) = ditmem(&[
        "estimate",
        "--preset",
        "flux.1-dev",
        "--runtime",
        "ditmem-cpu",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("ditmem-cpu runs only the original DiT"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1);
    for preset in [
        "flux.1-dev",
        "flux.1-schnell",
        "sd3-medium",
        "sd3.5-medium",
        "sd3.5-large",
        "pixart-alpha-1024",
        "pixart-sigma-1024",
        "sana-600m",
        "sana-1600m",
        "wan2.1-1.3b",
        "dit-xl-2-256",
    ] {
        let b = json(&[
            "estimate",
            "--preset",
            preset,
            "--resolution",
            "256",
            "--batch",
            "1",
            "--runtime",
            "pytorch:cuda",
            "--json",
        ]);
        let params = &b["params"];
        assert!(params["total"].as_u64().unwrap() > 500_000_000, "{preset}");
        let peak = b["peak_bytes"].as_u64().unwrap();
        // Weights, master copies, gradients and AdamW state at least: 16 bytes per parameter.
        assert!(
            peak > 16 * params["trained"].as_u64().unwrap(),
            "{preset}: {peak}"
        );
        assert!(
            b["cuda"]["max_reserved_bytes"].as_u64().unwrap() >= peak,
            "{preset}"
        );
    }
    // Text tokens per encoder are checked against the family's encoders.
    let (code, _, err) = ditmem(&[
        "estimate",
        "--preset",
        "sd3-medium",
        "--text-tokens",
        "77",
        "--runtime",
        "pytorch",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("workload.text_tokens"), "{err}");
    // Wan's frames are 1 + 4k.
    let (code, _, err) = ditmem(&[
        "estimate",
        "--preset",
        "wan2.1-1.3b",
        "--frames",
        "80",
        "--runtime",
        "pytorch",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("workload.frames"), "{err}");
}

/// Flux.1-dev LoRA at 1024² on a 24 GB card: the bf16 base alone is 22.2 GiB and does not fit;
/// stored as NF4 (QLoRA) it does, and more tokens (frames of a video model) need more memory.
#[test]
fn a_quantized_base_makes_flux_lora_fit_a_24_gb_card() {
    let run = |quant: &str| {
        json(&[
            "estimate",
            "--preset",
            "flux.1-dev",
            "--resolution",
            "1024",
            "--batch",
            "1",
            "--lora-rank",
            "16",
            "--recompute",
            "all",
            "--optimizer",
            "adamw-8bit",
            "--base-quant",
            quant,
            "--gpu",
            "rtx-4090",
            "--json",
        ])
    };
    let bf16 = run("none");
    let nf4 = run("nf4");
    assert_eq!(bf16["fits"], Value::Bool(false));
    assert_eq!(nf4["fits"], Value::Bool(true));
    let w = |b: &Value| b["static_bytes"]["weights"].as_u64().unwrap();
    // NF4: about a quarter of the bf16 bytes for the block linears.
    assert!(w(&nf4) * 3 < w(&bf16), "{} vs {}", w(&nf4), w(&bf16));
    assert_eq!(bf16["params"]["trained"], nf4["params"]["trained"]);
    let frames = |n: &str| {
        json(&[
            "estimate",
            "--preset",
            "wan2.1-1.3b",
            "--resolution",
            "480x832",
            "--frames",
            n,
            "--batch",
            "1",
            "--runtime",
            "pytorch:cuda",
            "--json",
        ])["peak_bytes"]
            .as_u64()
            .unwrap()
    };
    assert!(frames("81") > frames("17"));
}

/// `plan --gpu` budgets the card and fits what the device shows.
#[test]
fn a_plan_on_a_gpu_fits_its_device_bytes() {
    let p = json(&[
        "plan",
        "--preset",
        "dit-xl-2",
        "--resolution",
        "512",
        "--batch",
        "32",
        "--gpu",
        "rtx-4090",
        "--json",
    ]);
    let cap = 24_563u64 << 20;
    assert_eq!(p["budget_bytes"].as_u64(), Some(cap));
    let peak = p["predicted_peak_bytes"].as_u64().unwrap();
    assert!(peak <= cap, "{peak}");
    let spec = &p["plan"];
    let text = serde_json::to_string(spec).unwrap();
    let file = common::temp_dir("families", "plan").join("plan.json");
    std::fs::write(&file, text).unwrap();
    let b = json(&["estimate", "--config", file.to_str().unwrap(), "--json"]);
    assert_eq!(b["fits"], Value::Bool(true));
    assert_eq!(b["cuda"]["device_bytes"].as_u64(), Some(peak));
}

/// `ditmem-cpu` budgets PixArt (the engine runs it), and refuses what its engine does not run
/// yet, naming the field: PixArt-α's size embedders (sample_size 128), LoRA on PixArt.
#[test]
fn the_engine_budgets_pixart_and_refuses_what_it_does_not_run() {
    let b = json(&[
        "estimate",
        "--preset",
        "pixart-sigma-1024",
        "--resolution",
        "256",
        "--runtime",
        "ditmem-cpu",
        "--json",
    ]);
    assert_eq!(b["runtime"], "ditmem-cpu");
    assert!(b["peak_bytes"].as_u64().unwrap() > 0);
    for (args, field) in [
        (
            vec!["--preset", "pixart-alpha-1024"],
            "model.diffusers.use_additional_conditions",
        ),
        (
            vec!["--preset", "pixart-sigma-1024", "--lora-rank", "4"],
            "recipe.lora",
        ),
    ] {
        let mut a = vec!["estimate", "--runtime", "ditmem-cpu"];
        a.extend(args);
        let (code, _, err) = ditmem(&a);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(field), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}
