//! The recipe's sharding vocabulary: who shards a step with ZeRO stage ≥ 1 ([`Sharder`]) and
//! what it keeps in host memory ([`Offload`]). The rules over them (what each rank keeps, the
//! buckets, the traffic) are in `ditmem-budget`'s `sharding.rs`; these names are a file of their own so that
//! the spec (`spec.rs`) reads them without standing on those rules, which read the spec
//! (`crates/cli/tests/no_import_cycles.rs`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::SpecError;
use crate::named::parse_spelling;

/// Who shards a step with ZeRO stage ≥ 1.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Sharder {
    /// DeepSpeed ZeRO at the recipe's stage.
    #[default]
    Deepspeed,
    /// FSDP2 (`fully_shard`): stage 3 ↔ `reshard_after_forward=True`, stage 2 ↔ `False`; no
    /// stage-1 equivalent.
    #[serde(alias = "fsdp2")]
    Fsdp,
}

impl Sharder {
    pub const fn name(self) -> &'static str {
        match self {
            Sharder::Deepspeed => "deepspeed",
            Sharder::Fsdp => "fsdp",
        }
    }

    pub fn is_default(&self) -> bool {
        *self == Sharder::Deepspeed
    }

    /// Parse a sharder, naming `field` in the error.
    pub fn parse(s: &str, field: &str) -> Result<Sharder, SpecError> {
        let words = [
            ("deepspeed", Sharder::Deepspeed),
            ("zero", Sharder::Deepspeed),
            ("fsdp", Sharder::Fsdp),
            ("fsdp2", Sharder::Fsdp),
        ];
        parse_spelling(s, &words, field, "a sharder", "deepspeed, fsdp")
    }
}

impl fmt::Display for Sharder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Sharder {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        Sharder::parse(s, "recipe.sharder")
    }
}

/// What a sharded step keeps in host memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Offload {
    #[default]
    #[serde(rename = "none")]
    None,
    /// Optimizer state, fp32 master partition and its gradient (ZeRO-Offload): DeepSpeed
    /// `offload_optimizer`.
    #[serde(rename = "optimizer")]
    Optimizer,
    /// Also the parameters: DeepSpeed `offload_param` (stage 3 only), FSDP `CPUOffloadPolicy`.
    #[serde(rename = "optimizer+params")]
    OptimizerAndParams,
}

impl Offload {
    pub const fn name(self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::Optimizer => "optimizer",
            Offload::OptimizerAndParams => "optimizer+params",
        }
    }

    pub fn is_none(&self) -> bool {
        *self == Offload::None
    }

    /// Parse an offload, naming `field` in the error.
    pub fn parse(s: &str, field: &str) -> Result<Offload, SpecError> {
        let words = [
            ("none", Offload::None),
            ("optimizer", Offload::Optimizer),
            ("optimizer+params", Offload::OptimizerAndParams),
            ("params", Offload::OptimizerAndParams),
            ("all", Offload::OptimizerAndParams),
        ];
        let allowed = "none, optimizer, optimizer+params";
        parse_spelling(s, &words, field, "an offload", allowed)
    }
}

impl fmt::Display for Offload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Offload {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        Offload::parse(s, "recipe.offload")
    }
}

/// A ZeRO stage, sharder and offload that no launcher runs together: the rule both the recipe's
/// validation ([`validate`]) and the export's options (`ditmem_budget::export`) hold, each
/// naming its own fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conflict {
    /// Offload without sharding (stage 0).
    OffloadUnsharded,
    /// DeepSpeed offloads parameters below stage 3 (deepspeed 0.19.8 runtime/zero/config.py:
    /// offload_param is "valid only with stage 3").
    DeepspeedParamsBelowStage3,
    /// FSDP at stage 1: it always shards gradients.
    FsdpStage1,
    /// FSDP offloading the optimizer alone (accelerate 1.15 utils/dataclasses.py
    /// FullyShardedDataParallelPlugin.cpu_offload: FSDP offloads parameters, gradients and
    /// optimizer state together).
    FsdpOptimizerOnly,
}

impl Conflict {
    /// The first rule `zero_stage`, `sharder` and `offload` break, if any.
    pub fn of(zero_stage: u8, sharder: Sharder, offload: Offload) -> Option<Conflict> {
        match sharder {
            _ if offload != Offload::None && zero_stage == 0 => Some(Conflict::OffloadUnsharded),
            Sharder::Deepspeed if offload == Offload::OptimizerAndParams && zero_stage < 3 => {
                Some(Conflict::DeepspeedParamsBelowStage3)
            }
            Sharder::Fsdp if zero_stage == 1 => Some(Conflict::FsdpStage1),
            Sharder::Fsdp if offload == Offload::Optimizer => Some(Conflict::FsdpOptimizerOnly),
            _ => None,
        }
    }
}

/// Validate the sharding fields of a recipe (`recipe.zero_stage`, `recipe.sharder`,
/// `recipe.offload`, `recipe.gradient_as_bucket_view`) against each other.
pub fn validate(
    zero_stage: u8,
    sharder: Sharder,
    offload: Offload,
    gradient_as_bucket_view: bool,
) -> Result<(), SpecError> {
    let z = zero_stage;
    if let Some(c) = Conflict::of(z, sharder, offload) {
        let (field, message) = match c {
            Conflict::OffloadUnsharded => (
                "recipe.offload",
                format!(
                    "{} needs a sharded plan (recipe.zero_stage 1-3 over workload.ranks > 1); \
                     allowed: none with zero_stage 0",
                    offload
                ),
            ),
            Conflict::DeepspeedParamsBelowStage3 => (
                "recipe.offload",
                format!(
                    "DeepSpeed offloads parameters only at ZeRO stage 3 (recipe.zero_stage is \
                     {z}); allowed: none, optimizer"
                ),
            ),
            Conflict::FsdpStage1 => (
                "recipe.sharder",
                "fsdp has no ZeRO-1 equivalent (it always shards gradients); allowed: \
                 deepspeed at zero_stage 1, fsdp at zero_stage 2 or 3"
                    .into(),
            ),
            Conflict::FsdpOptimizerOnly => (
                "recipe.offload",
                "FSDP offloads parameters, gradients and optimizer state together; allowed \
                 with sharder fsdp: none, optimizer+params"
                    .into(),
            ),
        };
        return Err(SpecError::invalid(field, message));
    }
    if gradient_as_bucket_view && z > 0 {
        return Err(SpecError::invalid(
            "recipe.gradient_as_bucket_view",
            format!(
                "is DDP's option (zero_stage 0); recipe.zero_stage is {z}; allowed: false with \
                 ZeRO or FSDP"
            ),
        ));
    }
    Ok(())
}
