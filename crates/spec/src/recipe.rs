//! How the step is computed ([`Recipe`]): optimizer, attention, recompute, latents and text
//! encoders, EMA, prediction, the frozen base's storage, the optimizer's implementation; the
//! precision is in [`crate::precision`], LoRA in [`crate::lora`], sharding in [`crate::sharder`].

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::SpecError;
use crate::limits::MAX_DEPTH;
use crate::lora::{LoraDtype, LoraSpec};
use crate::model::default_true;
use crate::named::{from_name, text_form};
use crate::precision::{Dtype, Precision};
use crate::runtime::{Runtime, TorchDevice};
use crate::sharder::{Offload, Sharder};

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

text_form!(Recompute);

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

/// LoRA's rules on the recipe (its types are in [`crate::lora`]).
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
    pub(crate) fn validate_lora_dtype(
        &self,
        runtime: Runtime,
        ranks: u32,
    ) -> Result<(), SpecError> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}

from_name! {
    Optimizer => "recipe.optimizer", "an optimizer", [Optimizer::AdamW, Optimizer::AdamW8bit, Optimizer::Sgd];
    TextEncoders => "recipe.text_encoders", "a text-encoder placement", [TextEncoders::Cached, TextEncoders::Online, TextEncoders::Offloaded];
    BaseQuant => "recipe.base_quant", "a base storage", BaseQuant::ALL;
    OptimizerImpl => "recipe.optimizer_impl", "an optimizer implementation", OptimizerImpl::ALL;
}
