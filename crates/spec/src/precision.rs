//! Element types ([`Dtype`]) and the numeric policy of a step ([`Precision`]): which dtype the
//! weights, the compute, the stream between ops and the optimizer state are kept in.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::named::from_name;

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

from_name! {
    Precision => "recipe.precision", "a precision", Precision::ALL;
}
