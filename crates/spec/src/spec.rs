//! The spec: one description of a training step (model + workload + recipe + runtime) that the
//! budget estimates, the planner rewrites and the engine executes.
//!
//! Specs are read from TOML or JSON; unknown fields are errors, and every invalid value is reported
//! by [`Spec::validate`] with the field's dotted path and what is allowed.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::SpecError;
use crate::sharder::{Offload, Sharder};

/// Element types that a tensor of the step can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F64,
    F32,
    Bf16,
    F16,
    /// One byte per element (8-bit optimizer state, dropout masks).
    U8,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size(self) -> u64 {
        match self {
            Dtype::F64 => 8,
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::U8 => 1,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F64 => "f64",
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::U8 => "u8",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

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
fn default_in_channels() -> u32 {
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
fn default_true() -> bool {
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
    pub fn restore_nulls(&mut self) -> Result<(), SpecError> {
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

/// What one optimizer step trains on: image size, latent geometry and how the batch is split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// Image height in pixels.
    pub height: u32,
    /// Image width in pixels.
    pub width: u32,
    /// VAE downsampling factor (8 for the SD VAE).
    #[serde(default = "default_vae_factor")]
    pub vae_factor: u32,
    /// Latent channels the VAE produces; must equal `model.in_channels`.
    #[serde(default = "default_in_channels")]
    pub latent_channels: u32,
    /// Images per optimizer step, over all ranks and microbatches.
    pub batch: u32,
    /// Images per forward/backward pass on one rank.
    pub microbatch: u32,
    /// Microbatches accumulated before each optimizer step.
    #[serde(default = "default_one")]
    pub accumulation: u32,
    /// Data-parallel ranks.
    #[serde(default = "default_one")]
    pub ranks: u32,
    /// Video frames per sample in pixel space (1 for images). A video family compresses them
    /// in time (Wan: (frames − 1) / 4 + 1 latent frames).
    #[serde(default = "default_one", skip_serializing_if = "is_one")]
    pub frames: u32,
    /// The VAE's temporal compression (Wan: 4); 1 for image VAEs.
    #[serde(default = "default_one", skip_serializing_if = "is_one")]
    pub vae_temporal_factor: u32,
    /// Text tokens per text encoder of the model's family, in the family's order (e.g. Flux:
    /// CLIP, T5; SD3: CLIP, T5); absent: the family's default. Only for text-conditioned families.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_tokens: Option<Vec<u32>>,
}

fn is_one(v: &u32) -> bool {
    *v == 1
}

fn default_vae_factor() -> u32 {
    8
}
fn default_one() -> u32 {
    1
}

/// Token geometry of one image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TokenGrid {
    /// Latent height (H / vae_factor).
    pub latent_h: u32,
    /// Latent width (W / vae_factor).
    pub latent_w: u32,
    /// Token rows (latent_h / p).
    pub rows: u32,
    /// Token columns (latent_w / p).
    pub cols: u32,
}

impl TokenGrid {
    pub fn tokens(&self) -> u64 {
        u64::from(self.rows) * u64::from(self.cols)
    }
}

/// Numeric policy of the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Precision {
    #[serde(rename = "fp64")]
    Fp64,
    #[serde(rename = "fp32")]
    Fp32,
    /// fp32 master weights, bf16 matmuls, norms/softmax/loss in fp32.
    #[serde(rename = "bf16-mixed")]
    Bf16Mixed,
    /// fp32 master weights, fp16 matmuls, norms/softmax/loss in fp32, dynamic loss scaling.
    #[serde(rename = "fp16-mixed")]
    Fp16Mixed,
    /// Weights, activations and gradients in bf16; optimizer state in fp32.
    #[serde(rename = "bf16-pure")]
    Bf16Pure,
}

impl Precision {
    pub const ALL: [Precision; 5] = [
        Precision::Fp64,
        Precision::Fp32,
        Precision::Bf16Mixed,
        Precision::Fp16Mixed,
        Precision::Bf16Pure,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Precision::Fp64 => "fp64",
            Precision::Fp32 => "fp32",
            Precision::Bf16Mixed => "bf16-mixed",
            Precision::Fp16Mixed => "fp16-mixed",
            Precision::Bf16Pure => "bf16-pure",
        }
    }

    /// Dtype the trained weights are stored in (the optimizer's view).
    pub const fn param_dtype(self) -> Dtype {
        match self {
            Precision::Fp64 => Dtype::F64,
            Precision::Fp32 | Precision::Bf16Mixed | Precision::Fp16Mixed => Dtype::F32,
            Precision::Bf16Pure => Dtype::Bf16,
        }
    }

    /// Dtype of matmuls, attention and the tensors they produce.
    pub const fn compute_dtype(self) -> Dtype {
        match self {
            Precision::Fp64 => Dtype::F64,
            Precision::Fp32 => Dtype::F32,
            Precision::Bf16Mixed | Precision::Bf16Pure => Dtype::Bf16,
            Precision::Fp16Mixed => Dtype::F16,
        }
    }

    /// Dtype of the residual streams: the accumulation dtype, or under LoRA the compute dtype,
    /// the frozen base's (the diffusers scripts cast the whole transformer to `weight_dtype`
    /// and feed it latents of that dtype). The engine's rule (`Trainer::new`) and the budget's.
    pub const fn stream_dtype(self, lora: bool) -> Dtype {
        if lora {
            self.compute_dtype()
        } else {
            self.accum_dtype()
        }
    }

    /// Dtype of the sensitive ops: norms, softmax, the residual stream and the loss.
    pub const fn accum_dtype(self) -> Dtype {
        match self {
            Precision::Fp64 => Dtype::F64,
            Precision::Bf16Pure => Dtype::Bf16,
            _ => Dtype::F32,
        }
    }

    /// Whether the weights are cast to a lower dtype for compute each step.
    pub const fn is_mixed(self) -> bool {
        matches!(self, Precision::Bf16Mixed | Precision::Fp16Mixed)
    }

    /// Dtype of AdamW's m and v (never below fp32).
    pub const fn optimizer_dtype(self) -> Dtype {
        match self {
            Precision::Fp64 => Dtype::F64,
            _ => Dtype::F32,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                SpecError::invalid(
                    "recipe.precision",
                    format!("'{s}' is not a precision; allowed: fp64, fp32, bf16-mixed, fp16-mixed, bf16-pure"),
                )
            })
    }
}

/// Optimizer of the trained parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Optimizer {
    /// AdamW with m and v per trained parameter (fp32, fp64 under the fp64 policy).
    #[serde(rename = "adamw")]
    AdamW,
    /// Block-wise 8-bit AdamW (bitsandbytes): 1-byte m and v plus one fp32 absmax per block.
    #[serde(rename = "adamw-8bit")]
    AdamW8bit,
    /// Plain SGD: no state.
    #[serde(rename = "sgd")]
    Sgd,
}

impl Optimizer {
    pub const fn name(self) -> &'static str {
        match self {
            Optimizer::AdamW => "adamw",
            Optimizer::AdamW8bit => "adamw-8bit",
            Optimizer::Sgd => "sgd",
        }
    }
}

impl FromStr for Optimizer {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s {
            "adamw" => Ok(Optimizer::AdamW),
            "adamw-8bit" => Ok(Optimizer::AdamW8bit),
            "sgd" => Ok(Optimizer::Sgd),
            _ => Err(SpecError::invalid(
                "recipe.optimizer",
                format!("'{s}' is not an optimizer; allowed: adamw, adamw-8bit, sgd"),
            )),
        }
    }
}

/// How attention is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AttentionMode {
    /// Scores and probabilities (batch·heads·tokens²) are materialised and kept for backward.
    #[serde(rename = "materialized")]
    Materialized,
    /// Query-chunked; keeps q, k, v, out and a log-sum-exp; backward recomputes the scores.
    #[serde(rename = "memory-efficient")]
    MemoryEfficient,
}

impl AttentionMode {
    pub const fn name(self) -> &'static str {
        match self {
            AttentionMode::Materialized => "materialized",
            AttentionMode::MemoryEfficient => "memory-efficient",
        }
    }
}

impl FromStr for AttentionMode {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s {
            "materialized" | "math" => Ok(AttentionMode::Materialized),
            "memory-efficient" | "mem-efficient" => Ok(AttentionMode::MemoryEfficient),
            _ => Err(SpecError::invalid(
                "recipe.attention",
                format!("'{s}' is not an attention mode; allowed: materialized, memory-efficient"),
            )),
        }
    }
}

/// Which blocks recompute their activations in backward instead of storing them.
///
/// Written as a string in specs and on the command line: `none`, `all`, `attention-only`,
/// `every-K` (blocks 0, K, 2K, …), or `blocks:0,3,7`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Recompute {
    None,
    All,
    EveryK(u32),
    Blocks(Vec<u32>),
    /// Only the attention core (scores, softmax, P·V) is recomputed.
    AttentionOnly,
}

impl Recompute {
    /// Whether block `i` of `depth` is fully recomputed.
    pub fn recomputes_block(&self, i: u32) -> bool {
        match self {
            Recompute::None | Recompute::AttentionOnly => false,
            Recompute::All => true,
            Recompute::EveryK(k) => *k > 0 && i.is_multiple_of(*k),
            // Sorted (parsing sorts, validation checks): O(log k) per block, so that a replay
            // stays linear in the depth.
            Recompute::Blocks(b) => b.binary_search(&i).is_ok(),
        }
    }

    /// Number of fully recomputed blocks among `depth`.
    pub fn recomputed_count(&self, depth: u32) -> u32 {
        (0..depth).filter(|&i| self.recomputes_block(i)).count() as u32
    }
}

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Recompute::None => f.write_str("none"),
            Recompute::All => f.write_str("all"),
            Recompute::AttentionOnly => f.write_str("attention-only"),
            Recompute::EveryK(k) => write!(f, "every-{k}"),
            Recompute::Blocks(b) => {
                let list: Vec<String> = b.iter().map(u32::to_string).collect();
                write!(f, "blocks:{}", list.join(","))
            }
        }
    }
}

impl From<Recompute> for String {
    fn from(r: Recompute) -> String {
        r.to_string()
    }
}

impl TryFrom<String> for Recompute {
    type Error = SpecError;
    fn try_from(s: String) -> Result<Self, SpecError> {
        s.parse()
    }
}

impl FromStr for Recompute {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        let bad = |why: &str| {
            SpecError::invalid(
                "recipe.recompute",
                format!("'{s}' {why}; allowed: none, all, attention-only, every-K (K ≥ 1), blocks:I,J,… (runs as I-J)"),
            )
        };
        match s {
            "none" => return Ok(Recompute::None),
            "all" => return Ok(Recompute::All),
            "attention-only" | "attention" => return Ok(Recompute::AttentionOnly),
            _ => {}
        }
        if let Some(k) = s.strip_prefix("every-") {
            let k: u32 = k.parse().map_err(|_| bad("has no valid K"))?;
            if k == 0 {
                return Err(bad("has K = 0"));
            }
            return Ok(Recompute::EveryK(k));
        }
        if let Some(list) = s.strip_prefix("blocks:") {
            let mut blocks = Vec::new();
            for item in list.split(',').map(str::trim).filter(|x| !x.is_empty()) {
                // A run of blocks as `I-J` (what `ditmem plan` prints in its flags), at most
                // MAX_DEPTH long so that a typo cannot size a huge list.
                if let Some((a, b)) = item.split_once('-') {
                    let num = |t: &str| {
                        t.trim()
                            .parse::<u32>()
                            .map_err(|_| bad("has a block range that is not I-J"))
                    };
                    let (a, b) = (num(a)?, num(b)?);
                    if a > b || b - a >= MAX_DEPTH {
                        return Err(bad(&format!(
                            "has a block range that is backwards or longer than {MAX_DEPTH}"
                        )));
                    }
                    blocks.extend(a..=b);
                    continue;
                }
                blocks.push(
                    item.parse::<u32>()
                        .map_err(|_| bad("has a block that is not a number"))?,
                );
            }
            if blocks.is_empty() {
                return Err(bad("names no block"));
            }
            blocks.sort_unstable();
            blocks.dedup();
            return Ok(Recompute::Blocks(blocks));
        }
        Err(bad("is not a recompute policy"))
    }
}

/// Linears of a DiT block that LoRA can adapt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoraTarget {
    Qkv,
    Proj,
    Fc1,
    Fc2,
    Adaln,
}

impl LoraTarget {
    pub const ALL: [LoraTarget; 5] = [
        LoraTarget::Qkv,
        LoraTarget::Proj,
        LoraTarget::Fc1,
        LoraTarget::Fc2,
        LoraTarget::Adaln,
    ];
}

/// Low-rank adapters: the base model is frozen, each targeted linear gains A (r×in) and B (out×r).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraSpec {
    pub rank: u32,
    /// The original DiT's linears to adapt.
    #[serde(default = "default_lora_targets")]
    pub targets: Vec<LoraTarget>,
    /// A diffusers model's linears to adapt, as PEFT's `target_modules` names them (a module
    /// matches a name when its full name equals it or ends with `.name`); empty: the family's
    /// default (diffusers' LoRA scripts: `to_q, to_k, to_v, to_out.0`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub modules: Vec<String>,
    /// The dtype the adapters are kept in ([`LoraDtype`]; default fp32).
    #[serde(default, skip_serializing_if = "LoraDtype::is_fp32")]
    pub dtype: LoraDtype,
}

/// The dtype LoRA adapters are kept in, and with them their gradients and AdamW's state.
/// - `fp32` (the default): `cast_training_params(model, dtype=torch.float32)` after PEFT adds
///   them, what the diffusers LoRA scripts do under `--mixed_precision fp16` (GradScaler cannot
///   unscale fp16 gradients); mixed precision casts them for compute under autocast.
/// - `weight`: the frozen base's dtype (`weight_dtype`), what the same scripts keep under
///   `--mixed_precision bf16` (the cast is inside `if args.mixed_precision == "fp16"`; PEFT's
///   `update_layer` moves new adapters to the base layer's device and float dtype): no fp32
///   copy, bf16 gradients, and `torch.optim.AdamW`'s `exp_avg`/`exp_avg_sq` are
///   `zeros_like(p)`, bf16 too. Under fp32 the two are the same.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoraDtype {
    #[default]
    Fp32,
    Weight,
}

impl LoraDtype {
    pub const ALL: [LoraDtype; 2] = [LoraDtype::Fp32, LoraDtype::Weight];

    pub const fn name(self) -> &'static str {
        match self {
            LoraDtype::Fp32 => "fp32",
            LoraDtype::Weight => "weight",
        }
    }

    pub fn is_fp32(&self) -> bool {
        *self == LoraDtype::Fp32
    }
}

impl FromStr for LoraDtype {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        LoraDtype::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                SpecError::invalid(
                    "recipe.lora.dtype",
                    format!("'{s}' is not an adapter dtype; allowed: fp32, weight"),
                )
            })
    }
}

impl Recipe {
    /// Whether LoRA adapters are kept below fp32 ([`LoraDtype::Weight`] under mixed precision).
    pub fn low_adapters(&self) -> bool {
        self.lora
            .as_ref()
            .is_some_and(|l| l.dtype == LoraDtype::Weight)
            && self.precision.is_mixed()
    }

    /// Dtype the trained tensors are stored in, and their gradients are.
    pub fn trained_dtype(&self) -> Dtype {
        if self.low_adapters() {
            self.precision.compute_dtype()
        } else {
            self.precision.param_dtype()
        }
    }

    /// Dtype of AdamW's state: `zeros_like(p)`, never below fp32 except for low adapters.
    pub fn state_dtype(&self) -> Dtype {
        if self.low_adapters() {
            self.precision.compute_dtype()
        } else {
            self.precision.optimizer_dtype()
        }
    }

    /// Whether the trained tensors are fp32 masters that autocast casts for compute.
    pub fn trained_masters(&self) -> bool {
        self.precision.is_mixed() && !self.low_adapters()
    }

    /// What a spec may not combine with `lora.dtype = "weight"`.
    fn validate_lora_dtype(&self, runtime: Runtime, ranks: u32) -> Result<(), SpecError> {
        if !self
            .lora
            .as_ref()
            .is_some_and(|l| l.dtype == LoraDtype::Weight)
        {
            return Ok(());
        }
        let why = match (self.precision, runtime) {
            (Precision::Fp16Mixed, _) => {
                "under fp16-mixed: GradScaler cannot unscale fp16 \
                 gradients (the scripts upcast the adapters to fp32 there)"
            }
            (p, Runtime::DitmemCpu) if p.is_mixed() => {
                "with the ditmem-cpu engine: it keeps \
                 trained tensors in the precision's parameter dtype (fp32 masters)"
            }
            _ if ranks > 1 => "over several ranks: the sharding rules count fp32 adapters",
            _ => return Ok(()),
        };
        Err(SpecError::invalid(
            "recipe.lora.dtype",
            format!("weight {why}; allowed: fp32"),
        ))
    }
}

pub fn default_lora_targets() -> Vec<LoraTarget> {
    vec![
        LoraTarget::Qkv,
        LoraTarget::Proj,
        LoraTarget::Fc1,
        LoraTarget::Fc2,
    ]
}

/// Where the latents come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Latents {
    /// The frozen VAE encoder runs inside the step without gradient (DiT's `train.py`).
    Encode,
    /// Latents were encoded beforehand and are read from disk.
    Cached,
}

impl FromStr for Latents {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s {
            "encode" => Ok(Latents::Encode),
            "cached" => Ok(Latents::Cached),
            _ => Err(SpecError::invalid(
                "recipe.latents",
                format!("'{s}' is not a latent source; allowed: encode, cached"),
            )),
        }
    }
}

/// Where a family's frozen text encoders are during the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TextEncoders {
    /// The caption embeddings were computed beforehand (or once, the encoders then freed, as
    /// diffusers' DreamBooth scripts do for a fixed instance prompt): not in the step.
    #[default]
    Cached,
    /// On the device for the whole step in `weight_dtype`, encoding each microbatch's captions
    /// without gradient (the scripts' `text_encoder.to(accelerator.device, dtype=weight_dtype)`).
    Online,
    /// Kept on the host and moved to the device only to encode (the scripts' `--offload`):
    /// their weights are on the device during the encode alone.
    Offloaded,
}

impl TextEncoders {
    pub fn is_cached(&self) -> bool {
        *self == TextEncoders::Cached
    }

    pub const fn name(self) -> &'static str {
        match self {
            TextEncoders::Cached => "cached",
            TextEncoders::Online => "online",
            TextEncoders::Offloaded => "offloaded",
        }
    }
}

impl FromStr for TextEncoders {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s {
            "cached" => Ok(TextEncoders::Cached),
            "online" => Ok(TextEncoders::Online),
            "offloaded" => Ok(TextEncoders::Offloaded),
            _ => Err(SpecError::invalid(
                "recipe.text_encoders",
                format!(
                    "'{s}' is not a text-encoder placement; allowed: cached, online, offloaded"
                ),
            )),
        }
    }
}

/// An exponential moving average of the weights, kept beside the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmaSpec {
    #[serde(default = "default_true")]
    pub enabled: bool,
    #[serde(default = "default_ema_dtype")]
    pub dtype: Dtype,
    #[serde(default = "default_ema_decay")]
    pub decay: f64,
}

fn default_ema_dtype() -> Dtype {
    Dtype::F32
}
fn default_ema_decay() -> f64 {
    0.9999
}

impl Default for EmaSpec {
    fn default() -> Self {
        EmaSpec {
            enabled: true,
            dtype: Dtype::F32,
            decay: 0.9999,
        }
    }
}

/// What the network predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Prediction {
    /// The noise ε (DiT).
    #[default]
    Eps,
    /// v = √ᾱ·ε − √(1−ᾱ)·x₀.
    V,
}

/// How the step is computed: the levers ditmem budgets, plans and executes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    #[serde(default = "default_precision")]
    pub precision: Precision,
    #[serde(default = "default_optimizer")]
    pub optimizer: Optimizer,
    #[serde(default = "default_attention")]
    pub attention: AttentionMode,
    #[serde(default = "default_recompute")]
    pub recompute: Recompute,
    #[serde(default)]
    pub lora: Option<LoraSpec>,
    /// ZeRO stage over the data-parallel ranks: 0 none, 1 optimizer state, 2 + gradients, 3 + weights.
    #[serde(default)]
    pub zero_stage: u8,
    /// Who shards a stage ≥ 1: DeepSpeed ZeRO (default) or FSDP2 (`crate::sharding`).
    #[serde(default, skip_serializing_if = "Sharder::is_default")]
    pub sharder: Sharder,
    /// What a sharded step keeps in host memory: none, optimizer, optimizer+params.
    #[serde(default, skip_serializing_if = "Offload::is_none")]
    pub offload: Offload,
    /// DDP's `gradient_as_bucket_view` (stage 0 over several ranks): the gradients are views of
    /// the all-reduce buckets instead of a second copy.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gradient_as_bucket_view: bool,
    #[serde(default = "default_latents")]
    pub latents: Latents,
    /// Where the frozen text encoders are during the step (a family's T5, CLIP, Gemma, umT5).
    #[serde(default, skip_serializing_if = "TextEncoders::is_cached")]
    pub text_encoders: TextEncoders,
    #[serde(default)]
    pub ema: EmaSpec,
    #[serde(default)]
    pub prediction: Prediction,
    /// How the frozen base's Linear weights are stored under LoRA (QLoRA: `nf4`).
    #[serde(default, skip_serializing_if = "BaseQuant::is_none")]
    pub base_quant: BaseQuant,
    /// bitsandbytes' paged 8-bit AdamW (`bnb.optim.PagedAdamW8bit`): the state buffers of
    /// tensors of at least 1e5 elements live in CUDA managed memory (`cudaMallocManaged`,
    /// bitsandbytes `optim/optimizer.py` `get_state_buffer`), outside PyTorch's caching
    /// allocator; the driver pages them to the host when the device runs short.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paged_optimizer: bool,
    /// Which implementation of `torch.optim.AdamW` the `pytorch` runtime runs; absent: the
    /// device's default (for-loop on the CPU, foreach on CUDA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_impl: Option<OptimizerImpl>,
    /// fp32 matmuls on TF32 tensor cores (`torch.backends.cuda.matmul.allow_tf32 = True`): on by
    /// default, as the scripts people train with set it — DiT's and fast-DiT's `train.py`
    /// (module top: `torch.backends.cuda.matmul.allow_tf32 = True`) and the diffusers scripts'
    /// `--allow_tf32`, which the exports pass. PyTorch's own default is off (since 1.12). Only
    /// the time model reads it (fp32 compute at the card's TF32 rate, `cost.rs`); cards without
    /// TF32 units (sm < 80) and CPUs keep the fp32 rate.
    #[serde(default = "default_tf32", skip_serializing_if = "is_true")]
    pub tf32: bool,
}

fn default_tf32() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

/// Storage of a frozen LoRA base's Linear weights inside the transformer blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BaseQuant {
    /// In the compute dtype (`weight_dtype` of the scripts).
    #[default]
    None,
    /// bitsandbytes `Linear8bitLt` (LLM.int8): int8 weight + one fp32 scale per output row.
    Int8,
    /// bitsandbytes `Linear4bit`, NF4 with double quantization (QLoRA): 4 bits per weight +
    /// an 8-bit absmax per 64 weights + an fp32 absmax per 256 of those.
    Nf4,
    /// fp8 (e4m3) storage, upcast to the compute dtype per layer (diffusers layerwise casting).
    Fp8,
}

impl BaseQuant {
    pub const ALL: [BaseQuant; 4] = [
        BaseQuant::None,
        BaseQuant::Int8,
        BaseQuant::Nf4,
        BaseQuant::Fp8,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            BaseQuant::None => "none",
            BaseQuant::Int8 => "int8",
            BaseQuant::Nf4 => "nf4",
            BaseQuant::Fp8 => "fp8",
        }
    }

    pub fn is_none(&self) -> bool {
        *self == BaseQuant::None
    }

    /// Bytes of an (out × inp) weight stored this way (None: not quantized). Sources:
    /// bitsandbytes `Int8Params` (`CB` int8, `SCB` fp32 of shape (out,)); `Params4bit` with
    /// `blocksize=64`, `compress_statistics=True` (uint8 packs two weights; absmax quantized to
    /// 8 bits in blocks of 256 with an fp32 absmax each); fp8: one byte per weight.
    pub fn weight_bytes(self, out: u64, inp: u64) -> Option<u64> {
        let n = out * inp;
        match self {
            BaseQuant::None => None,
            BaseQuant::Int8 => Some(n + 4 * out),
            BaseQuant::Nf4 => {
                let blocks = n.div_ceil(64);
                Some(n.div_ceil(2) + blocks + 4 * blocks.div_ceil(256))
            }
            BaseQuant::Fp8 => Some(n),
        }
    }
}

impl FromStr for BaseQuant {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        BaseQuant::ALL
            .into_iter()
            .find(|q| q.name() == s)
            .ok_or_else(|| {
                SpecError::invalid(
                    "recipe.base_quant",
                    format!("'{s}' is not a base storage; allowed: none, int8, nf4, fp8"),
                )
            })
    }
}

/// The implementations of `torch.optim.AdamW` / `SGD` (`torch/optim/adam.py`): each keeps
/// different scratch during `step()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerImpl {
    /// `_single_tensor_adam`: one parameter at a time (`foreach=False`); PyTorch's default for
    /// tensors not on CUDA (`torch/optim/optimizer.py` `_default_to_fused_or_foreach`).
    ForLoop,
    /// `_multi_tensor_adam` (`foreach=True`): `_foreach_*` ops over every parameter at once;
    /// the default on CUDA.
    Foreach,
    /// `_fused_adam` (`fused=True`): one kernel per tensor group, no temporaries; never the
    /// default.
    Fused,
}

impl OptimizerImpl {
    pub const ALL: [OptimizerImpl; 3] = [
        OptimizerImpl::ForLoop,
        OptimizerImpl::Foreach,
        OptimizerImpl::Fused,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            OptimizerImpl::ForLoop => "for-loop",
            OptimizerImpl::Foreach => "foreach",
            OptimizerImpl::Fused => "fused",
        }
    }

    /// PyTorch's default on a device: `foreach` for CUDA tensors, the for-loop elsewhere
    /// (`_default_to_fused_or_foreach`: `fused` is never chosen by default).
    pub const fn default_for(device: TorchDevice) -> OptimizerImpl {
        match device {
            TorchDevice::Cuda => OptimizerImpl::Foreach,
            TorchDevice::Cpu => OptimizerImpl::ForLoop,
        }
    }
}

impl fmt::Display for OptimizerImpl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for OptimizerImpl {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        OptimizerImpl::ALL
            .into_iter()
            .find(|i| i.name() == s)
            .ok_or_else(|| {
                SpecError::invalid(
                    "recipe.optimizer_impl",
                    format!("'{s}' is not an optimizer implementation; allowed: for-loop, foreach, fused"),
                )
            })
    }
}

fn default_precision() -> Precision {
    Precision::Bf16Mixed
}
fn default_optimizer() -> Optimizer {
    Optimizer::AdamW
}
fn default_attention() -> AttentionMode {
    AttentionMode::Materialized
}
fn default_recompute() -> Recompute {
    Recompute::None
}
fn default_latents() -> Latents {
    Latents::Cached
}

impl Default for Recipe {
    fn default() -> Self {
        Recipe {
            precision: default_precision(),
            optimizer: default_optimizer(),
            attention: default_attention(),
            recompute: default_recompute(),
            lora: None,
            zero_stage: 0,
            sharder: Sharder::Deepspeed,
            offload: Offload::None,
            gradient_as_bucket_view: false,
            latents: default_latents(),
            text_encoders: TextEncoders::Cached,
            paged_optimizer: false,
            ema: EmaSpec::default(),
            prediction: Prediction::Eps,
            base_quant: BaseQuant::None,
            optimizer_impl: None,
            tf32: default_tf32(),
        }
    }
}

/// Where the PyTorch step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TorchDevice {
    Cpu,
    Cuda,
}

impl TorchDevice {
    pub const fn name(self) -> &'static str {
        match self {
            TorchDevice::Cpu => "cpu",
            TorchDevice::Cuda => "cuda",
        }
    }
}

/// Which `scaled_dot_product_attention` kernel runs when the spec's attention is
/// `memory-efficient` (the `materialized` mode is the explicit `softmax(q·kᵀ)·v` of timm's
/// non-fused path, whatever this says).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SdpaBackend {
    /// PyTorch's own choice: CPU flash on the CPU; on CUDA flash for fp16/bf16, memory-efficient
    /// for fp32/fp64.
    Auto,
    Flash,
    Efficient,
    Cudnn,
    Math,
}

impl SdpaBackend {
    pub const ALL: [SdpaBackend; 5] = [
        SdpaBackend::Auto,
        SdpaBackend::Flash,
        SdpaBackend::Efficient,
        SdpaBackend::Cudnn,
        SdpaBackend::Math,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            SdpaBackend::Auto => "auto",
            SdpaBackend::Flash => "flash",
            SdpaBackend::Efficient => "efficient",
            SdpaBackend::Cudnn => "cudnn",
            SdpaBackend::Math => "math",
        }
    }
}

/// The executor whose memory the budget describes.
///
/// Each runtime has its own rules for what an op saves and allocates (see
/// the budget's `RuntimeModel` trait, `runtime/model.rs`); adding one means adding a variant and its rules.
/// Written as a string: `ditmem-cpu`, or `pytorch[:cpu|:cuda][:sdpa-auto|flash|efficient|cudnn|math]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(try_from = "String", into = "String")]
pub enum Runtime {
    /// The ditmem engine (candle) on the CPU.
    #[default]
    DitmemCpu,
    /// PyTorch eager autograd (see `runtime::pytorch`).
    Pytorch {
        device: TorchDevice,
        sdpa: SdpaBackend,
    },
}

impl Runtime {
    pub const fn name(self) -> &'static str {
        match self {
            Runtime::DitmemCpu => "ditmem-cpu",
            Runtime::Pytorch { .. } => "pytorch",
        }
    }
}

impl fmt::Display for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Runtime::DitmemCpu => f.write_str("ditmem-cpu"),
            Runtime::Pytorch { device, sdpa } => {
                write!(f, "pytorch:{}", device.name())?;
                if *sdpa != SdpaBackend::Auto {
                    write!(f, ":sdpa-{}", sdpa.name())?;
                }
                Ok(())
            }
        }
    }
}

impl From<Runtime> for String {
    fn from(r: Runtime) -> String {
        r.to_string()
    }
}

impl TryFrom<String> for Runtime {
    type Error = SpecError;
    fn try_from(s: String) -> Result<Self, SpecError> {
        s.parse()
    }
}

impl FromStr for Runtime {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        let bad = |why: String| {
            SpecError::invalid(
                "runtime",
                format!("'{s}' {why}; allowed: ditmem-cpu, pytorch[:cpu|:cuda][:sdpa-auto|sdpa-flash|sdpa-efficient|sdpa-cudnn|sdpa-math] (the sdpa- prefix may be left out)"),
            )
        };
        match s {
            "ditmem-cpu" | "ditmem" | "engine" => return Ok(Runtime::DitmemCpu),
            _ => {}
        }
        let mut parts = s.split(':');
        if parts.next() != Some("pytorch") {
            return Err(bad("is not a runtime".into()));
        }
        let (mut device, mut sdpa) = (TorchDevice::Cpu, SdpaBackend::Auto);
        for opt in parts {
            match opt {
                "cpu" => device = TorchDevice::Cpu,
                "cuda" => device = TorchDevice::Cuda,
                _ => {
                    // `sdpa-efficient` or, as the README writes it, `efficient`.
                    let name = opt.strip_prefix("sdpa-").unwrap_or(opt);
                    sdpa = SdpaBackend::ALL
                        .into_iter()
                        .find(|b| b.name() == name)
                        .ok_or_else(|| bad(format!("has an unknown option '{opt}'")))?;
                }
            }
        }
        Ok(Runtime::Pytorch { device, sdpa })
    }
}

/// How the `ditmem-cpu` engine multiplies bf16 matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Bf16Products {
    /// On the engine's AVX512-BF16 kernel (`vdpbf16ps`, f32 accumulation): needs a CPU with
    /// AVX512F and AVX512-BF16; makes no `gemm` product, so `gemm` keeps no packing slab.
    Kernel,
    /// Widened to f32 and multiplied by the `gemm` crate under candle (any CPU).
    Widen,
}

impl Bf16Products {
    pub const fn name(self) -> &'static str {
        match self {
            Bf16Products::Kernel => "kernel",
            Bf16Products::Widen => "widen",
        }
    }
}

impl FromStr for Bf16Products {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s {
            "kernel" => Ok(Bf16Products::Kernel),
            "widen" => Ok(Bf16Products::Widen),
            _ => Err(SpecError::invalid(
                "cpu.bf16_products",
                format!("'{s}' is not a bf16 product path; allowed: kernel, widen"),
            )),
        }
    }
}

/// The microkernels the `gemm` crate runs f32/f64 products on, chosen at run time from the CPU's
/// features (`gemm-common` 0.19 `gemm_def!`: `avx512f` with the workspace's `x86-v4` feature,
/// else `fma`). They set the SIMD lanes, the micro-tile and so which calls pack their operands
/// into a per-call buffer (`ditmem_budget::ditmem_cpu::gemm_pack`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GemmIsa {
    /// AVX2 + FMA: 8 f32 lanes, 16 × 6 f32 micro-tiles (`gemm_f32::microkernel::fma`).
    Avx2,
    /// AVX-512F: 16 f32 lanes, 64 × 6 f32 micro-tiles (`gemm_f32::microkernel::avx512f`).
    Avx512,
}

impl GemmIsa {
    pub const fn name(self) -> &'static str {
        match self {
            GemmIsa::Avx2 => "avx2",
            GemmIsa::Avx512 => "avx512",
        }
    }

    /// The ISA of the reference machine (AMD EPYC, Zen 4: AVX-512F), which a spec written
    /// before the field existed is taken to describe, like the rest of [`CpuSpec::REFERENCE`].
    pub const fn reference() -> GemmIsa {
        GemmIsa::Avx512
    }
}

impl FromStr for GemmIsa {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s {
            "avx2" => Ok(GemmIsa::Avx2),
            "avx512" => Ok(GemmIsa::Avx512),
            _ => Err(SpecError::invalid(
                "cpu.gemm_isa",
                format!("'{s}' is not a gemm kernel family; allowed: avx2, avx512"),
            )),
        }
    }
}

/// The CPU that the `ditmem-cpu` runtime executes on: what the engine's allocations depend on
/// beyond the model and the recipe. The budget never reads the host: these values are part of
/// the spec, filled from the machine by the CLI (and by the engine's `host::resolve`) where the
/// spec leaves them out, and printed with every estimate, so one spec estimates the same on
/// every machine and the engine refuses a `cpu` section that does not describe its process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuSpec {
    /// Threads of the pool the step runs on (rayon's: `RAYON_NUM_THREADS`, else every logical
    /// core). Each thread that runs a `gemm` product keeps one packing slab, and the fused
    /// attention keeps one scratch per thread (at most one per head).
    pub threads: u32,
    /// How bf16 products run: the AVX512-BF16 kernel, or widened to f32 through `gemm`.
    pub bf16_products: Bf16Products,
    /// Bytes of the packing slab that the `gemm` crate allocates once per thread that runs a
    /// product (`gemm_common::gemm::L2_SLAB`): the L2 cache per core as `gemm-common` reads it
    /// (`cache.rs`: sysfs on Linux, cpuid elsewhere). 1 MiB on the AMD EPYC (Zen 4) this project
    /// measures on, 2 MiB on an Intel Xeon (Sapphire Rapids).
    pub gemm_l2_bytes: u64,
    /// The microkernels `gemm` runs f32/f64 products on ([`GemmIsa`]). A spec without the field
    /// (written before it existed) is read as the reference machine's, AVX-512.
    #[serde(default = "GemmIsa::reference")]
    pub gemm_isa: GemmIsa,
    /// The other caches `gemm` blocks its products by (`gemm_common::cache::CACHE_INFO`, read
    /// from sysfs): the L1d's bytes and ways set the depth block `kc` (above 512 it grows with
    /// a roomier L1), the L2's ways the row block `mc`, the L3's bytes and ways the column block
    /// `nc`, and with them what a product packs per call. A spec without them (written before
    /// they existed) is read as the reference machine's (Zen 4: L1d 48 KiB 12-way, L2 16-way, L3
    /// 32 MiB 16-way); on a Zen 1 (L1d 32 KiB 8-way) those overstated a depth-1024 weight
    /// gradient's packing twice over. Lines are 64 bytes on every x86-64 CPU.
    #[serde(default = "CpuSpec::reference_l1_bytes")]
    pub gemm_l1_bytes: u64,
    #[serde(default = "CpuSpec::reference_l1_ways")]
    pub gemm_l1_ways: u64,
    #[serde(default = "CpuSpec::reference_l2_ways")]
    pub gemm_l2_ways: u64,
    /// 0 where the CPU reports no L3 (`gemm` then blocks columns by the L2 alone).
    #[serde(default = "CpuSpec::reference_l3_bytes")]
    pub gemm_l3_bytes: u64,
    #[serde(default = "CpuSpec::reference_l3_ways")]
    pub gemm_l3_ways: u64,
}

impl CpuSpec {
    /// The machine the project's figures were measured on, used by the library when a spec has
    /// no `cpu` section: AMD EPYC (Zen 4) with 2 threads, AVX512-BF16, 1 MiB of L2 per core.
    pub const REFERENCE: CpuSpec = CpuSpec {
        threads: 2,
        bf16_products: Bf16Products::Kernel,
        gemm_l2_bytes: 1 << 20,
        gemm_isa: GemmIsa::Avx512,
        gemm_l1_bytes: 48 << 10,
        gemm_l1_ways: 12,
        gemm_l2_ways: 16,
        gemm_l3_bytes: 32 << 20,
        gemm_l3_ways: 16,
    };

    const fn reference_l1_bytes() -> u64 {
        Self::REFERENCE.gemm_l1_bytes
    }
    const fn reference_l1_ways() -> u64 {
        Self::REFERENCE.gemm_l1_ways
    }
    const fn reference_l2_ways() -> u64 {
        Self::REFERENCE.gemm_l2_ways
    }
    const fn reference_l3_bytes() -> u64 {
        Self::REFERENCE.gemm_l3_bytes
    }
    const fn reference_l3_ways() -> u64 {
        Self::REFERENCE.gemm_l3_ways
    }

    /// Most threads a spec may name.
    pub const MAX_THREADS: u32 = 4096;
    /// Smallest and largest `gemm` slab a spec may name (`gemm` cannot run with no L2).
    pub const GEMM_L2_RANGE: (u64, u64) = (1 << 10, 1 << 30);
    /// Smallest and largest L1d a spec may name.
    pub const GEMM_L1_RANGE: (u64, u64) = (1 << 10, 64 << 20);
    /// Largest L3 a spec may name (0: none).
    pub const GEMM_L3_MAX: u64 = 64 << 30;
    /// Ways of a cache level a spec may name.
    pub const GEMM_WAYS_RANGE: (u64, u64) = (1, 1024);

    /// Whether bf16 products run on the AVX512-BF16 kernel.
    pub const fn bf16_kernel(&self) -> bool {
        matches!(self.bf16_products, Bf16Products::Kernel)
    }

    fn validate(&self) -> Result<(), SpecError> {
        if self.threads == 0 || self.threads > Self::MAX_THREADS {
            return Err(SpecError::invalid(
                "cpu.threads",
                format!(
                    "{} is out of range; allowed: 1 to {}",
                    self.threads,
                    Self::MAX_THREADS
                ),
            ));
        }
        let (lo, hi) = Self::GEMM_L2_RANGE;
        if !(lo..=hi).contains(&self.gemm_l2_bytes) {
            return Err(SpecError::invalid(
                "cpu.gemm_l2_bytes",
                format!(
                    "{} is out of range; allowed: {lo} to {hi} bytes (the L2 cache per core)",
                    self.gemm_l2_bytes
                ),
            ));
        }
        let (lo, hi) = Self::GEMM_L1_RANGE;
        if !(lo..=hi).contains(&self.gemm_l1_bytes) {
            return Err(SpecError::invalid(
                "cpu.gemm_l1_bytes",
                format!(
                    "{} is out of range; allowed: {lo} to {hi} bytes (the L1 data cache per core)",
                    self.gemm_l1_bytes
                ),
            ));
        }
        if self.gemm_l3_bytes > Self::GEMM_L3_MAX {
            return Err(SpecError::invalid(
                "cpu.gemm_l3_bytes",
                format!(
                    "{} is out of range; allowed: 0 (no L3) to {} bytes",
                    self.gemm_l3_bytes,
                    Self::GEMM_L3_MAX
                ),
            ));
        }
        let (lo, hi) = Self::GEMM_WAYS_RANGE;
        for (field, ways) in [
            ("cpu.gemm_l1_ways", self.gemm_l1_ways),
            ("cpu.gemm_l2_ways", self.gemm_l2_ways),
            ("cpu.gemm_l3_ways", self.gemm_l3_ways),
        ] {
            if !(lo..=hi).contains(&ways) {
                return Err(SpecError::invalid(
                    field,
                    format!(
                        "{ways} is out of range; allowed: {lo} to {hi} (the cache's associativity)"
                    ),
                ));
            }
        }
        Ok(())
    }
}

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

/// Where a `pytorch:cuda` step runs: a GPU of the catalog (`ditmem gpus`) and the caching
/// allocator's `PYTORCH_CUDA_ALLOC_CONF`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CudaSpec {
    /// A catalog name (`h100-80gb`, `rtx-4090`, …); absent: no capacity to fit against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// `PYTORCH_CUDA_ALLOC_CONF` syntax, e.g. `expandable_segments:True` or
    /// `max_split_size_mb:128,roundup_power2_divisions:4`; empty: PyTorch's defaults.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub alloc_conf: String,
    /// The card's `total_memory` in bytes as the user's own torch prints it
    /// (`torch.cuda.get_device_properties(0).total_memory`, `--gpu-memory`): replaces the
    /// catalog's capacity; absent: the catalog's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory: Option<u64>,
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

    /// Check every field; the error names the first field that is wrong and what is allowed.
    ///
    /// Besides what makes a spec meaningful, the sizes are capped ([`LIMITS`]) generously above
    /// any real model, so that `estimate` and `plan` of any spec that passes stay within a
    /// bounded time and memory (the README states them).
    pub fn validate(&self) -> Result<(), SpecError> {
        let m = &self.model;
        // A diffusers model's own fields are checked by its family reader, and the fields below
        // are derived from it (`denoiser::resolve`), so only what the spec itself says is checked.
        let dit = m.diffusers.is_none();
        if dit {
            self.validate_dit_model()?;
            if !m.keep_blocks.is_empty() {
                return Err(SpecError::invalid(
                    "model.keep_blocks",
                    format!(
                        "{:?} on the original DiT; allowed: an empty list (set model.depth)",
                        m.keep_blocks
                    ),
                ));
            }
        }
        self.validate_workload(dit)?;
        if let Some(b) = self.cuda.as_ref().and_then(|c| c.gpu_memory) {
            // Above any CUDA context and the allocator's smallest segment, below 16 TiB.
            if !(1u64 << 30..16u64 << 40).contains(&b) {
                return Err(SpecError::invalid(
                    "cuda.gpu_memory",
                    format!("{b} bytes is out of range; allowed: 1 GiB to 16 TiB (total_memory)"),
                ));
            }
        }
        self.validate_recipe()
    }

    fn validate_dit_model(&self) -> Result<(), SpecError> {
        let m = &self.model;
        in_range("model.depth", m.depth, MAX_DEPTH)?;
        in_range("model.hidden", m.hidden, MAX_HIDDEN)?;
        in_range("model.heads", m.heads, MAX_HIDDEN)?;
        in_range("model.patch", m.patch, MAX_PATCH)?;
        in_range("model.in_channels", m.in_channels, MAX_CHANNELS)?;
        in_range("model.mlp_ratio", m.mlp_ratio, MAX_MLP_RATIO)?;
        in_range("model.num_classes", m.num_classes, MAX_NUM_CLASSES)?;
        in_range("model.freq_embed", m.freq_embed, MAX_FREQ_EMBED)?;
        if !m.hidden.is_multiple_of(m.heads) {
            return Err(SpecError::invalid(
                "model.heads",
                format!(
                    "{} does not divide model.hidden = {}; allowed: a divisor of the hidden size",
                    m.heads, m.hidden
                ),
            ));
        }
        if !m.freq_embed.is_multiple_of(2) {
            return Err(SpecError::invalid(
                "model.freq_embed",
                format!(
                    "{} is odd; allowed: an even number (cos and sin halves)",
                    m.freq_embed
                ),
            ));
        }
        probability("model.class_dropout_prob", m.class_dropout_prob)?;
        probability("model.attn_dropout", m.attn_dropout)?;
        probability("model.mlp_dropout", m.mlp_dropout)?;
        let block_params =
            (10 + 2 * u128::from(m.mlp_ratio)) * u128::from(m.hidden) * u128::from(m.hidden);
        if u128::from(m.depth) * block_params > MAX_TENSOR_ELEMS {
            return Err(SpecError::invalid(
                "model.hidden",
                format!(
                    "depth {} × hidden {} gives about {} parameters; allowed: at most {MAX_TENSOR_ELEMS}",
                    m.depth,
                    m.hidden,
                    u128::from(m.depth) * block_params
                ),
            ));
        }
        let w = &self.workload;
        if w.frames != 1 {
            return Err(SpecError::invalid(
                "workload.frames",
                format!(
                    "{} for the original DiT (an image model); allowed: 1, or a video model in model.diffusers",
                    w.frames
                ),
            ));
        }
        if w.text_tokens.is_some() {
            return Err(SpecError::invalid(
                "workload.text_tokens",
                "is given for the original DiT (class-conditional, no text encoder); allowed: only with a \
                 text-conditioned model in model.diffusers",
            ));
        }
        if w.latent_channels != m.in_channels {
            return Err(SpecError::invalid(
                "workload.latent_channels",
                format!(
                    "{} differs from model.in_channels = {}; allowed: the channels the denoiser reads",
                    w.latent_channels, m.in_channels
                ),
            ));
        }
        Ok(())
    }

    fn validate_workload(&self, dit: bool) -> Result<(), SpecError> {
        let m = &self.model;
        let w = &self.workload;
        in_range("workload.height", w.height, MAX_SIDE)?;
        in_range("workload.width", w.width, MAX_SIDE)?;
        in_range("workload.vae_factor", w.vae_factor, MAX_VAE_FACTOR)?;
        in_range("workload.latent_channels", w.latent_channels, MAX_CHANNELS)?;
        positive("workload.batch", w.batch)?;
        in_range("workload.microbatch", w.microbatch, MAX_MICROBATCH)?;
        in_range("workload.accumulation", w.accumulation, MAX_ACCUMULATION)?;
        in_range("workload.ranks", w.ranks, MAX_RANKS)?;
        in_range("workload.frames", w.frames, MAX_FRAMES)?;
        in_range(
            "workload.vae_temporal_factor",
            w.vae_temporal_factor,
            MAX_VAE_FACTOR,
        )?;
        if let Some(tt) = &w.text_tokens {
            if tt.is_empty() || tt.len() > MAX_TEXT_ENCODERS {
                return Err(SpecError::invalid(
                    "workload.text_tokens",
                    format!(
                        "lists {} encoders; allowed: 1..={MAX_TEXT_ENCODERS} token counts, one per text encoder",
                        tt.len()
                    ),
                ));
            }
            for &t in tt {
                in_range("workload.text_tokens", t, MAX_TEXT_TOKENS)?;
            }
        }
        if !dit && [m.depth, m.hidden, m.heads, m.patch, m.in_channels].contains(&0) {
            // Not resolved yet (`denoiser::resolve` derives these): the geometry below needs
            // the family's patch, blocks and widths.
            return Ok(());
        }
        let product = u64::from(w.microbatch) * u64::from(w.accumulation) * u64::from(w.ranks);
        if product != u64::from(w.batch) {
            return Err(SpecError::invalid(
                "workload.batch",
                format!(
                    "{} ≠ microbatch × accumulation × ranks = {} × {} × {} = {product}; allowed: batch equal to that product",
                    w.batch, w.microbatch, w.accumulation, w.ranks
                ),
            ));
        }
        let grid = self.token_grid()?;
        let tokens = self.tokens()?;
        if tokens > MAX_TOKENS {
            return Err(SpecError::invalid(
                "workload.height",
                format!(
                    "{}×{} gives {tokens} tokens per image (patch {}, vae_factor {}); allowed: \
                     1..={MAX_TOKENS} tokens per image",
                    w.height, w.width, m.patch, w.vae_factor
                ),
            ));
        }
        // The latents of the step's batch on one rank (f64 latents and noise in the engine).
        let per_rank = u128::from(w.microbatch) * u128::from(w.accumulation);
        let latents = per_rank
            * u128::from(w.latent_channels)
            * u128::from(grid.latent_h)
            * u128::from(grid.latent_w);
        if latents > MAX_TENSOR_ELEMS {
            return Err(SpecError::invalid(
                "workload.batch",
                format!(
                    "{per_rank} images per rank of {}×{}×{} latents are {latents} elements; \
                     allowed: at most {MAX_TENSOR_ELEMS} (lower the batch or the resolution)",
                    w.latent_channels, grid.latent_h, grid.latent_w
                ),
            ));
        }
        // Byte counts are u64: keep the largest tensor of the step (the attention probabilities,
        // microbatch · heads · tokens²) far from overflow.
        let attn = u128::from(w.microbatch)
            * u128::from(m.heads)
            * u128::from(tokens)
            * u128::from(tokens);
        let act = u128::from(w.microbatch)
            * u128::from(tokens)
            * u128::from(m.hidden)
            * u128::from(m.mlp_ratio);
        if attn.max(act) > MAX_TENSOR_ELEMS {
            return Err(SpecError::invalid(
                "workload.height",
                format!(
                    "{}×{} gives {tokens} tokens per image, a b·heads·tokens² tensor of {attn} elements; \
                     allowed: at most {MAX_TENSOR_ELEMS} elements per tensor (lower the resolution or the microbatch)",
                    w.height, w.width
                ),
            ));
        }

        Ok(())
    }

    fn validate_recipe(&self) -> Result<(), SpecError> {
        let m = &self.model;
        let w = &self.workload;
        let r = &self.recipe;
        if r.paged_optimizer {
            let cuda = matches!(
                self.runtime,
                Runtime::Pytorch {
                    device: TorchDevice::Cuda,
                    ..
                }
            );
            if r.optimizer != Optimizer::AdamW8bit || !cuda || r.zero_stage > 0 {
                return Err(SpecError::invalid(
                    "recipe.paged_optimizer",
                    format!(
                        "is on with {} on {}{}; allowed: adamw-8bit on pytorch:cuda without ZeRO \
                         (bitsandbytes' PagedAdamW8bit pages CUDA managed memory)",
                        r.optimizer.name(),
                        self.runtime,
                        if r.zero_stage > 0 { " under ZeRO" } else { "" }
                    ),
                ));
            }
        }
        // A diffusers model not yet resolved has no depth or hidden size to check against.
        let sized = m.diffusers.is_none() || (m.depth > 0 && m.hidden > 0);
        if let Recompute::Blocks(blocks) = &r.recompute {
            // Parsed lists are sorted and deduplicated; the replays look blocks up by bisection.
            if blocks.is_empty() || !blocks.windows(2).all(|p| p[0] < p[1]) {
                return Err(SpecError::invalid(
                    "recipe.recompute",
                    "lists no block, or blocks out of order or twice; allowed: blocks:I,J,… \
                     (increasing, each once)",
                ));
            }
            if let Some(bad) = blocks.iter().find(|&&b| sized && b >= m.depth) {
                return Err(SpecError::invalid(
                    "recipe.recompute",
                    format!(
                        "block {bad} does not exist; allowed: block indices 0..={}",
                        m.depth - 1
                    ),
                ));
            }
        }
        if let Some(lora) = &r.lora {
            if lora.rank == 0 || (sized && lora.rank > m.hidden) {
                return Err(SpecError::invalid(
                    "recipe.lora.rank",
                    format!(
                        "{} is out of range; allowed: 1..={} (the hidden size)",
                        lora.rank, m.hidden
                    ),
                ));
            }
            if lora.targets.is_empty() {
                return Err(SpecError::invalid(
                    "recipe.lora.targets",
                    "is empty; allowed: one or more of qkv, proj, fc1, fc2, adaln",
                ));
            }
        }
        r.validate_lora_dtype(self.runtime, w.ranks)?;
        if !r.base_quant.is_none() && r.lora.is_none() {
            return Err(SpecError::invalid(
                "recipe.base_quant",
                format!(
                    "{} without LoRA: only a frozen base can be stored quantized; allowed: none, or a LoRA rank",
                    r.base_quant.name()
                ),
            ));
        }
        if r.zero_stage > 3 {
            return Err(SpecError::invalid(
                "recipe.zero_stage",
                format!("{} is not a ZeRO stage; allowed: 0, 1, 2, 3", r.zero_stage),
            ));
        }
        if r.zero_stage > 0 && w.ranks == 1 {
            return Err(SpecError::invalid(
                "recipe.zero_stage",
                format!(
                    "{} with one rank: ZeRO shards across ranks, with one it only adds overhead; \
                     allowed: 0 with one rank, 1–3 with workload.ranks > 1",
                    r.zero_stage
                ),
            ));
        }
        crate::sharder::validate(
            r.zero_stage,
            r.sharder,
            r.offload,
            r.gradient_as_bucket_view,
        )?;
        if r.ema.enabled && !(r.ema.decay > 0.0 && r.ema.decay < 1.0) {
            return Err(SpecError::invalid(
                "recipe.ema.decay",
                format!("{} is out of range; allowed: 0 < decay < 1", r.ema.decay),
            ));
        }
        if matches!(r.ema.dtype, Dtype::U8) {
            return Err(SpecError::invalid(
                "recipe.ema.dtype",
                "u8 cannot hold weights; allowed: f64, f32, bf16, f16",
            ));
        }
        if self.cuda.is_some()
            && !matches!(
                self.runtime,
                Runtime::Pytorch {
                    device: TorchDevice::Cuda,
                    ..
                }
            )
        {
            return Err(SpecError::invalid(
                "cuda",
                format!(
                    "describes a CUDA device, but the runtime is {}; allowed: a cuda section only with runtime = \"pytorch:cuda\"",
                    self.runtime
                ),
            ));
        }
        if let Some(cpu) = &self.cpu {
            // pytorch:cpu reads its `threads` (torch's intra-op threads: per-thread scratch).
            let torch_cpu = matches!(
                self.runtime,
                Runtime::Pytorch {
                    device: TorchDevice::Cpu,
                    ..
                }
            );
            if self.runtime != Runtime::DitmemCpu && !torch_cpu {
                return Err(SpecError::invalid(
                    "cpu",
                    format!(
                        "describes the CPU of the ditmem-cpu engine or of pytorch:cpu, but the runtime is {}; allowed: a cpu section only with runtime = \"ditmem-cpu\" or \"pytorch:cpu\"",
                        self.runtime
                    ),
                ));
            }
            cpu.validate()?;
        }
        Ok(())
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

/// The largest tensor a spec may ask for (2⁵⁰ elements, 8 PiB in f64): byte counts stay u64.
pub const MAX_TENSOR_ELEMS: u128 = 1 << 50;

/// Largest `model.depth` (DiT-XL has 28 blocks; the largest published DiTs fewer than 100).
pub const MAX_DEPTH: u32 = 1024;
/// Largest `model.hidden` and `model.heads` (real DiTs: hidden ≤ 8192).
pub const MAX_HIDDEN: u32 = 65_536;
/// Largest `model.patch`.
pub const MAX_PATCH: u32 = 256;
/// Largest `model.in_channels` and `workload.latent_channels` (VAEs: 4 to 64).
pub const MAX_CHANNELS: u32 = 1024;
/// Largest `model.mlp_ratio` (DiT: 4).
pub const MAX_MLP_RATIO: u32 = 64;
/// Largest `model.num_classes` (ImageNet: 1000).
pub const MAX_NUM_CLASSES: u32 = 1 << 24;
/// Largest `model.freq_embed` (DiT: 256).
pub const MAX_FREQ_EMBED: u32 = 65_536;
/// Largest `workload.height` and `workload.width` in pixels.
pub const MAX_SIDE: u32 = 65_536;
/// Largest `workload.vae_factor` (SD VAE: 8).
pub const MAX_VAE_FACTOR: u32 = 64;
/// Most image tokens per sample (real DiTs: ≤ 65,536 per frame).
pub const MAX_TOKENS: u64 = 1 << 20;
/// Largest `workload.microbatch` (images per forward on one rank).
pub const MAX_MICROBATCH: u32 = 65_536;
/// Largest `workload.accumulation`.
pub const MAX_ACCUMULATION: u32 = 1 << 20;
/// Most video frames per sample (Wan 2.1: 81).
pub const MAX_FRAMES: u32 = 4096;
/// Most text encoders of one model (SD3: 3, counted as CLIP and T5 sequences).
pub const MAX_TEXT_ENCODERS: usize = 4;
/// Most text tokens per encoder (T5 in Flux: 512).
pub const MAX_TEXT_TOKENS: u32 = 65_536;
/// Largest `workload.ranks` (GPU clusters: ≤ 100k devices).
pub const MAX_RANKS: u32 = 1 << 20;

/// The caps of [`Spec::validate`] as (field, largest allowed value), for help texts and tests.
pub const LIMITS: [(&str, u64); 16] = [
    ("model.depth", MAX_DEPTH as u64),
    ("model.hidden", MAX_HIDDEN as u64),
    ("model.heads", MAX_HIDDEN as u64),
    ("model.patch", MAX_PATCH as u64),
    ("model.in_channels", MAX_CHANNELS as u64),
    ("model.mlp_ratio", MAX_MLP_RATIO as u64),
    ("model.num_classes", MAX_NUM_CLASSES as u64),
    ("model.freq_embed", MAX_FREQ_EMBED as u64),
    ("workload.height", MAX_SIDE as u64),
    ("workload.width", MAX_SIDE as u64),
    ("workload.vae_factor", MAX_VAE_FACTOR as u64),
    ("workload.latent_channels", MAX_CHANNELS as u64),
    ("workload.microbatch", MAX_MICROBATCH as u64),
    ("workload.accumulation", MAX_ACCUMULATION as u64),
    ("workload.ranks", MAX_RANKS as u64),
    ("tokens per image", MAX_TOKENS),
];

fn in_range(field: &'static str, v: u32, max: u32) -> Result<(), SpecError> {
    if v == 0 || v > max {
        Err(SpecError::invalid(
            field,
            format!("{v} is out of range; allowed: 1..={max}"),
        ))
    } else {
        Ok(())
    }
}

fn positive(field: &'static str, v: u32) -> Result<(), SpecError> {
    if v == 0 {
        Err(SpecError::invalid(
            field,
            "is 0; allowed: a positive integer",
        ))
    } else {
        Ok(())
    }
}

fn probability(field: &'static str, p: f64) -> Result<(), SpecError> {
    if (0.0..1.0).contains(&p) {
        Ok(())
    } else {
        Err(SpecError::invalid(
            field,
            format!("{p} is out of range; allowed: 0 ≤ p < 1"),
        ))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_that_would_overflow_byte_counts_are_refused() {
        let mut s = Spec::default_xl();
        s.workload.height = 1 << 20;
        s.workload.width = 1 << 20;
        assert_eq!(s.validate().unwrap_err().field(), Some("workload.height"));
        let mut s = Spec::default_xl();
        s.model.hidden = 1 << 24;
        s.model.heads = 1;
        assert_eq!(s.validate().unwrap_err().field(), Some("model.hidden"));
        assert!(Spec::default_xl().validate().is_ok());
        assert!(Spec::small().validate().is_ok());
    }

    #[test]
    fn recompute_strings_round_trip() {
        for text in ["none", "all", "attention-only", "every-3", "blocks:0,2,5"] {
            let r: Recompute = text.parse().unwrap();
            assert_eq!(r.to_string(), text);
        }
        assert!("every-0".parse::<Recompute>().is_err());
        assert!("blocks:a".parse::<Recompute>().is_err());
        // Runs of blocks read as their members; backwards or huge runs are refused.
        assert_eq!(
            "blocks:0-3,5,7-8".parse::<Recompute>().unwrap(),
            Recompute::Blocks(vec![0, 1, 2, 3, 5, 7, 8])
        );
        assert!("blocks:3-1".parse::<Recompute>().is_err());
        assert!("blocks:0-4294967295".parse::<Recompute>().is_err());
        assert!("blocks:0-x".parse::<Recompute>().is_err());
        assert!("blocks:".parse::<Recompute>().is_err());
        assert!("blocks:,".parse::<Recompute>().is_err());
    }

    #[test]
    fn runtime_backends_with_or_without_the_sdpa_prefix() {
        for (text, long) in [
            ("pytorch:cuda:efficient", "pytorch:cuda:sdpa-efficient"),
            ("pytorch:cuda:math", "pytorch:cuda:sdpa-math"),
            ("pytorch:cuda:flash", "pytorch:cuda:sdpa-flash"),
        ] {
            assert_eq!(
                text.parse::<Runtime>().unwrap(),
                long.parse::<Runtime>().unwrap()
            );
        }
        assert!("pytorch:cuda:fast".parse::<Runtime>().is_err());
    }

    #[test]
    fn zero_needs_more_than_one_rank() {
        let mut s = Spec::default_xl();
        s.recipe.zero_stage = 2;
        assert_eq!(s.validate().unwrap_err().field(), Some("recipe.zero_stage"));
        s.workload.ranks = 4;
        s.workload.microbatch = 8;
        assert!(s.validate().is_ok());
    }

    #[test]
    fn sizes_above_the_caps_are_refused_with_field_and_range() {
        type Set = fn(&mut Spec, u32);
        let cases: [(&str, u32, Set); 6] = [
            ("model.depth", MAX_DEPTH, |s, v| s.model.depth = v),
            ("model.mlp_ratio", MAX_MLP_RATIO, |s, v| {
                s.model.mlp_ratio = v
            }),
            ("model.freq_embed", MAX_FREQ_EMBED, |s, v| {
                s.model.freq_embed = v
            }),
            ("model.num_classes", MAX_NUM_CLASSES, |s, v| {
                s.model.num_classes = v
            }),
            ("workload.ranks", MAX_RANKS, |s, v| {
                s.workload.ranks = v;
                s.workload.batch = s.workload.microbatch.saturating_mul(v);
            }),
            ("workload.accumulation", MAX_ACCUMULATION, |s, v| {
                s.workload.microbatch = 1;
                s.workload.accumulation = v;
                s.workload.batch = v;
            }),
        ];
        for (field, max, set) in cases {
            let mut s = Spec::small();
            set(&mut s, max);
            assert!(s.validate().is_ok(), "{field} = {max} is allowed");
            for bad in [max + 1, u32::MAX] {
                let mut s = Spec::small();
                set(&mut s, bad);
                let e = s.validate().unwrap_err();
                assert_eq!(e.field(), Some(field), "{field} = {bad}: {e}");
                assert!(e.to_string().contains(&format!("1..={max}")), "{e}");
            }
        }
        // 16,777,216 blocks (issue 19) and tokens past the cap.
        let mut s = Spec::default_xl();
        s.model.depth = 16_777_216;
        assert_eq!(s.validate().unwrap_err().field(), Some("model.depth"));
        let mut s = Spec::small();
        s.workload.height = 16400;
        s.workload.width = 16400;
        s.workload.microbatch = 1;
        s.workload.batch = 1;
        let e = s.validate().unwrap_err();
        assert!(e.to_string().contains("tokens per image"), "{e}");
        let mut s = Spec::small();
        s.recipe.recompute = Recompute::Blocks(vec![1, 0]);
        assert_eq!(s.validate().unwrap_err().field(), Some("recipe.recompute"));
    }
}
