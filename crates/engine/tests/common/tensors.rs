//! Tensor helpers shared by the engine's and the conformance crate's tests (the conformance
//! tests include this file by path): seeded random tensors, gradients through a graph, and
//! max |a − b| in f64.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use ditmem_engine::rng::SplitMix64;

/// A tensor of `dims` with normal entries (seeded SplitMix64) times `scale`, in f64.
pub(crate) fn rand(dims: &[usize], seed: u64, scale: f64) -> Tensor {
    let mut r = SplitMix64::new(seed);
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n).map(|_| r.normal() * scale).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// Gradients of `sum(y · go)`: backpropagates `go` through y's graph the composed way (the
/// reference the engine's `ops::backward_from` is held to).
pub(crate) fn grads_through(y: &Tensor, go: &Tensor) -> candle_core::backprop::GradStore {
    y.mul(go).unwrap().sum_all().unwrap().backward().unwrap()
}

/// max |a − b| over two tensors of one shape, in f64.
pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// A tensor's entries in f64, flattened.
pub(crate) fn flat_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}
