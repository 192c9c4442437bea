//! Wan 2.1 in the engine: the RMSNorm and RoPE ops against composed references (values and
//! gradients). What every family shares (the parameter table, the levers
//! on video latents, equal gradients across recompute and attention modes, the agreement grid)
//! is in `families.rs`; `verify` on each family is in `verify_families.rs`.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use ditmem_engine::ops::rms_norm_rows::rms_norm_rows_reference as rms_norm_reference;
use ditmem_engine::ops::rope_cos_sin::rope_cos_sin_reference as rope_reference;
use ditmem_engine::ops::{rms_norm_rows as rms_norm, rope_cos_sin as rope};
use ditmem_engine::CountingAlloc;

mod common;
use common::one_at_a_time;
use common::{grads_through, max_abs_diff, rand};

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

fn randn(shape: &[usize], seed: u64) -> Tensor {
    rand(shape, seed, 1.0)
}

/// The gradients of `sum(y · r)` and of `sum(yr · r)`: an op's and its reference's.
fn grads_of_both(y: &Tensor, yr: &Tensor, r: &Tensor) -> (GradStore, GradStore) {
    (grads_through(y, r), grads_through(yr, r))
}

/// max |a − b| between two gradient stores' gradients of `t`.
fn grad_diff(g: &GradStore, gr: &GradStore, t: &Tensor) -> f64 {
    max_abs_diff(g.get(t).unwrap(), gr.get(t).unwrap())
}

/// RMSNorm with and without a weight: the fused op's value and gradients (x and the weight)
/// equal candle's composed f64 reference; in f32 the value is within rounding.
#[test]
fn rms_norm_matches_its_reference() {
    let _one = one_at_a_time();
    let (rows, d) = (6, 32);
    for with_w in [true, false] {
        let x = Var::from_tensor(&randn(&[2, rows / 2, d], 1)).unwrap();
        let w = Var::from_tensor(&randn(&[d], 2).affine(0.3, 1.0).unwrap()).unwrap();
        let r = randn(&[2, rows / 2, d], 3);
        let wr = with_w.then(|| w.as_tensor());
        let y = rms_norm(x.as_tensor(), wr, 1e-6, DType::F64).unwrap();
        let yr = rms_norm_reference(x.as_tensor(), wr, 1e-6).unwrap();
        assert!(max_abs_diff(&y, &yr) < 1e-12);
        let (g, gr) = grads_of_both(&y, &yr, &r);
        let dx = grad_diff(&g, &gr, x.as_tensor());
        assert!(dx < 1e-12, "dx differs by {dx}");
        if with_w {
            let dw = grad_diff(&g, &gr, w.as_tensor());
            assert!(dw < 1e-12, "dw differs by {dw}");
        } else {
            assert!(g.get(w.as_tensor()).is_none());
        }
        let x32 = x.as_tensor().to_dtype(DType::F32).unwrap();
        let w32 = w.as_tensor().to_dtype(DType::F32).unwrap();
        let y32 = rms_norm(&x32, with_w.then_some(&w32), 1e-6, DType::BF16).unwrap();
        assert_eq!(y32.dtype(), DType::BF16);
        assert!(
            max_abs_diff(
                &y32,
                &rms_norm_reference(&x32, with_w.then_some(&w32), 1e-6).unwrap()
            ) < 0.05
        );
    }
    // A weight of the wrong width is an error, not a panic.
    let x = randn(&[3, 8], 4);
    assert!(rms_norm(&x, Some(&randn(&[7], 5)), 1e-6, DType::F64).is_err());
}

/// RoPE on (b, s, D) rows and on (b, s, heads, d_h): the value and dx equal the composed f64
/// reference; the rotation keeps each pair's norm.
#[test]
fn rope_matches_its_reference() {
    let _one = one_at_a_time();
    let (b, s, heads, dh) = (2, 5, 3, 8);
    let ang = randn(&[s, dh / 2], 7);
    let cos = ang.cos().unwrap();
    let sin = ang.sin().unwrap();
    for shape in [vec![b, s, heads * dh], vec![b, s, heads, dh]] {
        let x = Var::from_tensor(&randn(&shape, 8)).unwrap();
        let r = randn(&shape, 9);
        let y = rope(x.as_tensor(), &cos, &sin).unwrap();
        let yr = rope_reference(x.as_tensor(), &cos, &sin).unwrap();
        assert!(max_abs_diff(&y, &yr) < 1e-12);
        let n0: f64 = x
            .as_tensor()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        let n1: f64 = y.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
        assert!((n0 - n1).abs() < 1e-9 * n0);
        let (g, gr) = grads_of_both(&y, &yr, &r);
        let dx = grad_diff(&g, &gr, x.as_tensor());
        assert!(dx < 1e-12, "dx differs by {dx}");
    }
    // Tables of the wrong dtype or a position count that does not divide the rows: errors.
    let x = randn(&[b, s, heads * dh], 10);
    assert!(rope(&x, &cos.to_dtype(DType::F32).unwrap(), &sin).is_err());
    assert!(rope(&randn(&[7, heads * dh], 11), &cos, &sin).is_err());
}
