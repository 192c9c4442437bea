//! The composed attention core, [`attention_materialized`]: candle ops over q, k, v of shape
//! (b, a, s, dh) (q already multiplied by 1/√dh), differentiable by candle's autograd. The
//! engine's blocks run the fused [`super::qkv_attention`]; this composition is the reference
//! the fused op is tested against. Budget twin: `ditmem_budget::ditmem_cpu::attention` (the composed
//! core).

use candle_core::{DType, Tensor, D};

use super::dropout::{dropout_mask, Dropout};

fn cast(t: Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    if t.dtype() == dtype {
        Ok(t)
    } else {
        t.to_dtype(dtype)
    }
}

/// Materialized attention: returns o (b, a, s, dh) in q's dtype.
///
/// Tensors created (cd = q's dtype, ad = `accum`): scores (A, cd); scores→ad (A, ad) when the
/// dtypes differ; row max (b,a,s,1, ad; detached: the softmax is invariant to the shift, so no
/// gradient flows through it); shifted (A, ad); exp (A, ad); row sum (b,a,s,1, ad); P (A, ad);
/// P→cd (A, cd) when the dtypes differ; with dropout the mask (A, cd) and P·mask (A, cd); o.
pub fn attention_materialized(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    accum: DType,
    dropout: Option<Dropout>,
) -> candle_core::Result<Tensor> {
    let cd = q.dtype();
    let scores = q.matmul(&k.t()?)?;
    let scores = cast(scores, accum)?;
    let max = scores.max_keepdim(D::Minus1)?.detach();
    let e = scores.broadcast_sub(&max)?.exp()?;
    let z = e.sum_keepdim(D::Minus1)?;
    let p = e.broadcast_div(&z)?;
    let p = cast(p, cd)?;
    let p = match dropout {
        Some(d) if d.p > 0.0 => {
            let mask = dropout_mask(p.dims(), d, cd, p.device())?;
            p.mul(&mask)?
        }
        _ => p,
    };
    p.matmul(v)
}
