//! The unit roundoff of a dtype, the scale of every tolerance here. A leaf file: the tolerance
//! model ([`super`]) and the kink bound (`kink.rs`) both read it, and it reads neither
//! (`crates/cli/tests/no_import_cycles.rs`).

use ditmem_budget::Dtype;

/// Unit roundoff u = 2^−t of a float dtype with t significand bits (the implicit bit counted):
/// f64 2⁻⁵³, f32 2⁻²⁴, bf16 2⁻⁸, f16 2⁻¹¹. `u8` is not a float: 1.
pub fn unit_roundoff(d: Dtype) -> f64 {
    match d {
        Dtype::F64 => 2f64.powi(-53),
        Dtype::F32 => 2f64.powi(-24),
        Dtype::Bf16 => 2f64.powi(-8),
        Dtype::F16 => 2f64.powi(-11),
        Dtype::U8 => 1.0,
    }
}
