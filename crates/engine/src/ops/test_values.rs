//! Deterministic inputs and bit-level comparison for the fused ops' tests (fused or composed,
//! the same values must give the same bits).

use candle_core::{DType, Device, Tensor};

/// `n` deterministic values in about [−1, 1), a different sequence per `seed`.
pub fn vals(n: usize, seed: usize) -> Vec<f64> {
    (0..n)
        .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f64 / 1001.5) - 1.0)
        .collect()
}

/// A CPU tensor of `shape` (holding `n` elements) filled by [`vals`], cast to `dt`.
pub fn t(n: usize, shape: &[usize], seed: usize, dt: DType) -> Tensor {
    Tensor::from_vec(vals(n, seed), shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dt))
        .unwrap()
}

/// The elements of `t`, widened to f64, as bit patterns (exact comparison, NaN included).
pub fn bits(t: &Tensor) -> Vec<u64> {
    let v: Vec<f64> = t
        .flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1())
        .unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}
