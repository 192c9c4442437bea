//! `ditmem compare --runtime pytorch`: the spec run by the PyTorch peer (`bench/torch_peer`),
//! its measured peak beside the budget's.

use std::path::{Path, PathBuf};

use anyhow::Context;
use ditmem_budget::fmt_bytes;

use crate::render::{fmt_count, recipe_line, spec_line, Table};
use crate::CliError;

/// The folder of the PyTorch peer (`bench/torch_peer`): `$DITMEM_TORCH_PEER` when set, else the
/// first of the binary's folder's ancestors (`target/release/ditmem` of a checkout) and the
/// working folder's ancestors that holds `bench/torch_peer/family_peer.py`. None: not found.
fn peer_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("DITMEM_TORCH_PEER") {
        return Some(PathBuf::from(d));
    }
    let holds = |root: &std::path::Path| {
        let d = root.join("bench").join("torch_peer");
        d.join("family_peer.py").is_file().then_some(d)
    };
    let exe = std::env::current_exe()
        .ok()
        .and_then(|e| std::fs::canonicalize(e).ok());
    let cwd = std::env::current_dir().ok();
    [exe, cwd]
        .into_iter()
        .flatten()
        .find_map(|start| start.ancestors().find_map(holds))
}

/// What the peer needs: its folder (`DITMEM_TORCH_PEER`, or found beside the binary or above
/// the working folder) and its Python, checked before any work: the default one missing is a
/// missing tool (exit 5); a `--python` that is not an executable regular file (a link to one is
/// fine) is bad input (exit 2), never "Permission denied" from the spawn after the budget ran.
fn check_python(flag: Option<&std::path::Path>) -> Result<(PathBuf, PathBuf), CliError> {
    use std::os::unix::fs::PermissionsExt;
    let Some(dir) = peer_dir() else {
        return Err(CliError::Missing(
            "the PyTorch peer (bench/torch_peer of a ditmem checkout) was not found beside the \
             binary nor above the working folder: set DITMEM_TORCH_PEER to its folder, then run \
             its setup.sh"
                .into(),
        ));
    };
    if !dir.join("family_peer.py").is_file() || !dir.join("peer.py").is_file() {
        return Err(CliError::Missing(format!(
            "the PyTorch peer's folder {} holds no family_peer.py and peer.py: set \
             DITMEM_TORCH_PEER to bench/torch_peer of a ditmem checkout",
            crate::flags::show(&dir.display().to_string())
        )));
    }
    let Some(path) = flag else {
        let python = dir.join(".venv/bin/python");
        return match std::fs::metadata(&python) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => Ok((dir, python)),
            _ => Err(CliError::Missing(format!(
                "the PyTorch peer is not installed ({} is missing): run \
                 bench/torch_peer/setup_diffusers.sh (setup.sh for the DiT peer alone) first, \
                 or name its Python with --python",
                crate::flags::show(&python.display().to_string())
            ))),
        };
    };
    let shown = crate::flags::show(&path.display().to_string());
    let bad = |why: String| {
        CliError::Spec(ditmem_budget::SpecError::invalid(
            "--python",
            format!("{shown} {why}; allowed: an executable Python interpreter (a regular file)"),
        ))
    };
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => Err(bad(format!(
            "is {}",
            crate::output::file_kind(m.file_type())
        ))),
        Ok(m) if m.permissions().mode() & 0o111 == 0 => Err(bad("is not executable".into())),
        Ok(_) => Ok((dir, path.to_path_buf())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(CliError::Missing(format!(
            "the PyTorch peer's Python (--python {shown}) does not exist: run \
             bench/torch_peer/setup.sh first, or name the peer's Python"
        ))),
        Err(e) => Err(bad(format!("cannot be read ({e})"))),
    }
}

/// Which peer runs the spec: `family_peer.py` (the real diffusers class of `model.diffusers`,
/// LoRA through PEFT) for a family spec, `peer.py` (the original DiT written out) otherwise. What
/// that peer does not run is refused here, by name (exit 2), before Python starts; the list is
/// the one each script refuses (bench/torch_peer/README.md).
fn peer_for(spec: &ditmem_budget::Spec) -> Result<&'static str, CliError> {
    use ditmem_budget::{BaseQuant, Optimizer, OptimizerImpl, Precision, Recompute};
    let r = &spec.recipe;
    let family = spec.model.diffusers.is_some();
    let refuse = |field: &str, what: String| {
        Err(CliError::Spec(ditmem_budget::SpecError::invalid(
            field,
            format!(
                "{what}: the PyTorch peer ({}) does not run it",
                if family { "family_peer.py" } else { "peer.py" }
            ),
        )))
    };
    if spec.workload.ranks > 1 {
        return refuse(
            "workload.ranks",
            format!("{} ranks (the peer runs one process)", spec.workload.ranks),
        );
    }
    if r.zero_stage > 0 {
        return refuse("recipe.zero_stage", format!("ZeRO stage {}", r.zero_stage));
    }
    if r.latents == ditmem_budget::Latents::Encode {
        return refuse(
            "recipe.latents",
            "encode (the peer has no VAE; use cached)".into(),
        );
    }
    if !r.text_encoders.is_cached() {
        return refuse(
            "recipe.text_encoders",
            format!(
                "{} (the peer reads cached text embeddings)",
                r.text_encoders.name()
            ),
        );
    }
    if r.base_quant != BaseQuant::default() {
        return refuse(
            "recipe.base_quant",
            format!(
                "{} (a quantized base needs bitsandbytes on CUDA)",
                r.base_quant.name()
            ),
        );
    }
    if r.optimizer == Optimizer::AdamW8bit || r.paged_optimizer {
        return refuse(
            "recipe.optimizer",
            "adamw-8bit (bitsandbytes runs on CUDA)".into(),
        );
    }
    if r.optimizer_impl == Some(OptimizerImpl::Fused) {
        return refuse(
            "recipe.optimizer_impl",
            "fused (the peer runs for-loop and foreach)".into(),
        );
    }
    if family {
        if !matches!(r.precision, Precision::Fp32 | Precision::Bf16Mixed) {
            return refuse(
                "recipe.precision",
                format!(
                    "{} (the family peer runs fp32, bf16-mixed)",
                    r.precision.name()
                ),
            );
        }
        if !matches!(r.recompute, Recompute::None | Recompute::All) {
            return refuse(
                "recipe.recompute",
                "a subset of the blocks (diffusers checkpoints every block or none)".into(),
            );
        }
        Ok("family_peer.py")
    } else {
        if r.lora.is_some() {
            return refuse(
                "recipe.lora",
                "LoRA on the original DiT (give a diffusers class in model.diffusers: family_peer.py runs LoRA)".into(),
            );
        }
        if matches!(r.precision, Precision::Bf16Pure) {
            return refuse("recipe.precision", "bf16-pure".into());
        }
        if r.recompute == Recompute::AttentionOnly {
            return refuse("recipe.recompute", "attention-only".into());
        }
        Ok("peer.py")
    }
}

/// `compare --runtime pytorch`: the budget's peak and parameter counts beside those the PyTorch
/// peer measures on the same spec.
pub(super) fn compare_pytorch(
    spec: &ditmem_budget::Spec,
    python: Option<&Path>,
    steps: u32,
    force: bool,
    json: bool,
) -> Result<(), CliError> {
    let script = peer_for(spec)?;
    let (dir, python) = check_python(python)?;
    let budget = ditmem_budget::estimate(spec)?;
    crate::guard::check("the PyTorch step", budget.peak_bytes, force)?;
    let v = run_peer(&python, &dir.join(script), spec, steps)?;
    let measured = v["peak_bytes"]
        .as_u64()
        .context("peer JSON has no peak_bytes")?;
    let rel = budget.peak_bytes as f64 / measured.max(1) as f64 - 1.0;
    if json {
        let params = serde_json::json!({
            "predicted": {"total": budget.params.total, "trained": budget.params.trained},
            "measured": {
                "total": v["params"]["reported"],
                "trained": v["params"]["trainable"],
            },
        });
        crate::output::print_json(&serde_json::json!({
            "runtime": "pytorch",
            "peer": script,
            "predicted_peak_bytes": budget.peak_bytes,
            "measured_peak_bytes": measured,
            "rel_error": rel,
            "params": params,
            "measurement": v,
        }))?;
    } else {
        let class = v["conditions"]["class"]
            .as_str()
            .unwrap_or("the original DiT");
        let mut o = format!("ditmem compare --runtime pytorch — {}\n", spec_line(spec));
        o.push_str(&format!("recipe: {}\n", recipe_line(spec)));
        o.push_str(&format!("peer: {script} ({class})\n"));
        let mut t = Table::new(&["", "predicted", "measured (PyTorch)", "error"]);
        t.row(vec![
            "peak".into(),
            fmt_bytes(budget.peak_bytes),
            fmt_bytes(measured),
            format!("{:+.3} %", 100.0 * rel),
        ]);
        let count = |x: &serde_json::Value| x.as_u64().map_or("-".to_string(), fmt_count);
        t.row(vec![
            "parameters".into(),
            fmt_count(budget.params.total),
            count(&v["params"]["reported"]),
            String::new(),
        ]);
        t.row(vec![
            "  trained".into(),
            fmt_count(budget.params.trained),
            count(&v["params"]["trainable"]),
            String::new(),
        ]);
        o.push_str(&t.render());
        o.push_str(&format!("peer conditions: {}\n", v["conditions"]));
        crate::output::say(&o)?;
    }
    Ok(())
}

/// Run the peer's `script` on the spec (one warm-up step, then `steps`) and read the JSON it
/// prints. A peer that says nothing or prints no JSON is not the peer (exit 5), a missing module
/// is a missing tool (exit 5), the peer's own refusal (its exit 2) is bad input (exit 2).
fn run_peer(
    python: &Path,
    script: &Path,
    spec: &ditmem_budget::Spec,
    steps: u32,
) -> Result<serde_json::Value, CliError> {
    let tmp = std::env::temp_dir().join(format!("ditmem-compare-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).context("creating a temporary folder")?;
    let spec_path = tmp.join("spec.json");
    crate::output::write_atomic(
        &spec_path,
        serde_json::to_string(spec)
            .context("spec to JSON")?
            .as_bytes(),
    )?;
    let out = std::process::Command::new(python)
        .arg(script)
        .arg("--spec")
        .arg(&spec_path)
        .args(["--warmup", "1", "--steps", &steps.max(1).to_string()])
        .env("OMP_WAIT_POLICY", "PASSIVE")
        .output();
    // The spec file's folder goes whatever the peer did.
    let _ = std::fs::remove_dir_all(&tmp);
    let out = out.context("running the PyTorch peer")?;
    let not_the_peer = |what: String| {
        CliError::Missing(format!(
            "{} {what}, so it is not the PyTorch peer's Python; allowed: the interpreter \
             bench/torch_peer/setup_diffusers.sh installs (bench/torch_peer/.venv/bin/python)",
            crate::flags::show(&python.display().to_string())
        ))
    };
    if !out.status.success() {
        let msg = String::from_utf8_lossy(&out.stderr)
            .trim()
            .lines()
            .last()
            .unwrap_or("")
            .to_string();
        if msg.is_empty() {
            return Err(not_the_peer(format!(
                "exited with {} and said nothing",
                out.status
            )));
        }
        if msg.contains("ModuleNotFoundError") {
            return Err(CliError::Missing(format!(
                "the PyTorch peer's Python lacks a module ({msg}): run \
                 bench/torch_peer/setup_diffusers.sh"
            )));
        }
        if out.status.code() == Some(2) {
            // The peer's own refusal: one line naming what it does not run.
            return Err(CliError::Spec(ditmem_budget::SpecError::invalid(
                "spec",
                format!("the PyTorch peer does not run it: {msg}"),
            )));
        }
        return Err(CliError::Other(anyhow::anyhow!(
            "the PyTorch peer failed: {msg}"
        )));
    }
    serde_json::from_slice(&out.stdout)
        .map_err(|e| not_the_peer(format!("printed no peer JSON ({e})")))
}
