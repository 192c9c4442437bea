//! Rules of the precision policy that several files read: the optimizer state bytes of one
//! trained tensor and the VAE's dtype. A leaf file (it reads only the spec's vocabulary), so
//! that the sharding rules (`sharding.rs`) and the frozen encoders (`encoders.rs`) read them
//! without standing on the timeline, which reads both of them
//! (`crates/cli/tests/no_import_cycles.rs`). [`crate::timeline`] re-exports them.

use crate::spec::{Dtype, Optimizer, Precision, Recipe};

/// Bitsandbytes block size for 8-bit optimizer state quantisation (one fp32 absmax per block).
pub(crate) const ADAM8BIT_BLOCK: u64 = 256;
/// Tensors smaller than this keep 32-bit state under bitsandbytes' 8-bit optimizers.
pub(crate) const ADAM8BIT_MIN_SIZE: u64 = 4096;

/// Optimizer state bytes of one trained tensor.
pub(crate) fn optimizer_state_bytes(elems: u64, optimizer: Optimizer, precision: Precision) -> u64 {
    let sd = precision.optimizer_dtype().size();
    match optimizer {
        Optimizer::Sgd => 0,
        Optimizer::AdamW => 2 * elems * sd,
        Optimizer::AdamW8bit if elems < ADAM8BIT_MIN_SIZE => 2 * elems * 4,
        Optimizer::AdamW8bit => 2 * (elems + elems.div_ceil(ADAM8BIT_BLOCK) * 4),
    }
}

/// Optimizer state bytes of one trained tensor under the recipe: [`optimizer_state_bytes`], or
/// for adapters kept in the weight dtype ([`Recipe::low_adapters`]) AdamW's two `zeros_like(p)`
/// in that dtype (`torch/optim/adamw.py` `_init_group`). bitsandbytes' 8-bit state does not
/// follow the parameter's dtype (its 32-bit state below 4096 elements is fp32).
pub(crate) fn trained_state_bytes(elems: u64, recipe: &Recipe) -> u64 {
    if recipe.low_adapters() && recipe.optimizer == Optimizer::AdamW {
        2 * elems * recipe.state_dtype().size()
    } else {
        optimizer_state_bytes(elems, recipe.optimizer, recipe.precision)
    }
}

/// DiT's `train.py` encodes in fp32 outside autocast; fp64 keeps fp64, bf16-pure casts the VAE.
pub(crate) fn vae_dtype(p: Precision) -> Dtype {
    match p {
        Precision::Fp64 => Dtype::F64,
        Precision::Bf16Pure => Dtype::Bf16,
        _ => Dtype::F32,
    }
}
