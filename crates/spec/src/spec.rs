//! The spec: one description of a training step (model + workload + recipe + runtime) that the
//! budget estimates, the planner rewrites and the engine executes.
//!
//! Specs are read from TOML or JSON; unknown fields are errors, and every invalid value is reported
//! by [`Spec::validate`] with the field's dotted path and what is allowed.
//!
//! The spec's parts are in their own modules (`model.rs`, `workload.rs`,
//! `precision.rs`, `recipe.rs`, `lora.rs`, `runtime.rs`, `cpu.rs`,
//! `limits.rs`, `validation.rs`); this module holds the whole and reads and writes it,
//! and re-exports every part, so `ditmem_spec::spec::X` names the same item as `ditmem_spec::X`.

use serde::{Deserialize, Serialize};

use crate::error::SpecError;

pub use crate::cpu::*;
pub use crate::limits::*;
pub use crate::lora::*;
pub use crate::model::*;
pub use crate::precision::*;
pub use crate::recipe::*;
pub use crate::runtime::*;
pub use crate::workload::*;

/// Model + workload + recipe + runtime: everything that decides the memory of a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    pub model: ModelSpec,
    pub workload: Workload,
    #[serde(default)]
    pub recipe: Recipe,
    #[serde(default)]
    pub runtime: Runtime,
    /// The CPU of the `ditmem-cpu` runtime ([`CpuSpec`]); absent: [`CpuSpec::REFERENCE`] in the
    /// library, this machine's values in the CLI. Only with the `ditmem-cpu` runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuSpec>,
    /// The CUDA device of a `pytorch:cuda` spec ([`CudaSpec`]): the catalog GPU it runs on and
    /// the caching allocator's settings. Only with a `pytorch:cuda` runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda: Option<CudaSpec>,
}

impl Spec {
    /// The embedded default: DiT-XL/2 at 256×256, batch 32, bf16-mixed, AdamW.
    pub fn default_xl() -> Spec {
        Spec {
            model: ModelSpec::preset("dit-xl-2").expect("built-in preset"),
            workload: Workload {
                height: 256,
                width: 256,
                vae_factor: 8,
                latent_channels: 4,
                batch: 32,
                microbatch: 32,
                accumulation: 1,
                ranks: 1,
                frames: 1,
                vae_temporal_factor: 1,
                text_tokens: None,
            },
            recipe: Recipe::default(),
            runtime: Runtime::DitmemCpu,
            cpu: None,
            cuda: None,
        }
    }

    /// The CPU the `ditmem-cpu` runtime is budgeted for: the spec's `cpu` section, else
    /// [`CpuSpec::REFERENCE`].
    pub fn cpu(&self) -> CpuSpec {
        self.cpu.unwrap_or(CpuSpec::REFERENCE)
    }

    /// The caching allocator's settings (`PYTORCH_CUDA_ALLOC_CONF`) of the `cuda` section; empty
    /// without one (PyTorch's defaults).
    pub fn alloc_conf(&self) -> &str {
        self.cuda.as_ref().map_or("", |c| c.alloc_conf.as_str())
    }

    /// A small DiT that runs a training step in about a second on two cores: depth 2, hidden 64,
    /// 4 heads, patch 2, 10 classes, 128×128 images (16×16 latents, 64 tokens), batch 4, fp32,
    /// AdamW, no EMA. The default of `verify`, the base of the agreement grid and of the tests.
    pub fn small() -> Spec {
        let mut s = Spec::default_xl();
        s.model.name = "DiT-small (2×64)".into();
        s.model.depth = 2;
        s.model.hidden = 64;
        s.model.heads = 4;
        s.model.patch = 2;
        s.model.num_classes = 10;
        s.workload.height = 128;
        s.workload.width = 128;
        s.workload.batch = 4;
        s.workload.microbatch = 4;
        s.recipe.precision = Precision::Fp32;
        s.recipe.ema.enabled = false;
        s
    }

    /// Parse a spec from TOML text.
    pub fn from_toml(text: &str) -> Result<Spec, SpecError> {
        let de =
            toml::Deserializer::parse(text).map_err(|e| toml_error(text, &e, String::new()))?;
        let mut spec: Spec = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            toml_error(text, e.inner(), path)
        })?;
        spec.model.restore_nulls()?;
        spec.validate()?;
        Ok(spec)
    }

    /// Parse a spec from JSON text.
    pub fn from_json(text: &str) -> Result<Spec, SpecError> {
        let mut de = serde_json::Deserializer::from_str(text);
        let mut spec: Spec = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            SpecError::Parse {
                format: "JSON",
                message: field_prefix(&path) + &e.inner().to_string(),
                location: String::new(),
            }
        })?;
        spec.model.restore_nulls()?;
        spec.validate()?;
        Ok(spec)
    }

    /// Parse by file extension (`.json` is JSON, anything else TOML).
    pub fn from_file(path: &std::path::Path) -> Result<Spec, SpecError> {
        let text = std::fs::read_to_string(path).map_err(|e| SpecError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"))
        {
            Spec::from_json(&text)
        } else {
            Spec::from_toml(&text)
        }
    }

    /// The spec as TOML, which [`Spec::from_toml`] reads back to the same spec. TOML has no
    /// null: a top-level `null` of `model.diffusers` is left out of its table and listed in
    /// `model.diffusers_null`; a `null` nested deeper (inside a list or a table of a config key:
    /// only diffusers' `_`-prefixed bookkeeping can hold one, every key ditmem reads refuses it)
    /// is left out. Anything TOML still cannot hold (an integer above 2⁶³ − 1 in the config) is
    /// an error naming `model.diffusers`, never a panic.
    pub fn to_toml(&self) -> Result<String, SpecError> {
        let mut s = self.clone();
        if let Some(map) = s.model.diffusers.as_mut() {
            let nulls: Vec<String> = map
                .iter()
                .filter(|(_, v)| v.is_null())
                .map(|(k, _)| k.clone())
                .collect();
            map.retain(|_, v| !v.is_null());
            map.values_mut().for_each(strip_nulls);
            for k in nulls {
                if !s.model.diffusers_null.contains(&k) {
                    s.model.diffusers_null.push(k);
                }
            }
        }
        let unwritable = |why: String| {
            SpecError::invalid(
                "model.diffusers",
                format!(
                    "cannot be written as TOML ({why}); allowed: values TOML holds (integers up to \
                     2^63 − 1); write the spec as JSON (--json) instead"
                ),
            )
        };
        let text = toml::to_string_pretty(&s).map_err(|e| unwritable(e.to_string()))?;
        // The writer puts out integers TOML cannot read back (above 2⁶³ − 1): read it again.
        text.parse::<toml::Table>()
            .map_err(|e| unwritable(e.message().replace('\n', " ")))?;
        Ok(text)
    }

    /// The token grid of one image; errors when the resolution does not divide.
    pub fn token_grid(&self) -> Result<TokenGrid, SpecError> {
        let w = &self.workload;
        let step = w.vae_factor * self.model.patch;
        for (field, v) in [("workload.height", w.height), ("workload.width", w.width)] {
            if step == 0 || v % step != 0 {
                return Err(SpecError::invalid(
                    field,
                    format!(
                        "{v} is not divisible by vae_factor × patch = {} × {} = {step}; allowed: multiples of {step}",
                        w.vae_factor, self.model.patch
                    ),
                ));
            }
        }
        Ok(TokenGrid {
            latent_h: w.height / w.vae_factor,
            latent_w: w.width / w.vae_factor,
            rows: w.height / step,
            cols: w.width / step,
        })
    }

    /// Latent frames per sample: (frames − 1) / vae_temporal_factor + 1 (a causal video VAE
    /// keeps the first frame and compresses the rest; 1 for images).
    pub fn latent_frames(&self) -> Result<u64, SpecError> {
        let w = &self.workload;
        let t = w.vae_temporal_factor.max(1);
        if w.frames == 0 || !(w.frames - 1).is_multiple_of(t) {
            return Err(SpecError::invalid(
                "workload.frames",
                format!(
                    "{} is not 1 + a multiple of the VAE's temporal factor {t}; allowed: 1, {}, {}, …",
                    w.frames,
                    1 + t,
                    1 + 2 * t
                ),
            ));
        }
        Ok(u64::from((w.frames - 1) / t + 1))
    }

    /// Image (or video) tokens per sample: the token grid of a frame × latent frames.
    pub fn tokens(&self) -> Result<u64, SpecError> {
        Ok(self.token_grid()?.tokens() * self.latent_frames()?)
    }
}

/// Drop every `null` inside a JSON value (TOML cannot hold one): a table's key goes, a list's
/// entry goes.
fn strip_nulls(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            m.retain(|_, x| !x.is_null());
            m.values_mut().for_each(strip_nulls);
        }
        serde_json::Value::Array(a) => {
            a.retain(|x| !x.is_null());
            a.iter_mut().for_each(strip_nulls);
        }
        _ => {}
    }
}

fn field_prefix(path: &str) -> String {
    if path.is_empty() || path == "." {
        String::new()
    } else {
        format!("field {path}: ")
    }
}

fn toml_error(text: &str, e: &toml::de::Error, path: String) -> SpecError {
    SpecError::Parse {
        format: "TOML",
        message: field_prefix(&path) + &e.message().replace('\n', " "),
        location: e
            .span()
            .map(|s| line_col(text, s.start))
            .unwrap_or_default(),
    }
}

fn line_col(text: &str, offset: usize) -> String {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    format!(" (line {line}, column {col})")
}
