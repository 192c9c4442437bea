//! The token concatenation and split of joint attention (SD3's `JointAttnProcessor2_0`, Flux's
//! double-stream block): [`cat_tokens`] writes each sample's image rows then its text rows into
//! one (b·(s+t), D) tensor, [`split_tokens`] copies one part back out as (b·len, D) rows. Both
//! are custom ops so that nothing chains in candle's store: the concatenation's backward returns
//! two fresh gradients (one per input, in its dtype and shape), the split's one fresh gradient
//! of its input's size, zero outside the part (candle sums the two parts' gradients of the
//! attention output in its store). Neither keeps anything. Budget twins: `joint_cat` and
//! `joint_split` of `ditmem_budget::ditmem_cpu::sd3`.

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Shape,
    Tensor, WithDType,
};

use super::storage::{cpu_slice, err, with_cpu, CResult};

/// Rows of a (rows, D) layout, checked to split into `batch` samples.
fn rows_of(l: &Layout, batch: usize, what: &str) -> CResult<(usize, usize)> {
    match l.dims() {
        &[r, d] if batch > 0 && r % batch == 0 => Ok((r / batch, d)),
        dims => Err(err(format!(
            "{what}: expected (b·tokens, D) rows for a batch of {batch}, got {dims:?}"
        ))),
    }
}

/// Per sample: `a` rows (sa each) then `c` rows (sc each), width d.
fn cat_rows<T: WithDType>(a: &[T], c: &[T], b: usize, sa: usize, sc: usize, d: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(b * (sa + sc) * d);
    for i in 0..b {
        out.extend_from_slice(&a[i * sa * d..(i + 1) * sa * d]);
        out.extend_from_slice(&c[i * sc * d..(i + 1) * sc * d]);
    }
    out
}

/// Per sample: rows `start .. start + len` of `n`, width d.
fn take_rows<T: WithDType>(
    x: &[T],
    b: usize,
    n: usize,
    start: usize,
    len: usize,
    d: usize,
) -> Vec<T> {
    let mut out = Vec::with_capacity(b * len * d);
    for i in 0..b {
        let o = (i * n + start) * d;
        out.extend_from_slice(&x[o..o + len * d]);
    }
    out
}

/// Per sample: `g` (len rows) at rows `start ..` of n zero rows.
fn put_rows<T: WithDType>(
    g: &[T],
    b: usize,
    n: usize,
    start: usize,
    len: usize,
    d: usize,
) -> Vec<T> {
    let mut out = vec![T::zero(); b * n * d];
    for i in 0..b {
        let o = (i * n + start) * d;
        out[o..o + len * d].copy_from_slice(&g[i * len * d..(i + 1) * len * d]);
    }
    out
}

macro_rules! by_dtype {
    ($s:expr, $what:expr, |$t:ident| $body:expr) => {
        match $s.dtype() {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => return Err(err(format!("{}: unsupported dtype {other:?}", $what))),
        }
    };
}

/// Per-sample concatenation of two token sets (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct CatTokens {
    batch: usize,
}

/// a (b·s, D) and c (b·t, D) of one dtype → (b·(s+t), D): sample i's s rows of a, then its t
/// rows of c (diffusers' `torch.cat([image, context], dim=2)` on the (b, heads, tokens, d_h)
/// views).
pub fn cat_tokens(a: &Tensor, c: &Tensor, batch: usize) -> CResult<Tensor> {
    a.apply_op2(c, CatTokens { batch })
}

impl CustomOp2 for CatTokens {
    fn name(&self) -> &'static str {
        "cat-tokens"
    }

    fn cpu_fwd(
        &self,
        sa: &CpuStorage,
        la: &Layout,
        sc: &CpuStorage,
        lc: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let what = "cat_tokens";
        let (na, d) = rows_of(la, self.batch, what)?;
        let (nc, dc) = rows_of(lc, self.batch, what)?;
        if d != dc || sa.dtype() != sc.dtype() {
            return Err(err(format!(
                "{what}: {:?} {:?} and {:?} {:?} differ in width or dtype",
                la.dims(),
                sa.dtype(),
                lc.dims(),
                sc.dtype()
            )));
        }
        let b = self.batch;
        let st = by_dtype!(sa, what, |T| {
            let v = cat_rows::<T>(
                cpu_slice(sa, la, what)?,
                cpu_slice(sc, lc, what)?,
                b,
                na,
                nc,
                d,
            );
            T::to_cpu_storage_owned(v)
        });
        Ok((st, Shape::from((b * (na + nc), d))))
    }

    fn bwd(
        &self,
        a: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let what = "cat_tokens backward";
        let grad = grad.contiguous()?;
        let b = self.batch;
        let (na, d) = (a.dim(0)? / b, a.dim(1)?);
        let nc = c.dim(0)? / b;
        let n = na + nc;
        let part = |start: usize, len: usize, like: &Tensor| -> CResult<Tensor> {
            with_cpu(&grad, |gs, gl| {
                by_dtype!(gs, what, |T| {
                    let v = take_rows::<T>(cpu_slice(gs, gl, what)?, b, n, start, len, d);
                    Tensor::from_vec(v, like.shape(), &Device::Cpu)
                })
            })
        };
        let da = if a.track_op() {
            Some(part(0, na, a)?)
        } else {
            None
        };
        let dc = if c.track_op() {
            Some(part(na, nc, c)?)
        } else {
            None
        };
        Ok((da, dc))
    }
}

/// One part of a per-sample token concatenation (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct SplitTokens {
    batch: usize,
    start: usize,
    len: usize,
}

/// Rows `start .. start + len` of each sample of x (b·n, D), as a fresh (b·len, D).
pub fn split_tokens(x: &Tensor, batch: usize, start: usize, len: usize) -> CResult<Tensor> {
    x.apply_op1(SplitTokens { batch, start, len })
}

impl CustomOp1 for SplitTokens {
    fn name(&self) -> &'static str {
        "split-tokens"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let what = "split_tokens";
        let (n, d) = rows_of(l, self.batch, what)?;
        if self.start + self.len > n {
            return Err(err(format!(
                "{what}: rows {}..{} of {n} per sample",
                self.start,
                self.start + self.len
            )));
        }
        let (b, st, len) = (self.batch, self.start, self.len);
        let out = by_dtype!(s, what, |T| {
            let v = take_rows::<T>(cpu_slice(s, l, what)?, b, n, st, len, d);
            T::to_cpu_storage_owned(v)
        });
        Ok((out, Shape::from((b * len, d))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let what = "split_tokens backward";
        let grad = grad.contiguous()?;
        let b = self.batch;
        let (n, d) = (arg.dim(0)? / b, arg.dim(1)?);
        let dx = with_cpu(&grad, |gs, gl| {
            by_dtype!(gs, what, |T| {
                let v = put_rows::<T>(cpu_slice(gs, gl, what)?, b, n, self.start, self.len, d);
                Tensor::from_vec(v, arg.shape(), &Device::Cpu)
            })
        })?;
        Ok(Some(dx))
    }
}
