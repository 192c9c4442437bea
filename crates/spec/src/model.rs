//! The model of a spec ([`ModelSpec`]): the original DiT's dimensions or a diffusers config, and
//! the presets by name.

use serde::{Deserialize, Serialize};

use crate::error::SpecError;

/// A DiT denoiser (facebookresearch/DiT `models.py`): adaLN-Zero blocks over patch tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Name shown in reports (a preset name, or free text).
    #[serde(default = "default_model_name")]
    pub name: String,
    /// A diffusers model instead of the original DiT: its transformer `config.json` object (with
    /// `_class_name`), read by `families` (PixArt, SD3, Flux, Sana, Wan, diffusers' DiT). The
    /// fields below are then derived from it (`denoiser::resolve`) and written for reading only:
    /// depth = every transformer block of every stack, hidden = heads × head size, patch = latent
    /// pixels per token side (2 for Flux's 2×2 packing), in_channels = the VAE's latent channels.
    ///
    /// A `null` value is kept as given: diffusers reads an explicit `null` differently from an
    /// absent key (`out_channels: null` is in_channels, an absent one the class default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diffusers: Option<serde_json::Map<String, serde_json::Value>>,
    /// The keys of `diffusers` whose value is `null`, as TOML writes them: TOML has no null, so
    /// [`Spec::to_toml`] leaves such a key out of the `[model.diffusers]` table and lists it here,
    /// and reading a spec puts each back as `null` (the list is then empty). Always empty in a
    /// spec read by [`Spec::from_toml`] or [`Spec::from_json`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub diffusers_null: Vec<String>,
    /// A diffusers model with fewer blocks than its config, every other dimension kept (`--depth`:
    /// a real-width model within a CPU's memory): one count for every kind of block, or one per
    /// kind (Flux: double-stream, single-stream; SD3.5: dual-attention, joint), each 1 ≤ N ≤ the
    /// config's blocks of that kind. Applied where the config is read (`denoiser::family`), so
    /// every command sees the same model. Empty: the config's blocks. The original DiT sets
    /// `depth` instead.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keep_blocks: Vec<u32>,
    /// Number of DiT blocks (L).
    #[serde(default)]
    pub depth: u32,
    /// Hidden size (D).
    #[serde(default)]
    pub hidden: u32,
    /// Attention heads; must divide `hidden`.
    #[serde(default)]
    pub heads: u32,
    /// Patch size p (tokens = (latent_h / p) · (latent_w / p)).
    #[serde(default)]
    pub patch: u32,
    /// Latent channels the denoiser reads (4 for the SD VAE).
    #[serde(default = "default_in_channels")]
    pub in_channels: u32,
    /// MLP hidden size = mlp_ratio · hidden.
    #[serde(default = "default_mlp_ratio")]
    pub mlp_ratio: u32,
    /// Class count K; a learned null class is added when `class_dropout_prob > 0`.
    #[serde(default = "default_num_classes")]
    pub num_classes: u32,
    /// Label dropout for classifier-free guidance (0.1 in DiT).
    #[serde(default = "default_class_dropout")]
    pub class_dropout_prob: f64,
    /// Predict the variance too: 2·C output channels instead of C.
    #[serde(default = "default_true")]
    pub learn_sigma: bool,
    /// Size of the sinusoidal timestep embedding fed to the timestep MLP.
    #[serde(default = "default_freq_embed")]
    pub freq_embed: u32,
    /// Dropout on the attention probabilities (0 in DiT).
    #[serde(default)]
    pub attn_dropout: f64,
    /// Dropout after the MLP activation (0 in DiT).
    #[serde(default)]
    pub mlp_dropout: f64,
}

fn default_model_name() -> String {
    "custom".into()
}
pub(crate) fn default_in_channels() -> u32 {
    4
}
fn default_mlp_ratio() -> u32 {
    4
}
fn default_num_classes() -> u32 {
    1000
}
fn default_class_dropout() -> f64 {
    0.1
}
pub(crate) fn default_true() -> bool {
    true
}
fn default_freq_embed() -> u32 {
    256
}

impl ModelSpec {
    /// A DiT preset by name: `dit-{s,b,l,xl}-{2,4,8}` (also accepts `DiT-XL/2`).
    pub fn preset(name: &str) -> Result<ModelSpec, SpecError> {
        let norm = name.to_ascii_lowercase().replace('/', "-");
        let (size, patch) = norm
            .strip_prefix("dit-")
            .and_then(|rest| rest.rsplit_once('-'))
            .ok_or_else(|| unknown_preset(name))?;
        let (depth, hidden, heads) = match size {
            "s" => (12, 384, 6),
            "b" => (12, 768, 12),
            "l" => (24, 1024, 16),
            "xl" => (28, 1152, 16),
            _ => return Err(unknown_preset(name)),
        };
        let patch: u32 = match patch {
            "2" => 2,
            "4" => 4,
            "8" => 8,
            _ => return Err(unknown_preset(name)),
        };
        Ok(ModelSpec {
            name: format!("DiT-{}/{}", size.to_ascii_uppercase(), patch),
            diffusers: None,
            diffusers_null: Vec::new(),
            keep_blocks: Vec::new(),
            depth,
            hidden,
            heads,
            patch,
            in_channels: 4,
            mlp_ratio: 4,
            num_classes: 1000,
            class_dropout_prob: 0.1,
            learn_sigma: true,
            freq_embed: 256,
            attn_dropout: 0.0,
            mlp_dropout: 0.0,
        })
    }

    /// Every preset name, in size order.
    pub fn preset_names() -> Vec<String> {
        let mut v = Vec::new();
        for s in ["s", "b", "l", "xl"] {
            for p in [2, 4, 8] {
                v.push(format!("dit-{s}-{p}"));
            }
        }
        v
    }

    /// `model.diffusers` with the keys of `diffusers_null` back as `null` (the config as given).
    pub fn diffusers_config(&self) -> Option<serde_json::Map<String, serde_json::Value>> {
        let mut map = self.diffusers.clone()?;
        for key in &self.diffusers_null {
            map.entry(key.clone()).or_insert(serde_json::Value::Null);
        }
        Some(map)
    }

    /// Put the keys of `diffusers_null` back into `diffusers` as `null` (reading a spec that
    /// [`Spec::to_toml`] wrote); a key that also has a value, or a list without a config, is an
    /// error naming `model.diffusers_null`.
    pub(crate) fn restore_nulls(&mut self) -> Result<(), SpecError> {
        if self.diffusers_null.is_empty() {
            return Ok(());
        }
        let Some(map) = self.diffusers.as_mut() else {
            return Err(SpecError::invalid(
                "model.diffusers_null",
                "lists keys, but there is no model.diffusers; allowed: an empty list, or keys of \
                 model.diffusers that are null",
            ));
        };
        for key in std::mem::take(&mut self.diffusers_null) {
            match map.get(&key) {
                None | Some(serde_json::Value::Null) => {
                    map.insert(key, serde_json::Value::Null);
                }
                Some(_) => {
                    return Err(SpecError::invalid(
                        "model.diffusers_null",
                        format!(
                            "lists '{}', which model.diffusers gives a value; allowed: keys that \
                             are null (absent from model.diffusers)",
                            key.chars().take(60).collect::<String>()
                        ),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Output channels of the final layer.
    pub fn out_channels(&self) -> u32 {
        if self.learn_sigma {
            2 * self.in_channels
        } else {
            self.in_channels
        }
    }

    /// Rows of the label table: K classes plus the null class when labels are dropped.
    pub fn label_rows(&self) -> u32 {
        self.num_classes + u32::from(self.class_dropout_prob > 0.0)
    }

    pub fn head_dim(&self) -> u32 {
        self.hidden / self.heads.max(1)
    }

    pub fn mlp_hidden(&self) -> u32 {
        self.hidden * self.mlp_ratio
    }
}

fn unknown_preset(name: &str) -> SpecError {
    SpecError::invalid(
        "model.preset",
        format!(
            "unknown preset '{name}'; allowed: {}",
            ModelSpec::preset_names().join(", ")
        ),
    )
}
