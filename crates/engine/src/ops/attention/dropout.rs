//! Dropout of the attention probabilities (and of the MLP's activations): the [`Dropout`]
//! setting, the composed mask tensor ([`dropout_mask`]) and the same mask read element by
//! element by the fused kernels (`mask_at`), both drawn from one seeded stream.

use candle_core::{DType, Tensor};

use crate::kernels::scalar::Acc;
use crate::rng::SplitMix64;

/// Dropout of the attention probabilities: probability and the seed of the mask stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    pub p: f64,
    pub seed: u64,
}

/// A dropout mask with values 0 or 1/(1−p), drawn from `seed`, in `dtype`.
pub(crate) fn dropout_mask(
    dims: &[usize],
    d: Dropout,
    dtype: DType,
    dev: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    let n: usize = dims.iter().product();
    let keep = (1.0 / (1.0 - d.p)) as f32;
    let mut rng = SplitMix64::new(d.seed);
    let v: Vec<f32> = (0..n)
        .map(|_| if rng.uniform() < d.p { 0.0 } else { keep })
        .collect();
    Tensor::from_vec(v, dims, dev)?.to_dtype(dtype)
}

/// Keep factor of the dropout mask at flat index `i` of (b, a, s, s): 0 or 1/(1−p), drawn like
/// [`dropout_mask`] (f32 factor) so all modes see the same mask.
#[inline]
pub(crate) fn mask_at<A: Acc>(d: Dropout, i: usize) -> A {
    let mut r = crate::rng::SplitMix64::skip(d.seed, i as u64);
    if r.uniform() < d.p {
        A::ZERO
    } else {
        <A as Acc>::from_f64(f64::from((1.0 / (1.0 - d.p)) as f32))
    }
}
