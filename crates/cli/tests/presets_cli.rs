//! Every preset and every saved `config.json` through `spec`, `estimate`, `plan` and `params`:
//! exit codes from the README's table only (0 ok, 2 bad input, 3 does not fit; never 101, a
//! panic), `spec` → TOML → `estimate --config` answering as `estimate --preset` does, and each
//! preset's training defaults (issue 44).

mod common;

use std::path::{Path, PathBuf};

use common::{argv, argv_with, ditmem, temp_dir};
use ditmem_budget::{denoiser, Runtime, Spec};

/// The exit codes these commands may give (README): ok, bad input, does not fit / refused.
const DOCUMENTED: [i32; 3] = [0, 2, 3];

/// Every preset, as the code lists them (diffusers checkpoints, then the original DiTs).
fn presets() -> Vec<String> {
    ditmem_budget::family_preset_names()
}

/// The published transformer `config.json` files kept as test data (with their `null`s), and
/// the tiny configs beside them.
fn saved_configs() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../budget/tests/data/saved_configs");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("saved configs")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    v.sort();
    assert!(v.len() >= 12, "the published configs are there: {v:?}");
    v
}

fn arg(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// Run and hold the exit code to the table; a panic's message never reaches stderr.
fn documented(args: &[&str]) -> (i32, String, String) {
    let (code, out, err) = ditmem(args);
    assert!(
        DOCUMENTED.contains(&code),
        "{args:?}: exit {code} is outside the documented {DOCUMENTED:?}\n{err}"
    );
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    if code != 0 {
        assert_eq!(err.lines().count(), 1, "{args:?}: one line: {err}");
    }
    (code, out, err)
}

/// The model flags of every preset and every saved config.
fn models() -> Vec<(String, Vec<String>)> {
    let mut v: Vec<(String, Vec<String>)> = presets()
        .into_iter()
        .map(|p| (p.clone(), vec!["--preset".into(), p]))
        .collect();
    for c in saved_configs() {
        let name = c.file_name().unwrap().to_string_lossy().into_owned();
        v.push((name, vec!["--model".into(), arg(&c).into()]));
    }
    v
}

#[test]
fn spec_estimate_and_params_on_every_preset_and_config() {
    for (_, model) in models() {
        let m: Vec<&str> = model.iter().map(String::as_str).collect();
        let preset = m[0] == "--preset";
        for cmd in ["spec", "estimate", "params"] {
            let mut args = vec![cmd];
            args.extend(&m);
            let (code, out, err) = documented(&args);
            // Every preset works; a saved config may be refused (a tiny one outside what is
            // modelled, e.g. Wan's temporal patch 2), then naming the key.
            if preset {
                assert_eq!(code, 0, "{args:?}: {err}");
            } else if code == 2 {
                assert!(
                    err.contains("model.diffusers.") || err.contains("--model"),
                    "{err}"
                );
            }
            if code == 0 {
                assert!(!out.is_empty(), "{args:?}");
            }
        }
    }
}

/// `plan` on every diffusers preset and every saved config, and on two of the original DiTs:
/// the DiTs' default batch 32 makes each plan take seconds (1–4 s here), and they differ only in
/// size. On an H100 without levers, so a full fine-tune that cannot fit ends at once (exit 3);
/// `--out` writes the plan through the TOML path that used to panic on a `null`.
#[test]
fn plan_on_every_diffusers_preset_and_config() {
    let dir = temp_dir("presets", "plan");
    let diffusers = presets()
        .into_iter()
        .filter(|p| ditmem_budget::preset_config(p).is_some());
    let dits = ["dit-s-8", "dit-xl-2"].map(String::from);
    let mut runs: Vec<(String, Vec<String>)> = diffusers
        .chain(dits)
        .map(|p| (p.clone(), vec!["--preset".into(), p]))
        .collect();
    for c in saved_configs() {
        let name = c.file_name().unwrap().to_string_lossy().into_owned();
        runs.push((name, vec!["--model".into(), arg(&c).into()]));
    }
    let mut fitted = 0;
    for (i, (name, model)) in runs.iter().enumerate() {
        let out = dir.join(format!("plan-{i}.toml"));
        let mut args: Vec<&str> = vec!["plan", "--gpu", "h100-80gb", "--out", arg(&out)];
        args.extend(model.iter().map(String::as_str));
        let (code, _, err) = documented(&args);
        if code == 0 {
            fitted += 1;
            // The written plan reads back.
            let text = std::fs::read_to_string(&out).expect("the plan was written");
            Spec::from_toml(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
            let (c, _, e) = documented(&["estimate", "--config", arg(&out)]);
            assert_eq!(c, 0, "{name}: {e}");
        } else {
            assert!(
                !out.exists(),
                "{name}: no plan written on exit {code}: {err}"
            );
        }
    }
    assert!(fitted >= 10, "most fit an H100: {fitted} of {}", runs.len());
    // With LoRA allowed, a preset with a null in its config (Wan: added_kv_proj_dim) fits
    // and its plan is written.
    let out = dir.join("wan-lora.toml");
    let (code, _, err) = documented(&argv_with(
        "plan --preset wan2.1-1.3b --gpu h100-80gb --allow lora --out {}",
        &[arg(&out)],
    ));
    assert_eq!(code, 0, "{err}");
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(
        text.contains("diffusers_null = [\"added_kv_proj_dim\"]"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `spec … > s.toml; estimate --config s.toml` answers as `estimate …` (the whole JSON report,
/// the spec in it included), for every preset and every saved config that `spec` accepts.
#[test]
fn spec_round_trips_through_toml_to_the_same_estimate() {
    let dir = temp_dir("presets", "round-trip");
    for (i, (name, model)) in models().into_iter().enumerate() {
        let m: Vec<&str> = model.iter().map(String::as_str).collect();
        let mut args = vec!["spec"];
        args.extend(&m);
        let (code, toml, _) = documented(&args);
        if code != 0 {
            continue;
        }
        let file = dir.join(format!("s{i}.toml"));
        std::fs::write(&file, &toml).unwrap();
        let mut direct = vec!["estimate", "--json"];
        direct.extend(&m);
        let (c1, a, e1) = documented(&direct);
        let (c2, b, e2) = documented(&["estimate", "--json", "--config", arg(&file)]);
        assert_eq!((c1, c2), (0, 0), "{name}: {e1} {e2}");
        assert_eq!(
            a, b,
            "{name}: estimate --config of its spec differs\n{toml}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The spec `spec` prints for `args`.
fn spec_of(args: &[&str]) -> Spec {
    let mut a = vec!["spec", "--json"];
    a.extend(args);
    let (code, out, err) = ditmem(&a);
    assert_eq!(code, 0, "{a:?}: {err}");
    Spec::from_json(&out).expect("spec --json reads back")
}

/// (height, width, frames, batch, microbatch, accumulation, ranks) of a spec's workload.
fn workload(s: &Spec) -> (u32, u32, u32, u32, u32, u32, u32) {
    let w = &s.workload;
    (
        w.height,
        w.width,
        w.frames,
        w.batch,
        w.microbatch,
        w.accumulation,
        w.ranks,
    )
}

fn text_tokens(s: &Spec) -> Vec<u64> {
    let fm = denoiser::family(s).unwrap().expect("a diffusers model");
    denoiser::text_tokens(s, &fm.geometry())
}

/// A preset, its (height, width, frames) and its text tokens per encoder.
type Defaults = (&'static str, (u32, u32, u32), &'static [u64]);

#[test]
fn each_preset_brings_its_family_defaults() {
    let cuda: Runtime = "pytorch:cuda".parse().unwrap();
    // Resolution and frames of the family's diffusers pipeline; one sample per rank; the text
    // tokens its training script encodes (CLIP 77 and T5 512 for FLUX.1-dev, 256 for schnell;
    // SD3's dreambooth script 77 + 77; PixArt-α 120, Σ 300; Sana 300; Wan 512).
    let table: [Defaults; 11] = [
        ("flux.1-dev", (1024, 1024, 1), &[77, 512]),
        ("flux.1-schnell", (1024, 1024, 1), &[77, 256]),
        ("sd3-medium", (1024, 1024, 1), &[77, 77]),
        ("sd3.5-medium", (1024, 1024, 1), &[77, 77]),
        ("sd3.5-large", (1024, 1024, 1), &[77, 77]),
        ("pixart-alpha-1024", (1024, 1024, 1), &[120]),
        ("pixart-sigma-1024", (1024, 1024, 1), &[300]),
        ("sana-600m", (1024, 1024, 1), &[300]),
        ("sana-1600m", (1024, 1024, 1), &[300]),
        ("wan2.1-1.3b", (480, 832, 81), &[512]),
        ("wan2.1-14b", (480, 832, 81), &[512]),
    ];
    let diffusers: Vec<String> = presets()
        .into_iter()
        .filter(|p| ditmem_budget::preset_config(p).is_some() && !p.starts_with("dit-"))
        .collect();
    assert_eq!(diffusers.len(), table.len(), "every family preset is held");
    for (preset, (h, w, f), tokens) in table {
        let s = spec_of(&["--preset", preset]);
        assert_eq!(workload(&s), (h, w, f, 1, 1, 1, 1), "{preset}");
        assert_eq!(s.runtime, cuda, "{preset}");
        assert_eq!(text_tokens(&s), tokens, "{preset}");
        assert!(
            s.workload.text_tokens.is_none(),
            "{preset}: the family's own"
        );
        // Batch is per rank: 8 ranks train 8 samples, one each.
        let s = spec_of(&["--preset", preset, "--ranks", "8"]);
        assert_eq!(workload(&s), (h, w, f, 8, 1, 1, 8), "{preset} --ranks 8");
    }
    // The estimate answers at the family's resolution, batch 1.
    let (code, out, err) = ditmem(&["estimate", "--preset", "flux.1-dev"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("1024×1024"), "{out}");
    assert!(
        out.lines().next().is_some_and(|l| l.contains(", batch 1;")),
        "{out}"
    );
    // The DiTs (original and diffusers' class) keep the DiT workload: 256², batch 32.
    for preset in presets().iter().filter(|p| p.starts_with("dit-")) {
        let s = spec_of(&["--preset", preset]);
        assert_eq!(workload(&s), (256, 256, 1, 32, 32, 1, 1), "{preset}");
        // Per rank: 32 on each of 8 ranks.
        let s = spec_of(&["--preset", preset, "--ranks", "8"]);
        assert_eq!(workload(&s), (256, 256, 1, 256, 32, 1, 8), "{preset}");
    }
    // A checkpoint's own config: PixArt-α per checkpoint from its sample_size (a 512 one at
    // 512²), read by --model as by --preset.
    let dir = temp_dir("presets", "pixart-512");
    let cfg = dir.join("config.json");
    let text = ditmem_budget::preset_config("pixart-alpha-1024")
        .unwrap()
        .replace("\"sample_size\": 128", "\"sample_size\": 64");
    std::fs::write(&cfg, text).unwrap();
    let s = spec_of(&["--model", arg(&cfg)]);
    assert_eq!(workload(&s), (512, 512, 1, 1, 1, 1, 1));
    let saved = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../budget/tests/data/saved_configs/wan2.1-1.3b.json");
    let s = spec_of(&["--model", arg(&saved)]);
    assert_eq!(workload(&s), (480, 832, 81, 1, 1, 1, 1));
    std::fs::remove_dir_all(&dir).ok();
}

/// The layers: the command's default, the family's defaults, the fields the --config file
/// states, the flags.
#[test]
fn config_fields_and_flags_win_over_family_defaults() {
    let dir = temp_dir("presets", "layers");
    // Flags over the family's defaults; --batch is over all ranks.
    let s = spec_of(&argv("--preset flux.1-dev --resolution 512 --batch 4"));
    assert_eq!(workload(&s), (512, 512, 1, 4, 4, 1, 1));
    let s = spec_of(&["--preset", "flux.1-dev", "--batch", "8", "--ranks", "4"]);
    assert_eq!(workload(&s), (1024, 1024, 1, 8, 2, 1, 4));
    let s = spec_of(&argv("--preset sd3.5-medium --microbatch 2 --ranks 8"));
    assert_eq!(workload(&s), (1024, 1024, 1, 16, 2, 1, 8));
    // A DiT spec file with another model: the file's workload and recipe stay.
    let (_, toml, _) = ditmem(&argv("spec --preset dit-xl-2 --attention materialized"));
    let file = dir.join("dit.toml");
    std::fs::write(&file, &toml).unwrap();
    let s = spec_of(&["--config", arg(&file), "--preset", "pixart-sigma-1024"]);
    assert_eq!(workload(&s), (256, 256, 1, 32, 32, 1, 1));
    assert_eq!(s.recipe.attention.name(), "materialized", "the file's");
    assert!(s.model.diffusers.is_some());
    // What the file does not state comes from the family: Wan's 81 frames.
    let s = spec_of(&argv_with(
        "--config {} --preset wan2.1-1.3b --resolution 480x832",
        &[arg(&file)],
    ));
    assert_eq!(workload(&s), (480, 832, 81, 32, 32, 1, 1));
    // A file written by `spec` for the family keeps its own values (here, 2 per rank).
    let (_, toml, _) = ditmem(&["spec", "--preset", "sana-600m", "--microbatch", "2"]);
    let file = dir.join("sana.toml");
    std::fs::write(&file, &toml).unwrap();
    let s = spec_of(&["--config", arg(&file)]);
    assert_eq!(workload(&s), (1024, 1024, 1, 2, 2, 1, 1));
    let s = spec_of(&argv_with(
        "--config {} --preset sana-1600m --ranks 4",
        &[arg(&file)],
    ));
    assert_eq!(workload(&s), (1024, 1024, 1, 8, 2, 1, 4));
    std::fs::remove_dir_all(&dir).ok();
}

/// `--depth` (issue 51): every preset at one block of each kind keeps its hidden size and
/// estimates fewer trained parameters; the spec carries it through TOML (`model.keep_blocks`)
/// to the same estimate; counts outside the model are refused naming `--depth`.
#[test]
fn depth_keeps_the_width_of_every_preset() {
    let dir = temp_dir("presets", "depth");
    let estimate = |args: &[&str]| -> serde_json::Value {
        let mut a = vec!["estimate", "--json"];
        a.extend(args);
        let (code, out, err) = documented(&a);
        assert_eq!(code, 0, "{args:?}: {err}");
        serde_json::from_str(&out).expect("JSON")
    };
    let trained = |v: &serde_json::Value| v["params"]["trained"].as_u64().unwrap();
    for p in presets() {
        let full = estimate(&["--preset", &p]);
        let one = estimate(&["--preset", &p, "--depth", "1"]);
        assert_eq!(
            one["spec"]["model"]["hidden"], full["spec"]["model"]["hidden"],
            "{p}"
        );
        assert!(trained(&one) < trained(&full), "{p}");
        let (code, toml, err) = documented(&["spec", "--preset", &p, "--depth", "1"]);
        assert_eq!(code, 0, "{p}: {err}");
        let file = dir.join(format!("{p}.toml"));
        std::fs::write(&file, toml).unwrap();
        let back = estimate(&["--config", arg(&file)]);
        assert_eq!(trained(&back), trained(&one), "{p}");
        for bad in ["0", "1000", "1,1,1", "x"] {
            let (code, _, err) = documented(&["estimate", "--preset", &p, "--depth", bad]);
            assert_eq!(code, 2, "{p} --depth {bad}");
            assert!(err.contains("--depth") && err.contains("allowed"), "{err}");
        }
    }
}
