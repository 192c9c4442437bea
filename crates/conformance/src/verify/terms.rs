//! Tolerance terms of one trained tensor beyond the policy's rounding model ([`super::Tolerance`]),
//! each measured on the reference itself, never tuned:
//!
//! - **Underflow** ([`underflow`]): a gradient computed in a compute dtype with a narrow exponent
//!   (f16: smallest normal 2⁻¹⁴, subnormal spacing 2⁻²⁴) under a loss scale S is stored as
//!   S·g; where |S·g| falls below the smallest normal its rounding error is absolute (half the
//!   subnormal spacing), not relative, and the chain term (u_c per stage) does not hold it. The
//!   term is what storing the reference's own S·g in the dtype costs, counted on those values,
//!   and the same for the activation gradients it sums ([`underflow_with_upstream`]).
//! - **Cancellation** (`probe`'s amplification): a gradient formed as a difference of larger
//!   terms carries the rounding of the terms, not of the result: the tolerance of the tensors
//!   behind it is multiplied by ‖terms‖ / ‖result‖ measured in the f64 replay.

use ditmem_budget::Dtype;

/// Smallest positive normal number of a float dtype (`u8`: 1).
pub(crate) fn smallest_normal(d: Dtype) -> f64 {
    match d {
        Dtype::F64 => f64::MIN_POSITIVE,
        Dtype::F32 | Dtype::Bf16 => f32::MIN_POSITIVE as f64,
        Dtype::F16 => 2f64.powi(-14),
        Dtype::U8 => 1.0,
    }
}

/// `x` stored in `d` (round to nearest even, subnormals and flush to zero as the dtype has them).
fn stored(x: f64, d: Dtype) -> f64 {
    match d {
        Dtype::F16 => half::f16::from_f64(x).to_f64(),
        Dtype::Bf16 => half::bf16::from_f64(x).to_f64(),
        Dtype::F32 => x as f32 as f64,
        Dtype::F64 | Dtype::U8 => x,
    }
}

/// The storage part of the underflow term of a tensor with reference gradient `g` computed in
/// `d` at loss scale `scale`: ‖fl(S·gᵢ) − S·gᵢ‖ over the values with |S·gᵢ| below `d`'s
/// smallest normal, divided by ‖S·g‖ — the relative error the gradient's own storage in `d`
/// adds beyond u_c (0 when every value is normal).
pub(super) fn underflow(g: &[f64], scale: f64, d: Dtype) -> f64 {
    let tiny = smallest_normal(d);
    let (mut err, mut all) = (0.0f64, 0.0f64);
    for &x in g {
        let y = scale * x;
        all += y * y;
        if y.abs() < tiny {
            let e = stored(y, d) - y;
            err += e * e;
        }
    }
    if all > 0.0 {
        (err / all).sqrt()
    } else {
        0.0
    }
}

/// The underflow term of a tensor whose loss-scaled reference gradient is S·g, summed over
/// (at most) `rows` rows, computed in `d`: its own storage's [`underflow`], and its activation
/// gradients'. G = Σₜ dYₜᵀ·Xₜ over n rows: a random-sign sum of n terms grows by √n, so with
/// normalised inputs (rms(X) ≈ 1) the entries of dY have G's scale / √n, and where they are
/// subnormal each carries an absolute error that reaches G as Σₜ ΔdYₜ·Xₜ: √n × that error.
/// So the upstream term is the storage error of S·g/√n relative to S·g/√n — `underflow` at
/// scale S/√n. The two are independent: added in quadrature. `rows` bounds n from above (the
/// microbatch × every token the step's streams hold; × the heads for a per-head norm weight,
/// which sums over them too): a bound keeps the term a tolerance, not an estimate.
pub(crate) fn underflow_with_upstream(g: &[f64], scale: f64, rows: u64, d: Dtype) -> f64 {
    let own = underflow(g, scale, d);
    let upstream = underflow(g, scale / (rows.max(1) as f64).sqrt(), d);
    own.hypot(upstream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn underflow_counts_only_values_below_the_smallest_normal() {
        // Normal in f16 at scale 1: rounding is relative, not this term's.
        assert_eq!(underflow(&[0.3, -1.7, 2e-3], 1.0, Dtype::F16), 0.0);
        // f16's spacing below 2⁻¹⁴ is 2⁻²⁴: 1.5·2⁻²⁴ rounds (to even) to 2·2⁻²⁴, an error of
        // a third of the value.
        let x = 1.5 * 2f64.powi(-24);
        let e = underflow(&[x], 1.0, Dtype::F16);
        assert!((e - 1.0 / 3.0).abs() < 1e-12, "{e}");
        // The loss scale lifts it out of the subnormals; bf16's range never reaches it.
        assert_eq!(underflow(&[x], 65536.0, Dtype::F16), 0.0);
        assert_eq!(underflow(&[x], 1.0, Dtype::Bf16), 0.0);
        // Below half the smallest subnormal the value flushes to zero: all of it is lost.
        assert_eq!(underflow(&[2f64.powi(-26)], 1.0, Dtype::F16), 1.0);
    }
}
