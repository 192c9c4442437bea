//! LoRA in the recipe: the adapted linears ([`LoraTarget`]), rank and scale ([`LoraSpec`]), the
//! adapters' dtype ([`LoraDtype`]) and the rules tying them to the precision.

use serde::{Deserialize, Serialize};

use crate::named::from_name;

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

    pub(crate) fn is_fp32(&self) -> bool {
        *self == LoraDtype::Fp32
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

from_name! {
    LoraDtype => "recipe.lora.dtype", "an adapter dtype", LoraDtype::ALL;
}
