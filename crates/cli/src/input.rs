//! Reading input files: only regular files, never more than a cap, and a FIFO or device refused
//! before it is opened (opening a FIFO for reading would block until a writer comes).

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use ditmem_budget::DeviceProfile;
use ditmem_budget::{from_config_json, FamilyModel, Spec, SpecError, MAX_CONFIG_JSON_BYTES};

use crate::flags::{fmt_float, show};
use crate::output::file_kind;

/// Largest spec (`--config`) or device profile (`--profile`) file read: 1 MiB. A spec is a few
/// hundred bytes; the cap keeps `/dev/zero`, a huge file or a runaway generator from filling memory.
pub(crate) const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The bytes of `flag`'s file `path`: a regular file (a link to one is fine: reading through it
/// changes nothing) of at most `cap` bytes, read without ever holding more than `cap + 1`.
pub(crate) fn read_capped(flag: &str, path: &Path, cap: u64) -> Result<Vec<u8>, SpecError> {
    let shown = show(&path.display().to_string());
    let bad = |why: String| SpecError::invalid(flag, format!("{shown} {why}"));
    let meta = std::fs::metadata(path).map_err(|e| {
        bad(format!(
            "cannot be read ({e}); allowed: an existing regular file"
        ))
    })?;
    // Checked on the path, and again on the opened file (the path may have changed between).
    let regular = |meta: &std::fs::Metadata| {
        if meta.file_type().is_file() {
            Ok(())
        } else {
            let kind = file_kind(meta.file_type());
            Err(bad(format!("is {kind}; allowed: a regular file")))
        }
    };
    regular(&meta)?;
    let too_big = |len: u64| {
        bad(format!(
            "is larger than {cap} bytes ({len}{} bytes); allowed: a file of at most {cap} bytes",
            if len > cap { "" } else { "+" }
        ))
    };
    if meta.len() > cap {
        return Err(too_big(meta.len()));
    }
    let unreadable = |e: std::io::Error| {
        bad(format!(
            "cannot be read ({e}); allowed: a readable regular file"
        ))
    };
    // O_NONBLOCK: should the path have become a FIFO since the check, opening it does not block.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(unreadable)?;
    let meta = file.metadata().map_err(unreadable)?;
    regular(&meta)?;
    let mut bytes = Vec::new();
    file.take(cap.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(unreadable)?;
    if bytes.len() as u64 > cap {
        return Err(too_big(cap));
    }
    Ok(bytes)
}

fn text_of(flag: &str, path: &Path) -> Result<String, SpecError> {
    let bytes = read_capped(flag, path, MAX_CONFIG_BYTES)?;
    String::from_utf8(bytes).map_err(|e| {
        SpecError::invalid(
            flag,
            format!(
                "{} is not UTF-8 text (byte {}); allowed: a TOML or JSON file",
                show(&path.display().to_string()),
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

fn is_json(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"))
}

/// `--config`: JSON when the file is named `.json`, TOML otherwise; TOML that fails to parse but
/// looks like JSON says so.
pub(crate) fn load_spec(path: &Path) -> Result<Spec, SpecError> {
    let text = text_of("--config", path)?;
    if is_json(path) {
        return Spec::from_json(&text);
    }
    Spec::from_toml(&text).map_err(|e| match e {
        SpecError::Parse {
            format,
            message,
            location,
        } if text.trim_start().starts_with('{') => SpecError::Parse {
            format,
            message: format!("{message}; the file looks like JSON; name the file .json"),
            location,
        },
        e => e,
    })
}

/// Whether a spec file sets `runtime` at its top level (read again after [`load_spec`] accepted
/// it; a file without one takes the command's default runtime).
pub(crate) fn config_names_runtime(path: &Path) -> Result<bool, SpecError> {
    let text = text_of("--config", path)?;
    Ok(if is_json(path) {
        serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&text)
            .map(|m| m.contains_key("runtime"))
            .unwrap_or(true)
    } else {
        text.parse::<toml::Table>()
            .map(|t| t.contains_key("runtime"))
            .unwrap_or(true)
    })
}

/// `--model`: a diffusers `config.json`, or a folder holding one (a checkpoint's `transformer/`):
/// the model read from it and the config object itself (what a spec's `model.diffusers` holds).
pub(crate) fn load_model(
    path: &Path,
) -> Result<(FamilyModel, serde_json::Map<String, serde_json::Value>), SpecError> {
    let file = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    let bytes = read_capped("--model", &file, MAX_CONFIG_JSON_BYTES as u64)?;
    let shown = show(&file.display().to_string());
    let text = String::from_utf8(bytes).map_err(|e| {
        SpecError::invalid(
            "--model",
            format!(
                "{shown} is not UTF-8 text (byte {}); allowed: a diffusers config.json",
                e.utf8_error().valid_up_to()
            ),
        )
    })?;
    let (mut model, map) = model_from_text("--model", &shown, &text)?;
    model.name = file.display().to_string();
    Ok((model, map))
}

/// A diffusers `config.json` given as a value (the API's `model` dict, a live model's
/// `config`): read as [`load_model`] reads the file, errors naming `field`.
pub(crate) fn model_from_value(
    field: &str,
    value: &serde_json::Map<String, serde_json::Value>,
) -> Result<(FamilyModel, serde_json::Map<String, serde_json::Value>), SpecError> {
    let text = serde_json::to_string(value)
        .map_err(|e| SpecError::invalid(field, format!("not serialisable as JSON: {e}")))?;
    if text.len() as u64 > MAX_CONFIG_JSON_BYTES as u64 {
        return Err(SpecError::invalid(
            field,
            format!(
                "{} bytes; allowed: a diffusers config.json of at most {MAX_CONFIG_JSON_BYTES} bytes",
                text.len()
            ),
        ));
    }
    let (mut model, map) = model_from_text(field, "the given config", &text)?;
    // A live diffusers model's config names its checkpoint (`from_pretrained` sets
    // `_name_or_path`, diffusers configuration_utils.py): the name the family reads as
    // `--model PATH`'s path (PixArt-Σ's 300 text tokens by "sigma", families/model.rs).
    match map.get("_name_or_path").and_then(serde_json::Value::as_str) {
        Some(name) if !name.trim().is_empty() => model.name = name.to_string(),
        _ if model.name.is_empty() => model.name = "config".into(),
        _ => {}
    }
    Ok((model, map))
}

/// A diffusers `config.json`'s text: the family model and the raw map (for the family's
/// defaults). `shown` names the source in messages.
fn model_from_text(
    field: &str,
    shown: &str,
    text: &str,
) -> Result<(FamilyModel, serde_json::Map<String, serde_json::Value>), SpecError> {
    let keyed = |e: SpecError| match e {
        SpecError::Invalid {
            field: key,
            message,
        } => SpecError::invalid(format!("{field} {shown} key '{key}'"), message),
        SpecError::Parse { message, .. } => SpecError::invalid(
            field,
            format!("{shown} is not valid JSON ({message}); allowed: a diffusers config.json"),
        ),
        e => e,
    };
    let model = from_config_json(text).map_err(keyed)?;
    let serde_json::Value::Object(map) = serde_json::from_str(text).map_err(|e| {
        keyed(SpecError::Parse {
            format: "JSON",
            message: e.to_string(),
            location: String::new(),
        })
    })?
    else {
        return Err(SpecError::invalid(
            field,
            format!("{shown} is not a JSON object"),
        ));
    };
    Ok((model, map))
}

/// The `--config` file as a tree of values (to see which fields it gives, e.g.
/// `recipe.precision`); the same reading rules as [`load_spec`].
pub(crate) fn spec_value(path: &Path) -> Result<serde_json::Value, SpecError> {
    let text = text_of("--config", path)?;
    let parsed: Result<serde_json::Value, String> = if is_json(path) {
        serde_json::from_str(&text).map_err(|e| e.to_string())
    } else {
        toml::from_str::<toml::Value>(&text)
            .map_err(|e| e.message().to_string())
            .and_then(|v| serde_json::to_value(v).map_err(|e| e.to_string()))
    };
    parsed.map_err(|message| SpecError::Parse {
        format: if is_json(path) { "JSON" } else { "TOML" },
        message,
        location: String::new(),
    })
}

/// Slowest and fastest rates a device profile may give (per second): below 1e3 a DiT step takes
/// longer than the age of the universe and its figures stop being numbers ("inf s", "NaN %").
pub(crate) const PROFILE_RATES: (f64, f64) = (1e3, 1e18);
/// Largest fixed cost of a forward+backward pass in a profile, in seconds.
pub(crate) const MAX_OVERHEAD_S: f64 = 3600.0;

/// `--profile`: a device profile (TOML, or JSON by extension) with sane rates.
pub(crate) fn load_profile(path: &Path) -> Result<DeviceProfile, SpecError> {
    let text = text_of("--profile", path)?;
    let parsed: Result<DeviceProfile, String> = if is_json(path) {
        serde_json::from_str(&text).map_err(|e| e.to_string())
    } else {
        toml::from_str(&text).map_err(|e| e.message().replace('\n', " "))
    };
    let p = parsed.map_err(|e| {
        SpecError::invalid(
            "--profile",
            format!(
                "{} is not a device profile: {e}; allowed: TOML or JSON with every DeviceProfile field",
                show(&path.display().to_string())
            ),
        )
    })?;
    let (lo, hi) = PROFILE_RATES;
    for (name, v) in [
        ("matmul_f64", p.matmul_f64),
        ("matmul_f32", p.matmul_f32),
        ("matmul_bf16", p.matmul_bf16),
        ("matmul_f16", p.matmul_f16),
        ("elementwise_f64", p.elementwise_f64),
        ("elementwise_f32", p.elementwise_f32),
        ("elementwise_half", p.elementwise_half),
        ("link_bytes_per_s", p.link_bytes_per_s),
        ("inter_node_bytes_per_s", p.inter_node_bytes_per_s),
        ("host_link_bytes_per_s", p.host_link_bytes_per_s),
    ]
    .into_iter()
    .chain(p.matmul_tf32.map(|v| ("matmul_tf32", v)))
    {
        if !(v.is_finite() && (lo..=hi).contains(&v)) {
            return Err(SpecError::invalid(
                format!("--profile {name}"),
                format!(
                    "{} is not a usable rate; allowed: {} to {} per second",
                    fmt_float(v),
                    fmt_float(lo),
                    fmt_float(hi)
                ),
            ));
        }
    }
    let o = p.microbatch_overhead_s;
    if !(o.is_finite() && (0.0..=MAX_OVERHEAD_S).contains(&o)) {
        return Err(SpecError::invalid(
            "--profile microbatch_overhead_s",
            format!(
                "{} is out of range; allowed: 0 to {MAX_OVERHEAD_S} seconds",
                fmt_float(o)
            ),
        ));
    }
    p.validate()?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_and_file_types() {
        let dir = std::env::temp_dir().join(format!("ditmem-input-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("a.toml");
        std::fs::write(&f, vec![b'#'; 100]).unwrap();
        assert_eq!(read_capped("--config", &f, 100).unwrap().len(), 100);
        let e = read_capped("--config", &f, 99).unwrap_err();
        assert_eq!(e.field(), Some("--config"));
        let e = read_capped("--config", &dir, 99).unwrap_err();
        assert!(e.to_string().contains("directory"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
