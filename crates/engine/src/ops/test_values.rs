//! Deterministic inputs and bit-level comparison for the fused ops' tests (fused or composed,
//! the same values must give the same bits).

use std::sync::Arc;

use candle_core::{backprop::GradStore, DType, Device, Tensor, Var};

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

/// A sink that takes both of a linear's gradients.
pub(crate) fn new_sink() -> Arc<GradSink> {
    Arc::new(GradSink::new(true, true))
}

/// A fused op's linear (out, inp) of [`t`] values in `dt`, W from `seed` and b from `seed + 1`,
/// its gradients to `sink` (none: a frozen linear, or one the op refuses when W tracks).
pub(crate) fn seeded_linear(
    (out, inp): (usize, usize),
    seed: usize,
    dt: DType,
    sink: Option<Arc<GradSink>>,
) -> MlpLinear {
    MlpLinear {
        w: t(out * inp, &[out, inp], seed, dt),
        b: t(out, &[out], seed + 1, dt),
        sink,
    }
}

/// `l` with its weight made a variable (tracked), values unchanged.
pub(crate) fn tracking(l: MlpLinear) -> MlpLinear {
    MlpLinear {
        w: Var::from_tensor(&l.w).unwrap().as_tensor().clone(),
        ..l
    }
}

/// The gradients of Σ y∘r: r stands for y's output gradient.
pub(crate) fn grads_against(y: &Tensor, r: &Tensor) -> GradStore {
    y.mul(r).unwrap().sum_all().unwrap().backward().unwrap()
}

/// Two backward passes through Σ y² give each of `vars` the same gradient, bit for bit (a
/// second backward on the same graph recomputes what the first freed); returns the first
/// pass's gradients of `vars`.
pub(crate) fn assert_backward_twice_agrees(y: &Tensor, vars: &[&Tensor]) -> Vec<Tensor> {
    let loss = y.sqr().unwrap().sum_all().unwrap();
    let (a, b) = (loss.backward().unwrap(), loss.backward().unwrap());
    vars.iter()
        .map(|v| {
            let (ga, gb) = (a.get(v).unwrap(), b.get(v).unwrap());
            assert_eq!(bits(ga), bits(gb));
            ga.clone()
        })
        .collect()
}

/// Whether some element of `t` is not zero (a bit-for-bit comparison of it means something).
pub(crate) fn nonzero(t: &Tensor) -> bool {
    bits(t).iter().any(|&b| f64::from_bits(b) != 0.0)
}

/// The weight and the bias gradient each sink holds, sink by sink.
pub(crate) fn take_sunk(sinks: &[&Arc<GradSink>]) -> Vec<Tensor> {
    sinks
        .iter()
        .flat_map(|s| [s.take_w(), s.take_b()])
        .map(|g| g.expect("the sink holds every weight gradient"))
        .collect()
}

/// A fused op is its composition, bit for bit: for every (compute, weight) dtype pair of
/// [`DTYPE_PAIRS`] and every case, `run(fused, dtypes, case)` gives the same tensors, shape and
/// bits, fused and composed (`names` label them, in order; a run may give fewer); those at
/// `nonzero_at` are not all zero in the fused run (the comparison means something).
pub(crate) fn assert_fused_is_composition<C: Copy + std::fmt::Debug>(
    names: &[&str],
    nonzero_at: &[usize],
    cases: &[C],
    run: impl Fn(bool, (DType, DType), C) -> Vec<Tensor>,
) {
    for dts in DTYPE_PAIRS {
        for &case in cases {
            let (f, c) = (run(true, dts, case), run(false, dts, case));
            assert!(
                f.len() == c.len() && f.len() <= names.len(),
                "{dts:?} {case:?}"
            );
            for ((a, b), name) in f.iter().zip(&c).zip(names) {
                assert_eq!(a.dims(), b.dims(), "{name} {dts:?} {case:?}");
                assert_eq!(bits(a), bits(b), "{name} {dts:?} {case:?}");
            }
            for &i in nonzero_at {
                assert!(nonzero(&f[i]), "{} all zero {dts:?} {case:?}", names[i]);
            }
        }
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
