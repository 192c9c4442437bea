//! Flux's fused ops against composed candle references in f64: the per-head RMSNorm (values
//! and gradients of x and w), RoPE (values against the rotation written out, gradients by the
//! adjoint identity), the per-sample concatenation and slice (against `cat` / `narrow`), and
//! their low-precision paths against f64.

use std::sync::Arc;

use candle_core::{DType, Tensor, Var, D};
use ditmem_engine::ops::tokens::{cat_tokens, concat, slice, split_tokens};
use ditmem_engine::ops::{joint_norm_rope, norm_rope, rms_norm, rope, RopeTable, RMS_EPS};

mod common;
use common::{grads_through, max_abs_diff as max_abs, rand};

fn dot(a: &Tensor, b: &Tensor) -> f64 {
    a.to_dtype(DType::F64)
        .unwrap()
        .mul(&b.to_dtype(DType::F64).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// torch.nn.RMSNorm per head, composed.
fn rms_reference(x: &Tensor, w: &Tensor, heads: usize) -> Tensor {
    let (rows, d) = x.dims2().unwrap();
    let xh = x.reshape((rows, heads, d / heads)).unwrap();
    let ms = xh.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    let r = ms.affine(1.0, RMS_EPS).unwrap().powf(-0.5).unwrap();
    xh.broadcast_mul(&r)
        .unwrap()
        .broadcast_mul(w)
        .unwrap()
        .reshape((rows, d))
        .unwrap()
}

#[test]
fn rms_norm_matches_composed_f64() {
    let (rows, heads, dh) = (13, 3, 8);
    let x = Var::from_tensor(&rand(&[rows, heads * dh], 1, 1.5)).unwrap();
    let w = Var::from_tensor(&rand(&[dh], 2, 0.3).affine(1.0, 1.0).unwrap()).unwrap();
    let go = rand(&[rows, heads * dh], 3, 1.0);
    let y = rms_norm(x.as_tensor(), w.as_tensor(), RMS_EPS).unwrap();
    let yr = rms_reference(x.as_tensor(), w.as_tensor(), heads);
    assert!(max_abs(&y, &yr) < 1e-12);
    let g = grads_through(&y, &go);
    let gr = grads_through(&yr, &go);
    for v in [&x, &w] {
        let (a, b) = (
            g.get(v.as_tensor()).unwrap(),
            gr.get(v.as_tensor()).unwrap(),
        );
        assert!(max_abs(a, b) < 1e-10, "{}", max_abs(a, b));
    }
    // Untracked weight: no gradient for it, dx unchanged.
    let y2 = rms_norm(x.as_tensor(), &w.as_tensor().detach(), RMS_EPS).unwrap();
    let g2 = grads_through(&y2, &go);
    assert!(
        max_abs(
            g2.get(x.as_tensor()).unwrap(),
            gr.get(x.as_tensor()).unwrap()
        ) < 1e-10
    );
}

#[test]
fn rms_norm_low_precision_reads_master_weights() {
    let (rows, heads, dh) = (9, 2, 16);
    let x = rand(&[rows, heads * dh], 4, 1.0);
    let w = rand(&[dh], 5, 0.2).affine(1.0, 1.0).unwrap();
    let exact = rms_norm(&x, &w, RMS_EPS).unwrap();
    for dt in [DType::BF16, DType::F16, DType::F32] {
        let y = rms_norm(
            &x.to_dtype(dt).unwrap(),
            &w.to_dtype(DType::F32).unwrap(),
            RMS_EPS,
        )
        .unwrap();
        assert_eq!(y.dtype(), dt);
        let tol = if dt == DType::F32 { 1e-5 } else { 3e-2 };
        assert!(max_abs(&y, &exact) < tol, "{dt:?}: {}", max_abs(&y, &exact));
    }
    assert!(rms_norm(&x, &rand(&[5], 1, 1.0), RMS_EPS).is_err());
}

fn table(n: usize, axes: &[usize], dt: DType) -> Arc<RopeTable> {
    let ids: Vec<f64> = (0..n)
        .flat_map(|i| [0.0, (i / 3) as f64, (i % 3) as f64])
        .collect();
    Arc::new(RopeTable::new(&ids, axes, 10000.0, dt).unwrap())
}

#[test]
fn rope_rotates_pairs_and_its_backward_is_the_adjoint() {
    let (b, n, heads, axes) = (2, 7, 2, [4, 6, 6]);
    let dh: usize = axes.iter().sum();
    let tb = table(n, &axes, DType::F64);
    let x = Var::from_tensor(&rand(&[b * n, heads * dh], 6, 1.0)).unwrap();
    let y = rope(x.as_tensor(), &tb).unwrap();
    // Written out: out[2i] = x[2i]cos − x[2i+1]sin, out[2i+1] = x[2i+1]cos + x[2i]sin.
    let xv: Vec<Vec<f64>> = x.as_tensor().to_vec2().unwrap();
    let yv: Vec<Vec<f64>> = y.to_vec2().unwrap();
    let cos: Vec<Vec<f64>> = tb.cos.to_vec2().unwrap();
    let sin: Vec<Vec<f64>> = tb.sin.to_vec2().unwrap();
    let mut worst = 0f64;
    for r in 0..b * n {
        let tok = r % n;
        for hd in 0..heads {
            for i in (0..dh).step_by(2) {
                let (x0, x1) = (xv[r][hd * dh + i], xv[r][hd * dh + i + 1]);
                let (c, s) = (cos[tok][i], sin[tok][i]);
                worst = worst.max((yv[r][hd * dh + i] - (x0 * c - x1 * s)).abs());
                worst = worst.max((yv[r][hd * dh + i + 1] - (x1 * c + x0 * s)).abs());
            }
        }
    }
    assert!(worst < 1e-14, "{worst}");
    // Token 0 sits at the origin of every axis: no rotation.
    assert!(
        max_abs(
            &y.narrow(0, 0, 1).unwrap(),
            &x.as_tensor().narrow(0, 0, 1).unwrap()
        ) < 1e-15
    );
    // ⟨rope(x), g⟩ = ⟨x, rope_bwd(g)⟩, and a rotation keeps norms.
    let go = rand(&[b * n, heads * dh], 7, 1.0);
    let g = grads_through(&y, &go);
    let dx = g.get(x.as_tensor()).unwrap();
    assert!((dot(&y, &go) - dot(x.as_tensor(), dx)).abs() < 1e-10);
    assert!((dot(dx, dx) - dot(&go, &go)).abs() < 1e-9);
    // Low precision against f64.
    let t32 = table(n, &axes, DType::F32);
    for dt in [DType::BF16, DType::F16, DType::F32] {
        let yl = rope(&x.as_tensor().to_dtype(dt).unwrap(), &t32).unwrap();
        assert_eq!(yl.dtype(), dt);
        assert!(max_abs(&yl, &y) < 3e-2);
    }
    assert!(rope(&rand(&[5, heads * dh], 1, 1.0), &tb).is_err());
}

#[test]
fn concat_and_slice_match_cat_and_narrow() {
    let (b, ta, tb, d) = (3, 2, 5, 4);
    let a = Var::from_tensor(&rand(&[b, ta, d], 8, 1.0)).unwrap();
    let c = Var::from_tensor(&rand(&[b, tb, d], 9, 1.0)).unwrap();
    let y = concat(a.as_tensor(), c.as_tensor(), b, (b, ta + tb, d)).unwrap();
    let yr = Tensor::cat(&[a.as_tensor(), c.as_tensor()], 1).unwrap();
    assert_eq!(max_abs(&y, &yr), 0.0);
    let go = rand(&[b, ta + tb, d], 10, 1.0);
    let (g, gr) = (grads_through(&y, &go), grads_through(&yr, &go));
    for v in [&a, &c] {
        assert_eq!(
            max_abs(
                g.get(v.as_tensor()).unwrap(),
                gr.get(v.as_tensor()).unwrap()
            ),
            0.0
        );
    }
    let x = Var::from_tensor(&rand(&[b, ta + tb, d], 11, 1.0)).unwrap();
    let s = slice(x.as_tensor(), b, (ta * d, (ta + tb) * d), (b * tb, d)).unwrap();
    let sr = x
        .as_tensor()
        .narrow(1, ta, tb)
        .unwrap()
        .reshape((b * tb, d))
        .unwrap();
    assert_eq!(max_abs(&s, &sr), 0.0);
    let go = rand(&[b * tb, d], 12, 1.0);
    let (g, gr) = (grads_through(&s, &go), grads_through(&sr, &go));
    assert_eq!(
        max_abs(
            g.get(x.as_tensor()).unwrap(),
            gr.get(x.as_tensor()).unwrap()
        ),
        0.0
    );
    assert!(concat(a.as_tensor(), c.as_tensor(), b, (b, ta + tb + 1, d)).is_err());
    assert!(slice(
        x.as_tensor(),
        b,
        (0, (ta + tb + 1) * d),
        (b * (ta + tb + 1), d)
    )
    .is_err());
}

/// SD3's row forms are the same ops: (b·s, D) and (b·t, D) rows make (b·(s+t), D) rows, each
/// sample's s rows then its t rows, and a split takes one part back out.
#[test]
fn cat_tokens_and_split_tokens_are_concat_and_slice_on_rows() {
    let (b, ta, tb, d) = (3, 2, 5, 4);
    let a = rand(&[b * ta, d], 13, 1.0);
    let c = rand(&[b * tb, d], 14, 1.0);
    let y = cat_tokens(&a, &c, b).unwrap();
    let per_sample = |x: &Tensor, t: usize| x.reshape((b, t, d)).unwrap();
    let yr = Tensor::cat(&[per_sample(&a, ta), per_sample(&c, tb)], 1)
        .unwrap()
        .reshape((b * (ta + tb), d))
        .unwrap();
    assert_eq!(max_abs(&y, &yr), 0.0);
    assert_eq!(max_abs(&split_tokens(&y, b, 0, ta).unwrap(), &a), 0.0);
    assert_eq!(max_abs(&split_tokens(&y, b, ta, tb).unwrap(), &c), 0.0);
    // Widths that differ, rows that are not whole samples, a part past the end: errors.
    assert!(cat_tokens(&a, &rand(&[b * tb, d + 1], 15, 1.0), b).is_err());
    assert!(split_tokens(&rand(&[7, d], 16, 1.0), b, 0, 1).is_err());
    assert!(split_tokens(&y, b, ta, tb + 1).is_err());
}

/// The fused q/k norm + RoPE against the composition it replaces, bit for bit in every dtype:
/// `norm_rope` = rope(rms_norm(x, w)); `joint_norm_rope` on the joint [text; image] projection
/// = rope(concat(rms_norm(text, w_text), rms_norm(image, w_image))); values, dx and each dw
/// (the weights as f32 masters under a low-precision x, as under bf16-mixed); with a frozen
/// weight no dw and the same dx.
#[test]
fn norm_rope_is_the_composition_bit_for_bit() {
    let (b, t, s, heads, axes) = (3, 4, 5, 2, [4, 6, 6]);
    let dh: usize = axes.iter().sum();
    let (n, d) = (t + s, heads * dh);
    for dt in [DType::F64, DType::F32, DType::BF16, DType::F16] {
        let (wdt, tdt) = match dt {
            DType::F64 => (DType::F64, DType::F64),
            _ => (DType::F32, DType::F32),
        };
        let tb = table(n, &axes, tdt);
        let var = |dims: &[usize], seed: u64, scale: f64, to: DType| {
            Var::from_tensor(&rand(dims, seed, scale).to_dtype(to).unwrap()).unwrap()
        };
        let text = var(&[b * t, d], 20, 1.3, dt);
        let image = var(&[b * s, d], 21, 0.8, dt);
        let w_text = var(&[dh], 22, 0.3, wdt);
        let w_image = var(&[dh], 23, 0.3, wdt);
        let go = rand(&[b * n, d], 24, 1.0).to_dtype(dt).unwrap();

        // Joint: the fused op reads the concatenated projection.
        let joint = concat(text.as_tensor(), image.as_tensor(), b, (b * n, d)).unwrap();
        let y = joint_norm_rope(
            &joint,
            w_text.as_tensor(),
            w_image.as_tensor(),
            t,
            RMS_EPS,
            &tb,
        )
        .unwrap();
        let composed = |wt: &Tensor, wi: &Tensor| {
            let nt = rms_norm(text.as_tensor(), wt, RMS_EPS).unwrap();
            let ni = rms_norm(image.as_tensor(), wi, RMS_EPS).unwrap();
            rope(&concat(&nt, &ni, b, (b * n, d)).unwrap(), &tb).unwrap()
        };
        let yr = composed(w_text.as_tensor(), w_image.as_tensor());
        assert_eq!(y.dtype(), dt);
        assert_eq!(max_abs(&y, &yr), 0.0, "{dt:?} joint values");
        let (g, gr) = (grads_through(&y, &go), grads_through(&yr, &go));
        for (what, v) in [
            ("text", &text),
            ("image", &image),
            ("w_text", &w_text),
            ("w_image", &w_image),
        ] {
            let (a, c) = (
                g.get(v.as_tensor()).unwrap(),
                gr.get(v.as_tensor()).unwrap(),
            );
            assert_eq!(a.dtype(), c.dtype());
            assert_eq!(max_abs(a, c), 0.0, "{dt:?} joint d{what}");
        }
        // A frozen image weight: no gradient for it, the rest unchanged.
        let wi = w_image.as_tensor().detach();
        let y2 = joint_norm_rope(&joint, w_text.as_tensor(), &wi, t, RMS_EPS, &tb).unwrap();
        let g2 = grads_through(&y2, &go);
        assert!(g2.get(&wi).is_none());
        let dx2 = g2.get(text.as_tensor()).unwrap();
        assert_eq!(max_abs(dx2, gr.get(text.as_tensor()).unwrap()), 0.0);

        // Single stream: one weight over every token.
        let x = var(&[b * n, d], 25, 1.1, dt);
        let ys = norm_rope(x.as_tensor(), w_image.as_tensor(), RMS_EPS, &tb).unwrap();
        let ysr = rope(
            &rms_norm(x.as_tensor(), w_image.as_tensor(), RMS_EPS).unwrap(),
            &tb,
        )
        .unwrap();
        assert_eq!(max_abs(&ys, &ysr), 0.0, "{dt:?} single values");
        let (g, gr) = (grads_through(&ys, &go), grads_through(&ysr, &go));
        for v in [&x, &w_image] {
            let (a, c) = (
                g.get(v.as_tensor()).unwrap(),
                gr.get(v.as_tensor()).unwrap(),
            );
            assert_eq!(max_abs(a, c), 0.0, "{dt:?} single gradients");
        }
    }
    // Shapes the op refuses: rows that are not whole samples, a weight not d_h wide.
    let tb = table(n, &axes, DType::F64);
    let w = rand(&[dh], 1, 1.0);
    assert!(norm_rope(&rand(&[n + 1, d], 2, 1.0), &w, RMS_EPS, &tb).is_err());
    assert!(norm_rope(
        &rand(&[n, d], 3, 1.0),
        &rand(&[dh + 2], 4, 1.0),
        RMS_EPS,
        &tb
    )
    .is_err());
    let x = rand(&[n, d], 5, 1.0);
    assert!(joint_norm_rope(&x, &w, &w.to_dtype(DType::F32).unwrap(), t, RMS_EPS, &tb).is_err());
}
