//! The engine's dtype policy that both crates read: the one definition of the gradient buffers'
//! dtype (`ditmem-engine`'s `trainer::grad_dtype` converts this one to candle's). A leaf file:
//! the step replay ([`super::step`]) and each family's segments use it, and it uses nothing of
//! theirs (`crates/cli/tests/no_import_cycles.rs`).

use crate::spec::{Dtype, Precision};

/// Gradient buffers (and the loss) of the engine: fp64 under the fp64 policy, fp32 otherwise
/// (also under bf16-pure).
pub fn grad_dtype(p: Precision) -> Dtype {
    if p == Precision::Fp64 {
        Dtype::F64
    } else {
        Dtype::F32
    }
}

/// The accumulation type of the engine's own kernels (the linear attention, the depthwise conv,
/// RMSNorm's statistics, the RoPE tables): f64 under the fp64 policy, else f32 — the gradient
/// buffers' rule.
pub(crate) fn acc_dtype(p: Precision) -> Dtype {
    grad_dtype(p)
}

/// Bytes of [`acc_dtype`].
pub(crate) fn acc_bytes(p: Precision) -> u64 {
    acc_dtype(p).size()
}
