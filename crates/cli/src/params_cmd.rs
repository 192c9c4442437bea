//! `ditmem params`: the parameter table of a model family, from a diffusers `config.json`
//! (`--model`) or a preset: the family, the dimensions, parameters and buffers per module group,
//! the totals, and the model state in bytes under the common recipes. `--weights` holds a
//! checkpoint's safetensors headers (a file, or a sharded `*.index.json`) against the table
//! without reading a tensor.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use clap::Args;
use ditmem_budget::{
    family_preset, fmt_bytes, preset_source, state_bytes, FamilyCounts, FamilyModel, FamilyTensor,
    SpecError,
};
use serde::Serialize;

use crate::flags::show;
use crate::input::read_capped;

use crate::render::{fmt_count, Table};
use crate::CliError;

/// What the output says about the rest of a step: the table counts model state only.
pub(crate) const ACTIVATIONS_NOTE: &str =
    "model state only; a whole step (activations, text encoders and VAE, the allocator) is \
`ditmem estimate` with the same --preset or --model";

#[derive(Debug, Clone, Args)]
pub(crate) struct ParamsArgs {
    /// A diffusers transformer config.json, or a folder holding one (a checkpoint's transformer/).
    #[arg(long, value_name = "PATH", conflicts_with = "preset")]
    pub model: Option<PathBuf>,
    /// A diffusers `config.json` as a value (the API's `model` dict).
    #[arg(skip)]
    pub model_json: Option<serde_json::Map<String, serde_json::Value>>,
    /// A published checkpoint: flux.1-dev, flux.1-schnell, sd3-medium, sd3.5-medium, sd3.5-large,
    /// pixart-alpha-1024, pixart-sigma-1024, sana-600m, sana-1600m, wan2.1-1.3b, wan2.1-14b,
    /// dit-xl-2-256, dit-xl-2-512 (diffusers), or an original DiT dit-{s,b,l,xl}-{2,4,8} (at 256²).
    #[arg(long)]
    pub preset: Option<String>,
    /// Hold a checkpoint's safetensors headers against the table: a .safetensors file or a
    /// sharded *.index.json (headers only; no tensor is read).
    #[arg(long, value_name = "FILE")]
    pub weights: Option<PathBuf>,
    /// Also list every tensor (name, shape, kind, group).
    #[arg(long)]
    pub tensors: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Report<'a> {
    model: &'a FamilyModel,
    source: Option<&'static str>,
    params: Params<'a>,
    state: Vec<ditmem_budget::StateBytes>,
    #[serde(skip_serializing_if = "Option::is_none")]
    weights: Option<WeightsCheck>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tensors: Option<&'a [FamilyTensor]>,
    note: &'static str,
}

/// `params.total` is what the diffusers class counts (`model.parameters()`); buffers apart.
#[derive(Serialize)]
struct Params<'a> {
    total: u64,
    trainable: u64,
    buffers: u64,
    persistent_buffers: u64,
    tensors: usize,
    per_group: &'a [ditmem_budget::GroupCount],
}

pub(crate) fn run(args: ParamsArgs) -> Result<(), CliError> {
    let model = match (&args.model, &args.preset, &args.model_json) {
        (Some(path), _, _) => crate::input::load_model(path)?.0,
        (None, Some(name), _) => family_preset(name)?,
        (None, None, Some(value)) => crate::input::model_from_value("model", value)?.0,
        (None, None, None) => {
            return Err(SpecError::invalid(
                "--model",
                "missing; allowed: --model PATH (a config.json or its folder) or --preset NAME",
            )
            .into())
        }
    };
    let table = model.dims.table();
    let counts = ditmem_budget::count_family(&table);
    let weights = match &args.weights {
        Some(path) => Some(check_weights(path, &table)?),
        None => None,
    };
    let report = Report {
        model: &model,
        source: args.preset.as_deref().and_then(preset_source),
        params: Params {
            total: counts.parameters,
            trainable: counts.trainable,
            buffers: counts.buffers,
            persistent_buffers: counts.persistent_buffers,
            tensors: counts.tensors,
            per_group: &counts.per_group,
        },
        state: state_bytes(&counts),
        weights,
        tensors: args.tensors.then_some(&table[..]),
        note: ACTIVATIONS_NOTE,
    };
    if args.json {
        crate::output::print_json(&report)?;
    } else {
        crate::output::say(&render(&report, &counts))?;
    }
    Ok(())
}

fn render(r: &Report, c: &FamilyCounts) -> String {
    let m = r.model;
    let mut out = format!(
        "{}: {} (family {})\n",
        m.name,
        m.class_name,
        m.family.name()
    );
    if let Some(src) = r.source {
        out.push_str(&format!("  from {src}\n"));
    }
    out.push_str(&format!("  {}\n\n", dims_line(m)));
    let mut t = Table::new(&["module group", "parameters", "buffers"]);
    for g in &c.per_group {
        t.row(vec![
            g.name.to_string(),
            fmt_count(g.parameters),
            fmt_count(g.buffers),
        ]);
    }
    t.row(vec![
        "total".into(),
        fmt_count(c.parameters),
        fmt_count(c.buffers),
    ]);
    out.push_str(&t.render());
    if c.trainable != c.parameters {
        out.push_str(&format!(
            "  of which fixed (requires_grad=False): {}\n",
            fmt_count(c.parameters - c.trainable)
        ));
    }
    out.push_str(&format!(
        "  {} tensors; buffers are fixed tables ({} in the checkpoint)\n\nmodel state\n",
        fmt_count(c.tensors as u64),
        fmt_count(c.persistent_buffers)
    ));
    let mut s = Table::new(&["recipe", "bytes", "exact"]);
    for st in &r.state {
        s.row(vec![
            format!("{}: {}", st.recipe, st.what),
            fmt_bytes(st.bytes),
            fmt_count(st.bytes),
        ]);
    }
    out.push_str(&s.render());
    if let Some(w) = &r.weights {
        out.push_str(&format!(
            "\nweights: {} tensors in {} file(s) match the table ({}; {} of tensor data)\n",
            fmt_count(w.tensors),
            w.files,
            w.dtypes
                .iter()
                .map(|(d, n)| format!("{d} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
            fmt_bytes(w.bytes)
        ));
    }
    if let Some(tensors) = r.tensors {
        let mut t = Table::new(&["tensor", "shape", "kind", "group"]);
        for x in tensors {
            t.row(vec![
                x.name.clone(),
                format!("{:?}", x.shape),
                x.kind.peer_name().to_string(),
                x.group.name().to_string(),
            ]);
        }
        out.push('\n');
        out.push_str(&t.render());
    }
    out.push_str(&format!("\nnote: {ACTIVATIONS_NOTE}\n"));
    out
}

/// The dimensions as `key value` pairs, in the struct's order.
fn dims_line(m: &FamilyModel) -> String {
    let v = serde_json::to_value(&m.dims).unwrap_or_default();
    let mut parts = Vec::new();
    if let Some(obj) = v.as_object() {
        for (k, v) in obj {
            if k == "family" {
                continue;
            }
            let s = match v {
                serde_json::Value::Object(o) => o
                    .iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                v => format!("{k} {v}"),
            };
            parts.push(s);
        }
    }
    parts.join(", ")
}

/// What `--weights` found.
#[derive(Debug, Serialize)]
pub(crate) struct WeightsCheck {
    pub files: usize,
    pub tensors: u64,
    /// Tensors per safetensors dtype.
    pub dtypes: BTreeMap<String, u64>,
    /// Bytes of tensor data the headers describe.
    pub bytes: u64,
}

/// Largest safetensors header read: 100 MB, the `safetensors` crate's own limit.
pub(crate) const MAX_HEADER_BYTES: u64 = 100_000_000;
/// Largest sharded index read (the published ones are under 200 KB).
pub(crate) const MAX_INDEX_BYTES: u64 = 16 << 20;
/// Most shards an index may name.
pub(crate) const MAX_SHARDS: usize = 1024;

fn werr(why: String) -> SpecError {
    SpecError::invalid("--weights", why)
}

/// Bytes per element of a safetensors dtype.
fn dtype_size(d: &str) -> Option<u64> {
    Some(match d {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "F8_E4M3" | "F8_E5M2" | "I8" | "U8" | "BOOL" => 1,
        _ => return None,
    })
}

/// One tensor of a safetensors header: name, dtype, shape, data bytes.
type HeaderEntry = (String, String, Vec<u64>, u64);

/// One file's header, every tensor checked to lie within the file.
fn read_header(path: &Path) -> Result<Vec<HeaderEntry>, SpecError> {
    let shown = show(&path.display().to_string());
    let meta = std::fs::metadata(path).map_err(|e| {
        werr(format!(
            "{shown} cannot be read ({e}); allowed: a .safetensors file"
        ))
    })?;
    if !meta.is_file() {
        return Err(werr(format!(
            "{shown} is not a regular file; allowed: a .safetensors file"
        )));
    }
    let mut f = std::fs::File::open(path).map_err(|e| {
        werr(format!(
            "{shown} cannot be read ({e}); allowed: a readable file"
        ))
    })?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| werr(format!("{shown} is shorter than a safetensors header")))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER_BYTES || n + 8 > meta.len() {
        return Err(werr(format!(
            "{shown} declares a header of {n} bytes; allowed: at most {MAX_HEADER_BYTES} and within the file"
        )));
    }
    let mut header = Vec::new();
    f.take(n)
        .read_to_end(&mut header)
        .map_err(|e| werr(format!("{shown} cannot be read ({e})")))?;
    let value: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|e| werr(format!("{shown} has a header that is not JSON ({e})")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| werr(format!("{shown} has a header that is not a JSON object")))?;
    let data_len = meta.len() - 8 - n;
    let mut out = Vec::new();
    for (name, info) in obj {
        if name == "__metadata__" {
            continue;
        }
        let bad = || {
            werr(format!(
                "{shown}: tensor {} has a malformed entry",
                show(name)
            ))
        };
        let dtype = info["dtype"].as_str().ok_or_else(bad)?.to_string();
        let shape: Vec<u64> = info["shape"]
            .as_array()
            .ok_or_else(bad)?
            .iter()
            .map(|x| x.as_u64().ok_or_else(bad))
            .collect::<Result<_, _>>()?;
        let offsets = info["data_offsets"].as_array().ok_or_else(bad)?;
        let (Some(a), Some(b)) = (
            offsets.first().and_then(|x| x.as_u64()),
            offsets.get(1).and_then(|x| x.as_u64()),
        ) else {
            return Err(bad());
        };
        let size = dtype_size(&dtype).ok_or_else(|| {
            werr(format!(
                "{shown}: tensor {} has unknown dtype {}",
                show(name),
                show(&dtype)
            ))
        })?;
        let numel = shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        let expect = numel.and_then(|n| n.checked_mul(size));
        if b < a || b > data_len || Some(b - a) != expect {
            return Err(werr(format!(
                "{shown}: tensor {} has data_offsets [{a}, {b}] that do not hold {dtype} {shape:?} within the file",
                show(name)
            )));
        }
        out.push((name.clone(), dtype, shape, b - a));
    }
    Ok(out)
}

/// The shard files of a `*.index.json` (`weight_map`: tensor → file in the same folder).
fn shards(index: &Path) -> Result<Vec<PathBuf>, SpecError> {
    let shown = show(&index.display().to_string());
    let bytes = read_capped("--weights", index, MAX_INDEX_BYTES)?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
        werr(format!(
            "{shown} is not JSON ({e}); allowed: a safetensors index"
        ))
    })?;
    let map = v["weight_map"].as_object().ok_or_else(|| {
        werr(format!(
            "{shown} has no weight_map; allowed: a safetensors index"
        ))
    })?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
    if files.len() != map.len() {
        return Err(werr(format!(
            "{shown}: weight_map values must be file names"
        )));
    }
    files.sort_unstable();
    files.dedup();
    if files.len() > MAX_SHARDS {
        return Err(werr(format!(
            "{shown} names {} files; allowed: at most {MAX_SHARDS}",
            files.len()
        )));
    }
    files
        .into_iter()
        .map(|f| {
            if f.is_empty() || f.contains('/') || f.contains('\\') || f == ".." || f == "." {
                Err(werr(format!(
                    "{shown} names shard {}; allowed: a file name in the index's folder",
                    show(f)
                )))
            } else {
                Ok(dir.join(f))
            }
        })
        .collect()
}

/// Hold every tensor of the checkpoint against the table's state dict (parameters and persistent
/// buffers): same names, same shapes; report the dtypes.
fn check_weights(path: &Path, table: &[FamilyTensor]) -> Result<WeightsCheck, SpecError> {
    let name = path.to_string_lossy();
    let files = if name.ends_with(".index.json") {
        shards(path)?
    } else {
        vec![path.to_path_buf()]
    };
    let expected: BTreeMap<&str, &FamilyTensor> = table
        .iter()
        .filter(|t| t.kind.in_state_dict())
        .map(|t| (t.name.as_str(), t))
        .collect();
    let mut seen: BTreeMap<String, ()> = BTreeMap::new();
    let mut check = WeightsCheck {
        files: files.len(),
        tensors: 0,
        dtypes: BTreeMap::new(),
        bytes: 0,
    };
    for f in &files {
        for (tname, dtype, shape, bytes) in read_header(f)? {
            let Some(t) = expected.get(tname.as_str()) else {
                return Err(werr(format!(
                    "tensor {} is not in the model's table (the config and the weights disagree)",
                    show(&tname)
                )));
            };
            if t.shape != shape {
                return Err(werr(format!(
                    "tensor {} has shape {shape:?}; the model's table has {:?}",
                    show(&tname),
                    t.shape
                )));
            }
            if seen.insert(tname.clone(), ()).is_some() {
                return Err(werr(format!(
                    "tensor {} appears in two shards",
                    show(&tname)
                )));
            }
            *check.dtypes.entry(dtype).or_default() += 1;
            check.tensors += 1;
            check.bytes += bytes;
        }
    }
    let missing: Vec<&str> = expected
        .keys()
        .filter(|k| !seen.contains_key(**k))
        .copied()
        .collect();
    if let Some(first) = missing.first() {
        return Err(werr(format!(
            "{} tensor(s) of the model are missing from the weights, e.g. {}",
            missing.len(),
            show(first)
        )));
    }
    Ok(check)
}
