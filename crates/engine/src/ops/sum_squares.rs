//! [`sum_squares`]: Σ x² of a tensor in f64 (the gradient norm of the trainer's clipping)
//! without a squared copy: one f64 per chunk is all it allocates (the budget's step model in
//! the budget's ditmem-cpu step replay (`runtime/ditmem_cpu/step.rs`) counts those partial sums).

use candle_core::{backend::BackendStorage, DType, Tensor};
use rayon::prelude::*;

use super::storage::{cpu_slice, err, with_cpu, CResult};

/// Elements per partial sum of [`sum_squares`].
pub const SQUARES_CHUNK: usize = 1 << 16;

/// Σ x² of a tensor in f64, without a squared copy: partial sums of [`SQUARES_CHUNK`] elements
/// in parallel (one f64 each, the only allocation), added in order, so the result does not
/// depend on the thread count or scheduling.
pub fn sum_squares(t: &Tensor) -> CResult<f64> {
    fn partials<T: Copy + Sync>(x: &[T], f: impl Fn(T) -> f64 + Sync) -> f64 {
        let mut parts: Vec<f64> = Vec::with_capacity(x.len().div_ceil(SQUARES_CHUNK));
        x.par_chunks(SQUARES_CHUNK)
            .map(|c| c.iter().map(|&v| f(v) * f(v)).sum::<f64>())
            .collect_into_vec(&mut parts);
        parts.iter().sum()
    }
    let t = t.contiguous()?;
    with_cpu(&t, |st, l| {
        let n = "sum of squares";
        Ok(match st.dtype() {
            DType::F32 => partials(cpu_slice::<f32>(st, l, n)?, f64::from),
            DType::F64 => partials(cpu_slice::<f64>(st, l, n)?, |v| v),
            DType::BF16 => partials(cpu_slice::<half::bf16>(st, l, n)?, |v| v.to_f64()),
            DType::F16 => partials(cpu_slice::<half::f16>(st, l, n)?, |v| v.to_f64()),
            other => return Err(err(format!("{n}: unsupported dtype {other:?}"))),
        })
    })
}
