//! Deterministic inputs and bit-level comparison for the fused ops' tests (fused or composed,
//! the same values must give the same bits).

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::ops::{GradSink, MlpLinear};

/// `n` deterministic values in about [−1, 1), a different sequence per `seed`.
pub(crate) fn vals(n: usize, seed: usize) -> Vec<f64> {
    (0..n)
        .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f64 / 1001.5) - 1.0)
        .collect()
}

/// A CPU tensor of `shape` (holding `n` elements) filled by [`vals`], cast to `dt`.
pub(crate) fn t(n: usize, shape: &[usize], seed: usize, dt: DType) -> Tensor {
    Tensor::from_vec(vals(n, seed), shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dt))
        .unwrap()
}

/// The elements of `t`, widened to f64, as bit patterns (exact comparison, NaN included).
pub(crate) fn bits(t: &Tensor) -> Vec<u64> {
    let v: Vec<f64> = t
        .flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1())
        .unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

/// The (compute, weight) dtypes the fused ops are held to their compositions on: f64, f32,
/// bf16 and f16, the weights in the compute dtype or f32 masters.
pub(crate) const DTYPE_PAIRS: [(DType, DType); 5] = [
    (DType::F64, DType::F64),
    (DType::F32, DType::F32),
    (DType::BF16, DType::BF16),
    (DType::BF16, DType::F32),
    (DType::F16, DType::F32),
];

/// A fused op's linear (w, b) whose gradients go to the sink `s`.
pub(crate) fn sunk_linear(w: &Tensor, b: &Tensor, s: &Arc<GradSink>) -> MlpLinear {
    MlpLinear {
        w: w.clone(),
        b: b.clone(),
        sink: Some(Arc::clone(s)),
    }
}

/// The weight and the bias gradient each sink holds, sink by sink.
pub(crate) fn take_sunk(sinks: &[&Arc<GradSink>]) -> Vec<Tensor> {
    sinks
        .iter()
        .flat_map(|s| [s.take_w(), s.take_b()])
        .map(|g| g.expect("the sink holds every weight gradient"))
        .collect()
}

/// Two lists of gradients are equal, shape and bits (`at` names the case).
pub(crate) fn assert_grads_bits(a: &[Tensor], b: &[Tensor], at: &str) {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.dims(), y.dims());
        assert_eq!(bits(x), bits(y), "grad {i} {at}");
    }
}

/// max |a − b| over the elements of two f64 tensors of one shape.
pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}
