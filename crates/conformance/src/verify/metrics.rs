//! Norms and relative errors of gradient and weight vectors.

use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;

use super::error::Result;
use crate::error::EngineError;
use candle_core::DType;

pub(super) fn norm(v: &[f64]) -> f64 {
    norm_sq(v).sqrt()
}

/// ‖v‖², summed in order.
pub(super) fn norm_sq(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>()
}

pub(super) fn diff_norm(a: &[f64], b: &[f64]) -> f64 {
    diff_sq(a, b).sqrt()
}

/// ‖a − b‖², summed in order.
pub(super) fn diff_sq(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>()
}

/// ‖a − b‖ / ‖b‖; 0 when both are zero, ∞ when only `b` is; NaN propagates as ∞.
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    ratio(diff_norm(a, b), norm(b))
}

/// |a − b| / |b|, with [`ratio`]'s rules for zero and NaN.
pub(super) fn scalar_rel(a: f64, b: f64) -> f64 {
    ratio((a - b).abs(), b.abs())
}

/// d / n for a difference norm d and a reference norm n: 0 when both are zero, ∞ when only n
/// is; NaN propagates as ∞.
pub(super) fn ratio(d: f64, n: f64) -> f64 {
    let r = if n > 0.0 {
        d / n
    } else if d == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    if r.is_nan() {
        f64::INFINITY
    } else {
        r
    }
}

/// Bits of every value, for the bitwise twin check without keeping the values.
pub(super) fn hash_values(h: &mut DefaultHasher, v: &[f64]) {
    for x in v {
        h.write_u64(x.to_bits());
    }
}

pub(super) fn to_f64(t: &candle_core::Tensor) -> Result<Vec<f64>> {
    let v = t
        .to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .map_err(EngineError::from)?;
    Ok(v)
}
