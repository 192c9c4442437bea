//! Attention cores over q, k, v of shape (b, a, s, dh) (q already multiplied by 1/√dh):
//!
//! - [`attention_materialized`]: scores = q·kᵀ in the compute dtype, a softmax composed from
//!   differentiable ops in the accumulation dtype (candle's fused `softmax_last_dim` has no
//!   backward), P cast back, optional dropout, P·v.
//! - [`MemEffAttention`]: a `CustomOp3` that streams over key blocks with an online softmax in f32
//!   (f64 for f64 inputs), never materialising b·a·s², keeps the log-sum-exp (b, a, s) inside the
//!   op (so it lives exactly as long as the graph node), and whose backward recomputes the scores
//!   block by block from q, k, v and the log-sum-exp.
//! - [`attention_recompute_core`]: the attention-only recompute policy. The core is a `CustomOp3`
//!   that keeps only q, k, v (its inputs) and its output; its backward rebuilds the materialized
//!   attention in a temporary graph (same dropout mask, replayed from the seed), backprops through
//!   it and frees it, so P is never stored.

use std::sync::Mutex;

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp3, DType, Layout, Shape, Storage, Tensor, Var, D,
};

use crate::rng::SplitMix64;

/// Dropout of the attention probabilities: probability and the seed of the mask stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    pub p: f64,
    pub seed: u64,
}

/// A dropout mask with values 0 or 1/(1−p), drawn from `seed`, in `dtype`.
pub fn dropout_mask(
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

// ---------------------------------------------------------------------------------------------
// Element access helpers for the CPU kernels.

/// Accumulation scalar of the CPU kernels (f32 or f64).
pub(crate) trait Acc:
    Copy
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::AddAssign
    + std::ops::MulAssign
{
    const ZERO: Self;
    const NEG_INF: Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn from_f64(v: f64) -> Self;
    /// Softmax of each row of `n` values, in place.
    fn softmax_rows(x: &mut [Self], n: usize);
    /// Row i of `x` (rows of `n`) becomes `e^(x − sub[i])`, in place.
    fn exp_rows(x: &mut [Self], n: usize, sub: &[Self]);
    /// The row's maximum (−∞ when empty).
    fn max_of(row: &[Self]) -> Self;
    /// `row[j] = e^(row[j] − m)` in place; returns their sum.
    fn exp_sub_sum(row: &mut [Self], m: Self) -> Self;
}

/// The scalar row kernels (the f64 reference path).
fn scalar_max<A: Acc>(row: &[A]) -> A {
    let mut m = A::NEG_INF;
    for v in row.iter() {
        if *v > m {
            m = *v;
        }
    }
    m
}

fn scalar_exp_sub_sum<A: Acc>(row: &mut [A], m: A) -> A {
    let mut z = A::ZERO;
    for v in row.iter_mut() {
        *v = (*v - m).exp();
        z += *v;
    }
    z
}

impl Acc for f32 {
    const ZERO: Self = 0.0;
    const NEG_INF: Self = f32::NEG_INFINITY;
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn ln(self) -> Self {
        f32::ln(self)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn softmax_rows(x: &mut [f32], n: usize) {
        crate::vecmath::softmax_rows(x, n)
    }
    fn exp_rows(x: &mut [f32], n: usize, sub: &[f32]) {
        crate::vecmath::exp_rows(x, n, sub)
    }
    fn max_of(row: &[f32]) -> f32 {
        crate::vecmath::max_of(row)
    }
    fn exp_sub_sum(row: &mut [f32], m: f32) -> f32 {
        crate::vecmath::exp_sub_sum_of(row, m)
    }
}

impl Acc for f64 {
    const ZERO: Self = 0.0;
    const NEG_INF: Self = f64::NEG_INFINITY;
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn from_f64(v: f64) -> Self {
        v
    }
    fn softmax_rows(x: &mut [f64], n: usize) {
        for row in x.chunks_mut(n.max(1)) {
            let m = scalar_max(row);
            let inv = 1.0 / scalar_exp_sub_sum(row, m);
            for v in row.iter_mut() {
                *v *= inv;
            }
        }
    }
    fn exp_rows(x: &mut [f64], n: usize, sub: &[f64]) {
        for (row, &m) in x.chunks_mut(n.max(1)).zip(sub) {
            for v in row.iter_mut() {
                *v = (*v - m).exp();
            }
        }
    }
    fn max_of(row: &[f64]) -> f64 {
        scalar_max(row)
    }
    fn exp_sub_sum(row: &mut [f64], m: f64) -> f64 {
        scalar_exp_sub_sum(row, m)
    }
}

/// Conversion between a storage element and an accumulation scalar.
pub(crate) trait Elem<A>: Copy {
    fn to_acc(self) -> A;
    fn from_acc(a: A) -> Self;
}

macro_rules! elem {
    ($t:ty, $a:ty, $to:expr, $from:expr) => {
        impl Elem<$a> for $t {
            #[inline]
            fn to_acc(self) -> $a {
                $to(self)
            }
            #[inline]
            fn from_acc(a: $a) -> Self {
                $from(a)
            }
        }
    };
}
elem!(f32, f32, |x| x, |a| a);
elem!(f64, f64, |x| x, |a| a);
elem!(half::bf16, f32, half::bf16::to_f32, half::bf16::from_f32);
elem!(half::f16, f32, half::f16::to_f32, half::f16::from_f32);
// Mixed pairs (an f64 accumulation of a narrower storage and back), so kernels with an input and
// an output dtype can be instantiated for every pair.
elem!(f32, f64, f64::from, |a: f64| a as f32);
elem!(f64, f32, |x: f64| x as f32, f64::from);
elem!(half::bf16, f64, half::bf16::to_f64, half::bf16::from_f64);
elem!(half::f16, f64, half::f16::to_f64, half::f16::from_f64);

pub(crate) fn err(msg: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(msg.into())
}

/// (b, a, s, dh) of a 4-D layout.
fn dims4(l: &Layout) -> candle_core::Result<(usize, usize, usize, usize)> {
    match l.dims() {
        &[b, a, s, dh] => Ok((b, a, s, dh)),
        d => Err(err(format!(
            "attention expects (b, a, s, dh) tensors, got {d:?}"
        ))),
    }
}

fn contiguous_slice<'a, T>(v: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&v[start..end]),
        None => Err(err("memory-efficient attention needs contiguous q, k, v")),
    }
}

// ---------------------------------------------------------------------------------------------
// Streaming kernels.

/// Key block length of the streaming kernels.
pub const KEY_BLOCK: usize = 64;

struct Geometry {
    heads: usize,
    sq: usize,
    sk: usize,
    dh: usize,
}

/// Forward: returns o (same element type) and lse (heads·sq, accumulation type).
fn mea_forward<T: Elem<A>, A: Acc>(q: &[T], k: &[T], v: &[T], g: &Geometry) -> (Vec<T>, Vec<A>) {
    let (sq, sk, dh) = (g.sq, g.sk, g.dh);
    let mut out = Vec::with_capacity(g.heads * sq * dh);
    let mut lse = Vec::with_capacity(g.heads * sq);
    let mut kh: Vec<A> = vec![A::ZERO; sk * dh];
    let mut vh: Vec<A> = vec![A::ZERO; sk * dh];
    let mut qi: Vec<A> = vec![A::ZERO; dh];
    let mut acc: Vec<A> = vec![A::ZERO; dh];
    let mut sblk: Vec<A> = vec![A::ZERO; KEY_BLOCK];
    for h in 0..g.heads {
        for (dst, src) in kh.iter_mut().zip(&k[h * sk * dh..(h + 1) * sk * dh]) {
            *dst = src.to_acc();
        }
        for (dst, src) in vh.iter_mut().zip(&v[h * sk * dh..(h + 1) * sk * dh]) {
            *dst = src.to_acc();
        }
        for i in 0..sq {
            let row = &q[(h * sq + i) * dh..(h * sq + i + 1) * dh];
            for (dst, src) in qi.iter_mut().zip(row) {
                *dst = src.to_acc();
            }
            acc.iter_mut().for_each(|x| *x = A::ZERO);
            let mut m = A::NEG_INF;
            let mut l = A::ZERO;
            let mut j0 = 0;
            while j0 < sk {
                let j1 = (j0 + KEY_BLOCK).min(sk);
                let mut bmax = A::NEG_INF;
                for j in j0..j1 {
                    let kj = &kh[j * dh..(j + 1) * dh];
                    let mut s = A::ZERO;
                    for d in 0..dh {
                        s += qi[d] * kj[d];
                    }
                    sblk[j - j0] = s;
                    if s > bmax {
                        bmax = s;
                    }
                }
                let m_new = if bmax > m { bmax } else { m };
                let corr = if m == A::NEG_INF {
                    A::ZERO
                } else {
                    (m - m_new).exp()
                };
                l *= corr;
                for a in acc.iter_mut() {
                    *a *= corr;
                }
                for j in j0..j1 {
                    let p = (sblk[j - j0] - m_new).exp();
                    l += p;
                    let vj = &vh[j * dh..(j + 1) * dh];
                    for d in 0..dh {
                        acc[d] += p * vj[d];
                    }
                }
                m = m_new;
                j0 = j1;
            }
            for a in &acc {
                out.push(T::from_acc(*a / l));
            }
            lse.push(m + l.ln());
        }
    }
    (out, lse)
}

/// Backward: returns dq, dk, dv.
#[allow(clippy::too_many_arguments)]
fn mea_backward<T: Elem<A>, A: Acc>(
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    go: &[T],
    lse: &[A],
    g: &Geometry,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (sq, sk, dh) = (g.sq, g.sk, g.dh);
    let mut dq_out = Vec::with_capacity(g.heads * sq * dh);
    let mut dk_out = Vec::with_capacity(g.heads * sk * dh);
    let mut dv_out = Vec::with_capacity(g.heads * sk * dh);
    let load = |dst: &mut Vec<A>, src: &[T]| {
        dst.clear();
        dst.extend(src.iter().map(|x| x.to_acc()));
    };
    let (mut kh, mut vh, mut dk, mut dv) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut qi, mut gi, mut dqi) = (Vec::new(), Vec::new(), vec![A::ZERO; dh]);
    for h in 0..g.heads {
        load(&mut kh, &k[h * sk * dh..(h + 1) * sk * dh]);
        load(&mut vh, &v[h * sk * dh..(h + 1) * sk * dh]);
        dk.clear();
        dk.resize(sk * dh, A::ZERO);
        dv.clear();
        dv.resize(sk * dh, A::ZERO);
        for i in 0..sq {
            let r = (h * sq + i) * dh..(h * sq + i + 1) * dh;
            load(&mut qi, &q[r.clone()]);
            load(&mut gi, &go[r.clone()]);
            let mut delta = A::ZERO;
            for (a, b) in gi.iter().zip(&o[r]) {
                delta += *a * b.to_acc();
            }
            let li = lse[h * sq + i];
            dqi.iter_mut().for_each(|x| *x = A::ZERO);
            for j in 0..sk {
                let kj = &kh[j * dh..(j + 1) * dh];
                let vj = &vh[j * dh..(j + 1) * dh];
                let mut s = A::ZERO;
                let mut dp = A::ZERO;
                for d in 0..dh {
                    s += qi[d] * kj[d];
                    dp += gi[d] * vj[d];
                }
                let p = (s - li).exp();
                let ds = p * (dp - delta);
                let dkj = &mut dk[j * dh..(j + 1) * dh];
                for d in 0..dh {
                    dqi[d] += ds * kj[d];
                    dkj[d] += ds * qi[d];
                }
                let dvj = &mut dv[j * dh..(j + 1) * dh];
                for d in 0..dh {
                    dvj[d] += p * gi[d];
                }
            }
            dq_out.extend(dqi.iter().map(|x| T::from_acc(*x)));
        }
        dk_out.extend(dk.iter().map(|x| T::from_acc(*x)));
        dv_out.extend(dv.iter().map(|x| T::from_acc(*x)));
    }
    (dq_out, dk_out, dv_out)
}

/// Memory-efficient attention as a candle custom op. Create one per call.
#[derive(Debug, Default)]
pub struct MemEffAttention {
    /// The log-sum-exp (b, a, s) in f32 (f64 for f64 inputs), set by the forward.
    lse: Mutex<Option<Tensor>>,
}

impl MemEffAttention {
    pub fn new() -> Self {
        Self::default()
    }

    /// o = softmax(q·kᵀ)·v over (b, a, s, dh) tensors, differentiable.
    pub fn apply(q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        q.apply_op3(k, v, MemEffAttention::new())
    }
}

fn geometry(lq: &Layout, lk: &Layout, lv: &Layout) -> candle_core::Result<Geometry> {
    let (b, a, sq, dh) = dims4(lq)?;
    let (bk, ak, sk, dk) = dims4(lk)?;
    if (bk, ak, dk) != (b, a, dh) || lv.dims() != lk.dims() {
        return Err(err(format!(
            "attention shapes disagree: q {:?}, k {:?}, v {:?}",
            lq.dims(),
            lk.dims(),
            lv.dims()
        )));
    }
    Ok(Geometry {
        heads: b * a,
        sq,
        sk,
        dh,
    })
}

impl CustomOp3 for MemEffAttention {
    fn name(&self) -> &'static str {
        "memory-efficient-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let g = geometry(l1, l2, l3)?;
        let dims = l1.dims().to_vec();
        let lse_dims = &dims[..3];
        let dev = candle_core::Device::Cpu;
        macro_rules! run {
            ($q:expr, $k:expr, $v:expr, $variant:ident, $acc:ty) => {{
                let (q, k, v) = (
                    contiguous_slice($q, l1)?,
                    contiguous_slice($k, l2)?,
                    contiguous_slice($v, l3)?,
                );
                let (o, lse) = mea_forward::<_, $acc>(q, k, v, &g);
                (
                    CpuStorage::$variant(o),
                    Tensor::from_vec(lse, lse_dims, &dev)?,
                )
            }};
        }
        let (out, lse) = match (s1, s2, s3) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => run!(q, k, v, F32, f32),
            (CpuStorage::F64(q), CpuStorage::F64(k), CpuStorage::F64(v)) => run!(q, k, v, F64, f64),
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => run!(q, k, v, BF16, f32),
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => run!(q, k, v, F16, f32),
            _ => {
                return Err(err(format!(
                    "memory-efficient attention supports f64/f32/bf16/f16 with one dtype for q, k, v; got {:?}, {:?}, {:?}",
                    s1.dtype(),
                    s2.dtype(),
                    s3.dtype()
                )))
            }
        };
        *self.lse.lock().map_err(|_| err("lse lock poisoned"))? = Some(lse);
        Ok((out, Shape::from(dims)))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self
            .lse
            .lock()
            .map_err(|_| err("lse lock poisoned"))?
            .clone()
            .ok_or_else(|| err("memory-efficient attention backward before forward"))?;
        let go = grad_res.contiguous()?;
        let (q, k, v, o) = (
            q.contiguous()?,
            k.contiguous()?,
            v.contiguous()?,
            res.contiguous()?,
        );
        let g = geometry(q.layout(), k.layout(), v.layout())?;
        let dev = q.device().clone();
        let (qs, ql) = q.storage_and_layout();
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (os, ol) = o.storage_and_layout();
        let (gs, gl) = go.storage_and_layout();
        let (ls, ll) = lse.storage_and_layout();
        // Borrow the CPU storages without copying where possible.
        let views = (&*qs, &*ks, &*vs, &*os, &*gs, &*ls);
        macro_rules! run {
            ($variant:ident, $acc:ident, $accty:ty) => {{
                let (
                    Storage::Cpu(CpuStorage::$variant(qv)),
                    Storage::Cpu(CpuStorage::$variant(kv)),
                    Storage::Cpu(CpuStorage::$variant(vv)),
                    Storage::Cpu(CpuStorage::$variant(ov)),
                    Storage::Cpu(CpuStorage::$variant(gv)),
                    Storage::Cpu(CpuStorage::$acc(lv)),
                ) = views
                else {
                    return Err(err(
                        "memory-efficient attention backward: CPU tensors of one dtype expected",
                    ));
                };
                let (dq, dk, dv) = mea_backward::<_, $accty>(
                    contiguous_slice(qv, ql)?,
                    contiguous_slice(kv, kl)?,
                    contiguous_slice(vv, vl)?,
                    contiguous_slice(ov, ol)?,
                    contiguous_slice(gv, gl)?,
                    contiguous_slice(lv, ll)?,
                    &g,
                );
                (
                    Tensor::from_vec(dq, ql.dims(), &dev)?,
                    Tensor::from_vec(dk, kl.dims(), &dev)?,
                    Tensor::from_vec(dv, vl.dims(), &dev)?,
                )
            }};
        }
        let (dq, dk, dv) = match q.dtype() {
            DType::F32 => run!(F32, F32, f32),
            DType::F64 => run!(F64, F64, f64),
            DType::BF16 => run!(BF16, F32, f32),
            DType::F16 => run!(F16, F32, f32),
            other => {
                return Err(err(format!(
                    "memory-efficient attention: unsupported dtype {other:?}"
                )))
            }
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

// ---------------------------------------------------------------------------------------------
// Attention-only recompute.

/// The attention core of the attention-only recompute policy (see the module docs).
struct RecomputeCore {
    /// The output computed without tracking before the op was applied; taken by `cpu_fwd`.
    pending: Mutex<Option<Tensor>>,
    accum: DType,
    dropout: Option<Dropout>,
}

/// Attention whose probabilities are recomputed in backward instead of stored.
///
/// Forward runs [`attention_materialized`] untracked (P is transient), then the op copies that
/// output into its own storage (one transient extra o). The graph keeps q, k, v and o only.
pub fn attention_recompute_core(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    accum: DType,
    dropout: Option<Dropout>,
) -> candle_core::Result<Tensor> {
    let o = attention_materialized(&q.detach(), &k.detach(), &v.detach(), accum, dropout)?;
    let op = RecomputeCore {
        pending: Mutex::new(Some(o)),
        accum,
        dropout,
    };
    q.apply_op3(k, v, op)
}

impl CustomOp3 for RecomputeCore {
    fn name(&self) -> &'static str {
        "attention-recompute-core"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let o = self
            .pending
            .lock()
            .map_err(|_| err("attention core lock poisoned"))?
            .take()
            .ok_or_else(|| err("attention core applied twice"))?;
        let (st, l) = o.storage_and_layout();
        let n = l.shape().elem_count();
        match (&*st, l.contiguous_offsets()) {
            (Storage::Cpu(c), Some((0, end))) if end == n => Ok((c.clone(), l.shape().clone())),
            _ => Err(err(
                "attention core: expected a fresh contiguous CPU output",
            )),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (qv, kv, vv) = (
            Var::from_tensor(&q.detach())?,
            Var::from_tensor(&k.detach())?,
            Var::from_tensor(&v.detach())?,
        );
        let o = attention_materialized(
            qv.as_tensor(),
            kv.as_tensor(),
            vv.as_tensor(),
            self.accum,
            self.dropout,
        )?;
        let grads = o.mul(&grad_res.detach())?.sum_all()?.backward()?;
        drop(o);
        let take = |t: &Var| grads.get(t.as_tensor()).map(Tensor::detach);
        Ok((take(&qv), take(&kv), take(&vv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn rand(dims: &[usize], seed: u64) -> Tensor {
        let mut r = SplitMix64::new(seed);
        let n: usize = dims.iter().product();
        let v: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    }

    #[test]
    fn mem_efficient_matches_materialized_f64() {
        // s = 100 spans two key blocks.
        let dims = [2, 3, 100, 8];
        let (q, k, v) = (
            Var::from_tensor(&rand(&dims, 1)).unwrap(),
            Var::from_tensor(&rand(&dims, 2)).unwrap(),
            Var::from_tensor(&rand(&dims, 3)).unwrap(),
        );
        let go = rand(&dims, 4);
        let o1 = attention_materialized(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            DType::F64,
            None,
        )
        .unwrap();
        let o2 = MemEffAttention::apply(q.as_tensor(), k.as_tensor(), v.as_tensor()).unwrap();
        assert!(max_abs_diff(&o1, &o2) < 1e-12);
        let g1 = o1.mul(&go).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = o2.mul(&go).unwrap().sum_all().unwrap().backward().unwrap();
        for t in [&q, &k, &v] {
            let a = g1.get(t.as_tensor()).unwrap();
            let b = g2.get(t.as_tensor()).unwrap();
            let d = max_abs_diff(a, b);
            assert!(d < 1e-12, "grad differs by {d}");
        }
    }

    #[test]
    fn recompute_core_matches_materialized_with_dropout() {
        let dims = [1, 2, 20, 4];
        let (q, k, v) = (
            Var::from_tensor(&rand(&dims, 5)).unwrap(),
            Var::from_tensor(&rand(&dims, 6)).unwrap(),
            Var::from_tensor(&rand(&dims, 7)).unwrap(),
        );
        let go = rand(&dims, 8);
        let d = Some(Dropout { p: 0.3, seed: 11 });
        let o1 = attention_materialized(q.as_tensor(), k.as_tensor(), v.as_tensor(), DType::F64, d)
            .unwrap();
        let o2 =
            attention_recompute_core(q.as_tensor(), k.as_tensor(), v.as_tensor(), DType::F64, d)
                .unwrap();
        assert_eq!(max_abs_diff(&o1, &o2), 0.0);
        let g1 = o1.mul(&go).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = o2.mul(&go).unwrap().sum_all().unwrap().backward().unwrap();
        for t in [&q, &k, &v] {
            let diff = max_abs_diff(
                g1.get(t.as_tensor()).unwrap(),
                g2.get(t.as_tensor()).unwrap(),
            );
            assert_eq!(diff, 0.0);
        }
    }

    #[test]
    fn mem_efficient_half_dtypes_run() {
        let dims = [1, 2, 70, 8];
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let q = Var::from_tensor(&rand(&dims, 1).to_dtype(dt).unwrap()).unwrap();
            let k = rand(&dims, 2).to_dtype(dt).unwrap();
            let v = rand(&dims, 3).to_dtype(dt).unwrap();
            let o1 = attention_materialized(q.as_tensor(), &k, &v, DType::F32, None).unwrap();
            let o2 = MemEffAttention::apply(q.as_tensor(), &k, &v).unwrap();
            let d = max_abs_diff(
                &o1.to_dtype(DType::F64).unwrap(),
                &o2.to_dtype(DType::F64).unwrap(),
            );
            assert!(d < 0.05, "{dt:?}: {d}");
            let g = o2.sum_all().unwrap().backward().unwrap();
            assert_eq!(g.get(q.as_tensor()).unwrap().dtype(), dt);
        }
    }
}
