//! Gradients of the fused ops against the composed candle reference in f64 (and finite
//! differences for GELU), plus the low-precision paths against f64.

use candle_core::{DType, Device, Tensor, Var};
use ditmem_engine::layers::{layer_norm, modulate, LN_EPS};
use ditmem_engine::ops::{gelu_tanh, ln_modulate};

mod common;
use common::{grads_through, max_abs_diff as max_abs, rand};

#[test]
fn gelu_matches_candle_and_finite_differences() {
    let x = Var::from_tensor(&rand(&[3, 7, 11], 1, 2.0)).unwrap();
    let w = rand(&[3, 7, 11], 2, 1.0);
    let y1 = x.as_tensor().gelu().unwrap();
    let y2 = gelu_tanh(x.as_tensor()).unwrap();
    assert!(max_abs(&y1, &y2) < 1e-14);
    let g1 = grads_through(&y1, &w);
    let g2 = grads_through(&y2, &w);
    let (g1, g2) = (g1.get(&x).unwrap(), g2.get(&x).unwrap());
    // Candle's own gelu backward uses rounded constants (0.0356774, 0.797885, …), so it agrees
    // only to ~1e-6; the finite differences below are the exact reference.
    assert!(max_abs(g1, g2) < 1e-5, "{}", max_abs(g1, g2));
    // Central differences on a few elements.
    let base: Vec<f64> = x.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
    let gv: Vec<f64> = g2.flatten_all().unwrap().to_vec1().unwrap();
    let wv: Vec<f64> = w.flatten_all().unwrap().to_vec1().unwrap();
    for i in [0usize, 17, 100, 230] {
        let h = 1e-6;
        let f = |v: f64| {
            let t = Tensor::new(&[v], &Device::Cpu).unwrap();
            gelu_tanh(&t).unwrap().to_vec1::<f64>().unwrap()[0] * wv[i]
        };
        let fd = (f(base[i] + h) - f(base[i] - h)) / (2.0 * h);
        assert!((fd - gv[i]).abs() < 1e-9, "i={i}: {fd} vs {}", gv[i]);
    }
}

#[test]
fn gelu_low_precision_close_to_f64() {
    let x64 = rand(&[4, 5000], 3, 2.0);
    let g64 = rand(&[4, 5000], 4, 1.0);
    for (dt, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 5e-3)] {
        let x = Var::from_tensor(&x64.to_dtype(dt).unwrap()).unwrap();
        let y = gelu_tanh(x.as_tensor()).unwrap();
        assert_eq!(y.dtype(), dt);
        let r = x.as_tensor().to_dtype(DType::F64).unwrap().gelu().unwrap();
        assert!(max_abs(&y, &r) < tol * 4.0, "{dt:?} fwd");
        let grads = grads_through(&y, &g64.to_dtype(dt).unwrap());
        let gx = grads.get(&x).unwrap();
        assert_eq!(gx.dtype(), dt);
        let xr = Var::from_tensor(&x.as_tensor().to_dtype(DType::F64).unwrap()).unwrap();
        let gr = grads_through(
            &xr.as_tensor().gelu().unwrap(),
            &g64.to_dtype(dt).unwrap().to_dtype(DType::F64).unwrap(),
        );
        let d = max_abs(gx, gr.get(&xr).unwrap());
        assert!(d < tol * 8.0, "{dt:?} grad {d}");
    }
}

/// The adaLN chunks are narrow views of a (b, 6D) tensor: test on such views.
fn ln_case(b: usize, s: usize, d: usize) {
    let x = Var::from_tensor(&rand(&[b, s, d], 5, 1.5).affine(1.0, 0.3).unwrap()).unwrap();
    let m = Var::from_tensor(&rand(&[b, 6 * d], 6, 0.5)).unwrap();
    let shift = m.as_tensor().narrow(1, 3 * d, d).unwrap();
    let scale = m.as_tensor().narrow(1, 4 * d, d).unwrap();
    let w = rand(&[b, s, d], 7, 1.0);
    let y1 = modulate(&layer_norm(x.as_tensor()).unwrap(), &shift, &scale).unwrap();
    // The fused op writes the (b·s, D) rows the next linear takes.
    let y2 = ln_modulate(x.as_tensor(), &shift, &scale, LN_EPS, DType::F64).unwrap();
    assert_eq!(y2.dims(), &[b * s, d]);
    let y2 = y2.reshape((b, s, d)).unwrap();
    assert!(max_abs(&y1, &y2) < 1e-12);
    let g1 = grads_through(&y1, &w);
    let g2 = grads_through(&y2, &w);
    for v in [&x, &m] {
        let d = max_abs(g1.get(v).unwrap(), g2.get(v).unwrap());
        assert!(d < 1e-11, "grad differs by {d}");
    }
}

#[test]
fn ln_modulate_matches_composed_f64() {
    ln_case(2, 9, 16);
    ln_case(1, 5, 130);
    ln_case(3, 1, 8);
}

#[test]
fn ln_modulate_writes_the_compute_dtype() {
    let (b, s, d) = (2, 33, 96);
    let x64 = rand(&[b, s, d], 8, 1.0);
    let m64 = rand(&[b, 6 * d], 9, 0.5);
    let go = rand(&[b, s, d], 10, 1.0);
    let reference = {
        let x = Var::from_tensor(&x64).unwrap();
        let m = Var::from_tensor(&m64).unwrap();
        let y = modulate(
            &layer_norm(x.as_tensor()).unwrap(),
            &m.as_tensor().narrow(1, 0, d).unwrap(),
            &m.as_tensor().narrow(1, d, d).unwrap(),
        )
        .unwrap();
        let g = grads_through(&y, &go);
        (y, g.get(&x).unwrap().clone(), g.get(&m).unwrap().clone())
    };
    for (out, tol) in [(DType::F32, 1e-4), (DType::BF16, 5e-2), (DType::F16, 1e-2)] {
        let x = Var::from_tensor(&x64.to_dtype(DType::F32).unwrap()).unwrap();
        let m = Var::from_tensor(&m64.to_dtype(DType::F32).unwrap()).unwrap();
        let y = ln_modulate(
            x.as_tensor(),
            &m.as_tensor().narrow(1, 0, d).unwrap(),
            &m.as_tensor().narrow(1, d, d).unwrap(),
            LN_EPS,
            out,
        )
        .unwrap()
        .reshape((b, s, d))
        .unwrap();
        assert_eq!(y.dtype(), out);
        assert!(max_abs(&y, &reference.0) < tol, "{out:?} fwd");
        let g = grads_through(&y, &go.to_dtype(out).unwrap());
        let gx = g.get(&x).unwrap();
        assert_eq!(gx.dtype(), DType::F32);
        // dshift/dscale sum over s tokens: scale the tolerance by s.
        assert!(max_abs(gx, &reference.1) < tol * 4.0, "{out:?} dx");
        assert!(
            max_abs(g.get(&m).unwrap(), &reference.2) < tol * s as f64,
            "{out:?} dm"
        );
    }
}

#[test]
fn ln_modulate_rejects_bad_shapes() {
    let x = rand(&[2, 3, 4], 1, 1.0);
    let bad = rand(&[3, 4], 2, 1.0);
    let ok = rand(&[2, 4], 3, 1.0);
    assert!(ln_modulate(&x, &bad, &ok, LN_EPS, DType::F64).is_err());
    let x2 = rand(&[6, 4], 1, 1.0);
    assert!(ln_modulate(&x2, &ok, &ok, LN_EPS, DType::F64).is_err());
    let xi = x.to_dtype(DType::U32).unwrap();
    let oki = ok.to_dtype(DType::U32).unwrap();
    assert!(ln_modulate(&xi, &oki, &oki, LN_EPS, DType::BF16).is_err());
    // Mixed dtypes between x and the modulation are refused.
    let okb = ok.to_dtype(DType::BF16).unwrap();
    assert!(ln_modulate(&x, &okb, &okb, LN_EPS, DType::F64).is_err());
}

use ditmem_engine::ops::{attention_materialized, Dropout};
use ditmem_engine::ops::{qkv_attention, AttnKeep, ATTN_KEY_BLOCK};

/// The composed reference: split qkv (b·s, 3D) into heads, scale q, materialized attention in
/// candle ops, back to (b·s, D).
fn attention_reference(qkv: &Tensor, b: usize, a: usize, dropout: Option<Dropout>) -> Tensor {
    attention_reference_with(qkv, b, a, DType::F64, dropout)
}

/// [`attention_reference`] in qkv's dtype with the softmax in `accum`, without dropout.
fn attention_reference_in(qkv: &Tensor, b: usize, a: usize, accum: DType) -> Tensor {
    attention_reference_with(qkv, b, a, accum, None)
}

fn attention_reference_with(
    qkv: &Tensor,
    b: usize,
    a: usize,
    accum: DType,
    dropout: Option<Dropout>,
) -> Tensor {
    let (rows, d3) = qkv.dims2().unwrap();
    let (s, dh) = (rows / b, d3 / (3 * a));
    let q5 = qkv.reshape((b, s, 3, a, dh)).unwrap();
    let view = |i: usize| {
        q5.narrow(2, i, 1)
            .unwrap()
            .squeeze(2)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    let q = view(0).affine(1.0 / (dh as f64).sqrt(), 0.0).unwrap();
    let o = attention_materialized(&q, &view(1), &view(2), accum, dropout).unwrap();
    o.transpose(1, 2).unwrap().reshape((rows, a * dh)).unwrap()
}

fn attention_case(
    b: usize,
    s: usize,
    a: usize,
    dh: usize,
    keep: AttnKeep,
    dropout: Option<Dropout>,
) {
    attention_check((b, s, a, dh), keep, dropout, (11, 12), 1e-11);
}

/// `qkv_attention` on (b·s, 3·a·dh) inputs drawn from `seeds.0` (output gradient from
/// `seeds.1`) against the composed reference in f64: outputs within 1e-12, gradients within
/// `grad_tol`.
fn attention_check(
    (b, s, a, dh): (usize, usize, usize, usize),
    keep: AttnKeep,
    dropout: Option<Dropout>,
    seeds: (u64, u64),
    grad_tol: f64,
) {
    let qkv = Var::from_tensor(&rand(&[b * s, 3 * a * dh], seeds.0, 1.0)).unwrap();
    let go = rand(&[b * s, a * dh], seeds.1, 1.0);
    let r = attention_reference(qkv.as_tensor(), b, a, dropout);
    let o = qkv_attention(qkv.as_tensor(), b, a, keep, dropout).unwrap();
    let d = max_abs(&r, &o);
    assert!(d < 1e-12, "{keep:?} forward differs by {d}");
    let g1 = grads_through(&r, &go);
    let g2 = grads_through(&o, &go);
    let d = max_abs(g1.get(&qkv).unwrap(), g2.get(&qkv).unwrap());
    assert!(d < grad_tol, "{keep:?} gradient differs by {d}");
}

#[test]
fn qkv_attention_matches_composed_f64() {
    for keep in [
        AttnKeep::Probabilities,
        AttnKeep::Nothing,
        AttnKeep::LogSumExp,
    ] {
        // s = 150 spans two key blocks of the streaming kernel.
        attention_case(2, 150, 3, 8, keep, None);
        attention_case(1, 7, 2, 4, keep, None);
    }
    let dr = Some(Dropout { p: 0.3, seed: 5 });
    attention_case(2, 20, 2, 4, AttnKeep::Probabilities, dr);
    attention_case(2, 20, 2, 4, AttnKeep::Nothing, dr);
}

/// `f`'s output of v and v's gradient through it under the output gradient `go`.
fn out_and_grad(v: &Var, go: &Tensor, f: impl FnOnce(&Tensor) -> Tensor) -> (Tensor, Tensor) {
    let o = f(v.as_tensor());
    let g = grads_through(&o, go);
    (o, g.get(v).unwrap().clone())
}

#[test]
fn qkv_attention_recompute_is_bitwise_the_stored_mode() {
    // In bf16 the stored P is rounded to bf16; the recomputed one must be rounded the same way.
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let (b, s, a, dh) = (2, 40, 2, 8);
        let qkv =
            Var::from_tensor(&rand(&[b * s, 3 * a * dh], 13, 1.0).to_dtype(dt).unwrap()).unwrap();
        let go = rand(&[b * s, a * dh], 14, 1.0).to_dtype(dt).unwrap();
        let dr = Some(Dropout { p: 0.1, seed: 9 });
        let run = |keep| out_and_grad(&qkv, &go, |x| qkv_attention(x, b, a, keep, dr).unwrap());
        let (o1, g1) = run(AttnKeep::Probabilities);
        let (o2, g2) = run(AttnKeep::Nothing);
        assert_eq!(max_abs(&o1, &o2), 0.0, "{dt:?}");
        assert_eq!(max_abs(&g1, &g2), 0.0, "{dt:?}");
    }
}

/// bf16 with dropout over more query rows than one block of the AVX512-BF16 kernel's backward
/// (`NATIVE_BWD_ROWS`, 128; 300 = two blocks and a ragged one): close to the f64 reference with
/// the same masks, and the recomputing mode bitwise the storing one. A block reading another
/// block's P, mask or rows of q and dO is off by O(1).
#[test]
fn qkv_attention_bf16_by_row_blocks_with_dropout() {
    let (b, s, a, dh) = (1, 300, 2, 16);
    let x64 = rand(&[b * s, 3 * a * dh], 17, 1.0);
    let go = rand(&[b * s, a * dh], 18, 1.0);
    let dr = Some(Dropout { p: 0.2, seed: 5 });
    let r = out_and_grad(&Var::from_tensor(&x64).unwrap(), &go, |x| {
        attention_reference(x, b, a, dr)
    });
    let v = Var::from_tensor(&x64.to_dtype(DType::BF16).unwrap()).unwrap();
    let go16 = go.to_dtype(DType::BF16).unwrap();
    let run = |keep| out_and_grad(&v, &go16, |x| qkv_attention(x, b, a, keep, dr).unwrap());
    let (o1, g1) = run(AttnKeep::Probabilities);
    let (o2, g2) = run(AttnKeep::Nothing);
    assert_eq!(max_abs(&o1, &o2), 0.0);
    assert_eq!(max_abs(&g1, &g2), 0.0);
    assert!(max_abs(&o1, &r.0) < 0.05, "fwd {}", max_abs(&o1, &r.0));
    let (gmax, err) = (
        max_abs(&r.1, &r.1.zeros_like().unwrap()),
        max_abs(&g1, &r.1),
    );
    assert!(err < 0.05 * gmax, "grad {err} of {gmax}");
}

#[test]
fn qkv_attention_low_precision_close_to_f64() {
    let (b, s, a, dh) = (2, 130, 2, 16);
    let x64 = rand(&[b * s, 3 * a * dh], 15, 1.0);
    let go = rand(&[b * s, a * dh], 16, 1.0);
    let r = out_and_grad(&Var::from_tensor(&x64).unwrap(), &go, |x| {
        attention_reference(x, b, a, None)
    });
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let tol = if dt == DType::F32 { 1e-4 } else { 0.1 };
        for keep in [
            AttnKeep::Probabilities,
            AttnKeep::Nothing,
            AttnKeep::LogSumExp,
        ] {
            let v = Var::from_tensor(&x64.to_dtype(dt).unwrap()).unwrap();
            let o = qkv_attention(v.as_tensor(), b, a, keep, None).unwrap();
            assert_eq!(o.dtype(), dt);
            assert!(
                max_abs(&o, &r.0) < tol,
                "{dt:?} {keep:?} fwd {}",
                max_abs(&o, &r.0)
            );
            let g = grads_through(&o, &go.to_dtype(dt).unwrap());
            let gd = g.get(&v).unwrap();
            assert_eq!(gd.dtype(), dt);
            assert!(
                max_abs(gd, &r.1) < tol * 2.0,
                "{dt:?} {keep:?} grad {}",
                max_abs(gd, &r.1)
            );
        }
    }
}

/// The streaming (log-sum-exp) mode against the composed reference in f64, over a sequence
/// that spans two key blocks of [`ATTN_KEY_BLOCK`] (formerly the test of the separate
/// memory-efficient op on q, k, v, with the same tolerance on outputs and gradients).
#[test]
fn qkv_attention_streaming_matches_materialized_f64() {
    let dims = (2, ATTN_KEY_BLOCK + 72, 3, 8);
    attention_check(dims, AttnKeep::LogSumExp, None, (1, 4), 1e-12);
}

/// The streaming mode in f32, bf16 and f16 against the composed attention on the same inputs
/// (accumulating in f32); its gradient comes back in the input's dtype.
#[test]
fn qkv_attention_streaming_half_dtypes_close_to_materialized() {
    let (b, s, a, dh) = (1, 70, 2, 8);
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let qkv = rand(&[b * s, 3 * a * dh], 1, 1.0).to_dtype(dt).unwrap();
        let v = Var::from_tensor(&qkv).unwrap();
        let r = attention_reference_in(&qkv, b, a, DType::F32);
        let o = qkv_attention(v.as_tensor(), b, a, AttnKeep::LogSumExp, None).unwrap();
        let d = max_abs(&r, &o);
        assert!(d < 0.05, "{dt:?}: {d}");
        let g = o.sum_all().unwrap().backward().unwrap();
        assert_eq!(g.get(&v).unwrap().dtype(), dt);
    }
}

#[test]
fn qkv_attention_rejects_bad_input() {
    let x = rand(&[10, 12], 1, 1.0);
    assert!(qkv_attention(&x, 3, 2, AttnKeep::Nothing, None).is_err());
    assert!(qkv_attention(&x, 2, 5, AttnKeep::Nothing, None).is_err());
    assert!(qkv_attention(&x, 0, 2, AttnKeep::Nothing, None).is_err());
    let d = Some(Dropout { p: 0.1, seed: 1 });
    assert!(qkv_attention(&x, 2, 2, AttnKeep::LogSumExp, d).is_err());
    let x3 = rand(&[2, 5, 12], 1, 1.0);
    assert!(qkv_attention(&x3, 2, 2, AttnKeep::Nothing, None).is_err());
}

use ditmem_engine::ops::linear;

/// A linear layer's f64 inputs (x, the weight, the bias) and output gradient, drawn from seeds
/// `seed`, `seed + 1`, `seed + 2`, `seed + 3`.
fn linear_inputs(rows: usize, inp: usize, out: usize, seed: u64) -> [Tensor; 4] {
    [
        rand(&[rows, inp], seed, 1.0),
        rand(&[out, inp], seed + 1, 0.3),
        rand(&[out], seed + 2, 0.3),
        rand(&[rows, out], seed + 3, 1.0),
    ]
}

#[test]
fn linear_matches_composed() {
    // 300 rows span three chunks of the widened path.
    let (rows, inp, out) = (300, 24, 40);
    let [x64, w64, b64, go] = linear_inputs(rows, inp, out, 21);
    let reference = |dt: DType| {
        let x = Var::from_tensor(&x64.to_dtype(dt).unwrap()).unwrap();
        let w = Var::from_tensor(&w64.to_dtype(dt).unwrap()).unwrap();
        let b = Var::from_tensor(&b64.to_dtype(dt).unwrap()).unwrap();
        let y = x
            .as_tensor()
            .matmul(&w.as_tensor().t().unwrap())
            .unwrap()
            .broadcast_add(b.as_tensor())
            .unwrap();
        let g = grads_through(&y, &go.to_dtype(dt).unwrap());
        let gs = [&x, &w, &b].map(|v| g.get(v).unwrap().clone());
        (y, gs)
    };
    let fused = |dt: DType| {
        let x = Var::from_tensor(&x64.to_dtype(dt).unwrap()).unwrap();
        let w = Var::from_tensor(&w64.to_dtype(dt).unwrap()).unwrap();
        let b = Var::from_tensor(&b64.to_dtype(dt).unwrap()).unwrap();
        let y = linear(x.as_tensor(), w.as_tensor(), b.as_tensor()).unwrap();
        let g = grads_through(&y, &go.to_dtype(dt).unwrap());
        let gs = [&x, &w, &b].map(|v| g.get(v).unwrap().clone());
        (y, gs)
    };
    let (ry, rg) = reference(DType::F64);
    for (dt, tol) in [
        (DType::F64, 1e-12),
        (DType::F32, 1e-4),
        (DType::BF16, 0.1),
        (DType::F16, 0.02),
    ] {
        let (y, g) = fused(dt);
        assert_eq!(y.dtype(), dt);
        assert!(max_abs(&y, &ry) < tol, "{dt:?} y {}", max_abs(&y, &ry));
        // dW and db sum over 300 rows.
        for (i, (a, b)) in g.iter().zip(&rg).enumerate() {
            let t = if i == 0 { tol } else { tol * 30.0 };
            assert_eq!(a.dtype(), dt);
            assert!(max_abs(a, b) < t, "{dt:?} grad {i}: {}", max_abs(a, b));
        }
    }
    // A frozen weight (a LoRA base) gets no gradient and the input still does.
    let x = Var::from_tensor(&x64).unwrap();
    let y = linear(x.as_tensor(), &w64, &b64).unwrap();
    let g = y.sum_all().unwrap().backward().unwrap();
    assert!(g.get(&x).is_some());
    assert!(g.get(&w64).is_none());
    // Bad shapes are errors.
    assert!(linear(&x64, &rand(&[out, inp + 1], 1, 1.0), &b64).is_err());
    assert!(linear(&x64, &w64, &rand(&[out + 1], 1, 1.0)).is_err());
}

/// In bf16 every output of the linear is one rounding of an f32 sum of exact bf16 products: the
/// kernel (or the widening path) must land within half a bf16 ulp plus f32 summation error of the
/// f64 result on the same bf16 inputs. Ragged on purpose: 300 rows (three chunks, the last
/// partial), 37 inputs (an odd k), 130 outputs (a partial column tile).
#[test]
fn linear_bf16_is_one_rounding_of_the_exact_product() {
    let (rows, inp, out) = (300, 37, 130);
    let r = |d: &[usize], seed, sc| rand(d, seed, sc).to_dtype(DType::BF16).unwrap();
    let (x, w, b, go) = (
        r(&[rows, inp], 31, 1.0),
        r(&[out, inp], 32, 0.3),
        r(&[out], 33, 0.3),
        r(&[rows, out], 34, 1.0),
    );
    let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    let (x64, w64, b64, g64) = (f64s(&x), f64s(&w), f64s(&b), f64s(&go));
    let want_y = x64
        .matmul(&w64.t().unwrap())
        .unwrap()
        .broadcast_add(&b64)
        .unwrap();
    let want = [
        g64.matmul(&w64).unwrap(),
        g64.t().unwrap().matmul(&x64).unwrap(),
        g64.sum(0).unwrap(),
    ];
    let (xv, wv, bv) = (
        Var::from_tensor(&x).unwrap(),
        Var::from_tensor(&w).unwrap(),
        Var::from_tensor(&b).unwrap(),
    );
    let y = linear(xv.as_tensor(), wv.as_tensor(), bv.as_tensor()).unwrap();
    let grads = grads_through(&y, &go);
    let got = [&xv, &wv, &bv].map(|v| grads.get(v).unwrap().clone());
    let check = |name: &str, got: &Tensor, want: &Tensor, terms: usize| {
        let g = got
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let w = want.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(g.len(), w.len(), "{name}");
        for (i, (a, e)) in g.iter().zip(&w).enumerate() {
            let tol = e.abs() * (2f64.powi(-8) + 1e-6 * terms as f64) + 1e-6 * terms as f64;
            assert!((a - e).abs() <= tol, "{name}[{i}] = {a}, exact {e}");
        }
    };
    check("y", &y, &want_y, inp);
    check("dx", &got[0], &want[0], out);
    check("dW", &got[1], &want[1], rows);
    check("db", &got[2], &want[2], rows);
}

/// Mixed precision hands the linear its f32 master weights: the output and dx must be bitwise
/// those of the same op on bf16/f16 cast copies, and dW, db (returned in f32) that op's
/// gradients before their rounding to the compute dtype.
#[test]
fn linear_reads_master_weights_like_their_casts() {
    let (rows, inp, out) = (300, 37, 130);
    let x64 = rand(&[rows, inp], 41, 1.0);
    let w32 = rand(&[out, inp], 42, 0.3).to_dtype(DType::F32).unwrap();
    let b32 = rand(&[out], 43, 0.3).to_dtype(DType::F32).unwrap();
    let go64 = rand(&[rows, out], 44, 1.0);
    for dt in [DType::BF16, DType::F16] {
        let x = Var::from_tensor(&x64.to_dtype(dt).unwrap()).unwrap();
        let go = go64.to_dtype(dt).unwrap();
        let run = |w: &Tensor, b: &Tensor| {
            let (wv, bv) = (Var::from_tensor(w).unwrap(), Var::from_tensor(b).unwrap());
            let y = linear(x.as_tensor(), wv.as_tensor(), bv.as_tensor()).unwrap();
            let g = grads_through(&y, &go);
            let grads = [
                g.get(x.as_tensor()).unwrap().clone(),
                g.get(wv.as_tensor()).unwrap().clone(),
                g.get(bv.as_tensor()).unwrap().clone(),
            ];
            (y, grads)
        };
        let (ym, gm) = run(&w32, &b32);
        let (yc, gc) = run(&w32.to_dtype(dt).unwrap(), &b32.to_dtype(dt).unwrap());
        assert_eq!(ym.dtype(), dt);
        assert_eq!(max_abs(&ym, &yc), 0.0, "{dt:?} y");
        assert_eq!(max_abs(&gm[0], &gc[0]), 0.0, "{dt:?} dx");
        for (i, name) in [(1, "dW"), (2, "db")] {
            assert_eq!(gm[i].dtype(), DType::F32, "{dt:?} {name} dtype");
            // Rounding the f32 gradient to the compute dtype gives the cast copy's gradient.
            let rounded = gm[i].to_dtype(dt).unwrap();
            assert_eq!(max_abs(&rounded, &gc[i]), 0.0, "{dt:?} {name}");
        }
    }
    // Anything else is refused, naming the dtypes.
    let x = x64.to_dtype(DType::F32).unwrap();
    let w16 = w32.to_dtype(DType::BF16).unwrap();
    let e = linear(&x, &w16, &b32.to_dtype(DType::BF16).unwrap()).unwrap_err();
    assert!(e.to_string().contains("BF16"), "{e}");
    assert!(linear(
        &x64.to_dtype(DType::BF16).unwrap(),
        &w32,
        &w16.narrow(1, 0, 1).unwrap().squeeze(1).unwrap()
    )
    .is_err());
}

use ditmem_engine::ops::gated_residual;

#[test]
fn gated_residual_matches_composed() {
    let (b, s, d) = (2, 9, 12);
    let go = rand(&[b, s, d], 33, 1.0);
    let run = |fused: bool, yd: DType| {
        let x = Var::from_tensor(&rand(&[b, s, d], 30, 1.0)).unwrap();
        let y = Var::from_tensor(&rand(&[b * s, d], 31, 1.0).to_dtype(yd).unwrap()).unwrap();
        let m = Var::from_tensor(&rand(&[b, 6 * d], 32, 1.0)).unwrap();
        let gate = m.as_tensor().narrow(1, 2 * d, d).unwrap();
        let out = if fused {
            gated_residual(x.as_tensor(), y.as_tensor(), &gate).unwrap()
        } else {
            let y3 = y
                .as_tensor()
                .to_dtype(DType::F64)
                .unwrap()
                .reshape((b, s, d))
                .unwrap();
            (x.as_tensor() + y3.broadcast_mul(&gate.unsqueeze(1).unwrap()).unwrap()).unwrap()
        };
        let g = grads_through(&out, &go);
        let gs = [&x, &y, &m].map(|v| g.get(v).unwrap().clone());
        (out, gs)
    };
    let (r, rg) = run(false, DType::F64);
    let (o, og) = run(true, DType::F64);
    assert!(max_abs(&r, &o) < 1e-14);
    for (a, b) in og.iter().zip(&rg) {
        assert!(max_abs(a, b) < 1e-13);
    }
    // y in bf16 (the compute dtype of a mixed recipe): its gradient comes back in bf16.
    let (o, og) = run(true, DType::BF16);
    assert!(max_abs(&r, &o) < 0.05);
    assert_eq!(og[1].dtype(), DType::BF16);
    assert!(max_abs(&og[1], &rg[1]) < 0.05);
    assert!(gated_residual(
        &rand(&[b, s, d], 1, 1.0),
        &rand(&[b * s, d + 1], 1, 1.0),
        &rand(&[b, d], 1, 1.0)
    )
    .is_err());
}

#[test]
fn linear_with_a_gradient_sink_hands_over_the_same_gradients() {
    use ditmem_engine::ops::{linear, linear_sunk, GradSink};
    use std::sync::Arc;
    let (rows, inp, out) = (130, 24, 40);
    let [x64, w64, b64, go] = linear_inputs(rows, inp, out, 31);
    for (xd, wd) in [
        (DType::F64, DType::F64),
        (DType::F32, DType::F32),
        (DType::BF16, DType::F32),
        (DType::F16, DType::F32),
    ] {
        let x = Var::from_tensor(&x64.to_dtype(xd).unwrap()).unwrap();
        let w = Var::from_tensor(&w64.to_dtype(wd).unwrap()).unwrap();
        let b = Var::from_tensor(&b64.to_dtype(wd).unwrap()).unwrap();
        let seed = |y: &Tensor| grads_through(&y.to_dtype(DType::F64).unwrap(), &go);
        // Through candle's store.
        let g = seed(&linear(x.as_tensor(), w.as_tensor(), b.as_tensor()).unwrap());
        let (dx, dw, db) = (
            g.get(x.as_tensor()).unwrap().clone(),
            g.get(w.as_tensor()).unwrap().clone(),
            g.get(b.as_tensor()).unwrap().clone(),
        );
        // Through the sink: W and b untracked, so candle's store has nothing for them.
        let sink = Arc::new(GradSink::new(true, true));
        let y = linear_sunk(
            x.as_tensor(),
            &w.as_detached_tensor(),
            &b.as_detached_tensor(),
            &sink,
        )
        .unwrap();
        let g = seed(&y);
        assert!(g.get(w.as_tensor()).is_none() && g.get(b.as_tensor()).is_none());
        assert_eq!(
            max_abs(g.get(x.as_tensor()).unwrap(), &dx),
            0.0,
            "{xd:?} dx"
        );
        let sw = sink.take_w().unwrap();
        let sb = sink.take_b().unwrap();
        assert_eq!(sw.dtype(), dw.dtype());
        assert_eq!(max_abs(&sw, &dw), 0.0, "{xd:?} dW");
        assert_eq!(max_abs(&sb, &db), 0.0, "{xd:?} db");
        assert!(sink.take_w().is_none() && sink.take_b().is_none());
        // Two backward passes before a take: the sink holds their sum.
        seed(&y);
        seed(&y);
        let two = (&dw * 2.0).unwrap();
        assert!(
            max_abs(&sink.take_w().unwrap(), &two)
                <= 1e-5 * (1.0 + max_abs(&two, &two.zeros_like().unwrap()))
        );
        // A sink that wants only the bias computes no dW.
        let sink_b = Arc::new(GradSink::new(false, true));
        seed(
            &linear_sunk(
                x.as_tensor(),
                &w.as_detached_tensor(),
                &b.as_detached_tensor(),
                &sink_b,
            )
            .unwrap(),
        );
        assert!(sink_b.take_w().is_none());
        assert_eq!(max_abs(&sink_b.take_b().unwrap(), &db), 0.0);
    }
}

#[test]
fn backward_from_a_known_gradient_matches_the_composed_root() {
    use ditmem_engine::ops::backward_from;
    let x = Var::from_tensor(&rand(&[3, 5, 8], 41, 1.0)).unwrap();
    let w = rand(&[8, 8], 42, 0.5);
    let go = rand(&[3, 5, 8], 43, 1.0);
    let out = |x: &Tensor| gelu_tanh(&x.broadcast_matmul(&w).unwrap()).unwrap();
    let composed = grads_through(&out(x.as_tensor()), &go);
    let seeded = backward_from(&out(x.as_tensor()), go.clone()).unwrap();
    let (a, b) = (
        composed.get(x.as_tensor()).unwrap(),
        seeded.get(x.as_tensor()).unwrap(),
    );
    assert_eq!(max_abs(a, b), 0.0);
    // A gradient of another shape or dtype is refused.
    assert!(backward_from(&out(x.as_tensor()), go.narrow(0, 0, 2).unwrap()).is_err());
    assert!(backward_from(&out(x.as_tensor()), go.to_dtype(DType::F32).unwrap()).is_err());
}

#[test]
fn sum_squares_matches_f64_for_every_dtype() {
    use ditmem_engine::ops::{sum_squares, SQUARES_CHUNK};
    let n = 2 * SQUARES_CHUNK + 77;
    let x64 = rand(&[n], 51, 1.0);
    for dt in [DType::F64, DType::F32, DType::BF16, DType::F16] {
        let x = x64.to_dtype(dt).unwrap();
        let want: f64 = x
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
            .iter()
            .map(|v| v * v)
            .sum();
        let got = sum_squares(&x).unwrap();
        assert!(
            (got - want).abs() <= 1e-12 * want,
            "{dt:?}: {got} vs {want}"
        );
    }
    // Strided views are read as their values.
    let m = rand(&[40, 30], 52, 1.0);
    let t = m.t().unwrap();
    let want = sum_squares(&m).unwrap();
    assert!((sum_squares(&t).unwrap() - want).abs() <= 1e-12 * want);
    // The budget's restatement of the chunk.
    assert_eq!(
        SQUARES_CHUNK as u64,
        ditmem_budget::ditmem_cpu::SQUARES_CHUNK
    );
}
