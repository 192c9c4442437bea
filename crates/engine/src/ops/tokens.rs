//! Per-sample concatenation and slicing as custom ops, for the joint sequences of SD3 and Flux:
//! [`concat`] writes, for each of `batch` samples, a's part then b's part (the [text; image]
//! token sequence, or the single-stream block's [attention; MLP] features of each row), and
//! [`slice`] copies one range of each sample's part (the text or image tokens of the joint
//! attention's output, the image tokens of the last stream); [`cat_tokens`] and
//! [`split_tokens`] are the two on (b·tokens, D) rows (SD3's `JointAttnProcessor2_0`). candle's `cat` backward narrows the gradient
//! and adds it into zeros, and `narrow` + `contiguous` pads each gradient back with zeros and a
//! concatenation; these return fresh gradients directly: `concat` one per tracked input (its
//! part of g), `slice` one x-sized gradient, zero outside the range. Neither keeps anything nor
//! uses scratch. Budget twins: `concat` / `slice` of `ditmem_budget::ditmem_cpu::ops`.

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, WithDType,
};

use super::storage::{err, storage_tensor, with_cpu, CResult};
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};

/// Applies `f` to the contiguous slice of `s` under `l` for every float dtype.
macro_rules! on_slice {
    ($s:expr, $l:expr, $what:expr, |$v:ident| $body:expr) => {
        match $s.dtype() {
            DType::F32 => {
                let $v = super::storage::cpu_slice::<f32>($s, $l, $what)?;
                f32::to_cpu_storage_owned($body)
            }
            DType::F64 => {
                let $v = super::storage::cpu_slice::<f64>($s, $l, $what)?;
                f64::to_cpu_storage_owned($body)
            }
            DType::BF16 => {
                let $v = super::storage::cpu_slice::<half::bf16>($s, $l, $what)?;
                half::bf16::to_cpu_storage_owned($body)
            }
            DType::F16 => {
                let $v = super::storage::cpu_slice::<half::f16>($s, $l, $what)?;
                half::f16::to_cpu_storage_owned($body)
            }
            other => return Err(err(format!("{}: unsupported dtype {other:?}", $what))),
        }
    };
}

/// Per-sample concatenation (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct Concat {
    batch: usize,
    shape: Shape,
}

/// For each of `batch` samples, a's part then b's part (a and b of one dtype, each a whole
/// number of samples) → a fresh tensor of `shape`.
pub fn concat(a: &Tensor, b: &Tensor, batch: usize, shape: impl Into<Shape>) -> CResult<Tensor> {
    let shape = shape.into();
    if batch == 0
        || !a.elem_count().is_multiple_of(batch)
        || !b.elem_count().is_multiple_of(batch)
        || shape.elem_count() != a.elem_count() + b.elem_count()
        || a.dtype() != b.dtype()
    {
        return Err(err(format!(
            "concat: {:?} {:?} and {:?} {:?} are not {batch} samples each of one dtype making {:?}",
            a.dims(),
            a.dtype(),
            b.dims(),
            b.dtype(),
            shape.dims()
        )));
    }
    a.apply_op2(b, Op(Concat { batch, shape }))
}

fn concat_cpu<T: Copy>(a: &[T], b: &[T], batch: usize) -> Vec<T> {
    let (pa, pb) = (a.len() / batch, b.len() / batch);
    let mut o = Vec::with_capacity(a.len() + b.len());
    for i in 0..batch {
        o.extend_from_slice(&a[i * pa..(i + 1) * pa]);
        o.extend_from_slice(&b[i * pb..(i + 1) * pb]);
    }
    o
}

/// Copies [lo, hi) of each of `batch` parts of x.
fn slice_cpu<T: Copy>(x: &[T], batch: usize, (lo, hi): (usize, usize)) -> Vec<T> {
    let p = x.len() / batch;
    let mut o = Vec::with_capacity(batch * (hi - lo));
    for i in 0..batch {
        o.extend_from_slice(&x[i * p + lo..i * p + hi]);
    }
    o
}

/// [`concat`]'s kernel on storages: for each of `batch` parts, a's then b's (one float dtype).
/// The fused MLP with a side input builds its fc2 input with it.
pub(crate) fn concat_storage(
    (sa, la): (&CpuStorage, &Layout),
    (sb, lb): (&CpuStorage, &Layout),
    batch: usize,
) -> CResult<CpuStorage> {
    if sa.dtype() != sb.dtype() {
        return Err(err("concat: a and b must share one float dtype"));
    }
    macro_rules! go {
        ($t:ty) => {{
            let a = super::storage::cpu_slice::<$t>(sa, la, "concat a")?;
            let b = super::storage::cpu_slice::<$t>(sb, lb, "concat b")?;
            <$t>::to_cpu_storage_owned(concat_cpu(a, b, batch))
        }};
    }
    Ok(match sa.dtype() {
        DType::F32 => go!(f32),
        DType::F64 => go!(f64),
        DType::BF16 => go!(half::bf16),
        DType::F16 => go!(half::f16),
        other => return Err(err(format!("concat: unsupported dtype {other:?}"))),
    })
}

/// [`slice`]'s kernel on a storage: [lo, hi) of each of `batch` parts, copied.
pub(crate) fn slice_storage(
    (s, l): (&CpuStorage, &Layout),
    batch: usize,
    range: (usize, usize),
) -> CResult<CpuStorage> {
    Ok(on_slice!(s, l, "slice", |x| slice_cpu(x, batch, range)))
}

/// Writes g's parts at [lo, hi) of each of `batch` parts of width `p`, zeros elsewhere.
fn unslice_cpu<T: Copy + Default>(g: &[T], batch: usize, p: usize, lo: usize) -> Vec<T> {
    let w = g.len() / batch;
    let mut o = vec![T::default(); batch * p];
    for i in 0..batch {
        o[i * p + lo..i * p + lo + w].copy_from_slice(&g[i * w..(i + 1) * w]);
    }
    o
}

impl CpuOp<2> for Concat {
    fn name(&self) -> &'static str {
        "concat"
    }

    fn fwd(&self, [(sa, la), (sb, lb)]: [Cpu<'_>; 2]) -> CResult<(CpuStorage, Shape)> {
        let out = match (sa, sb) {
            (CpuStorage::F32(_), CpuStorage::F32(_))
            | (CpuStorage::F64(_), CpuStorage::F64(_))
            | (CpuStorage::BF16(_), CpuStorage::BF16(_))
            | (CpuStorage::F16(_), CpuStorage::F16(_)) => {
                macro_rules! go {
                    ($t:ty) => {{
                        let a = super::storage::cpu_slice::<$t>(sa, la, "concat a")?;
                        let b = super::storage::cpu_slice::<$t>(sb, lb, "concat b")?;
                        <$t>::to_cpu_storage_owned(concat_cpu(a, b, self.batch))
                    }};
                }
                match sa.dtype() {
                    DType::F32 => go!(f32),
                    DType::F64 => go!(f64),
                    DType::BF16 => go!(half::bf16),
                    _ => go!(half::f16),
                }
            }
            _ => return Err(err("concat: a and b must share one float dtype")),
        };
        Ok((out, self.shape.clone()))
    }

    fn bwd(&self, [a, b]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> Grads<2> {
        let grad = grad.contiguous()?;
        let pa = a.elem_count() / self.batch;
        let pw = grad.elem_count() / self.batch;
        let part = |lo: usize, hi: usize, shape: &Shape| -> CResult<Tensor> {
            let s = with_cpu(&grad, |sg, lg| {
                Ok(on_slice!(sg, lg, "concat backward", |g| slice_cpu(
                    g,
                    self.batch,
                    (lo, hi)
                )))
            })?;
            storage_tensor(s, shape.clone())
        };
        let da = if a.track_op() {
            Some(part(0, pa, a.shape())?)
        } else {
            None
        };
        let db = if b.track_op() {
            Some(part(pa, pw, b.shape())?)
        } else {
            None
        };
        Ok([da, db])
    }
}

/// Width of (rows, D) rows, checked to split into `batch` samples.
fn rows_of(x: &Tensor, batch: usize, what: &str) -> CResult<(usize, usize)> {
    match x.dims() {
        &[r, d] if batch > 0 && r.is_multiple_of(batch) => Ok((r, d)),
        dims => Err(err(format!(
            "{what}: expected (b·tokens, D) rows for a batch of {batch}, got {dims:?}"
        ))),
    }
}

/// [`concat`] of (b·s, D) and (b·t, D) rows of one width → (b·(s+t), D).
pub fn cat_tokens(a: &Tensor, c: &Tensor, batch: usize) -> CResult<Tensor> {
    let (ra, d) = rows_of(a, batch, "cat_tokens a")?;
    let (rc, dc) = rows_of(c, batch, "cat_tokens c")?;
    if dc != d {
        return Err(err(format!("cat_tokens: widths {d} and {dc} differ")));
    }
    concat(a, c, batch, (ra + rc, d))
}

/// [`slice`] of rows `start .. start + len` of each sample of (b·n, D) rows → (b·len, D).
pub fn split_tokens(x: &Tensor, batch: usize, start: usize, len: usize) -> CResult<Tensor> {
    let (_, d) = rows_of(x, batch, "split_tokens")?;
    slice(x, batch, (start * d, (start + len) * d), (batch * len, d))
}

/// Per-sample slice (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct Slice {
    batch: usize,
    range: (usize, usize),
    shape: Shape,
}

/// Copies elements [lo, hi) of each of `batch` parts of x → a fresh tensor of `shape`.
pub fn slice(
    x: &Tensor,
    batch: usize,
    (lo, hi): (usize, usize),
    shape: impl Into<Shape>,
) -> CResult<Tensor> {
    let shape = shape.into();
    let ok = batch > 0
        && x.elem_count().is_multiple_of(batch)
        && lo <= hi
        && hi <= x.elem_count() / batch
        && shape.elem_count() == batch * (hi - lo);
    if !ok {
        return Err(err(format!(
            "slice: [{lo}, {hi}) of {batch} parts of {:?} does not make {:?}",
            x.dims(),
            shape.dims()
        )));
    }
    x.apply_op1(Slice {
        batch,
        range: (lo, hi),
        shape,
    })
}

impl CustomOp1 for Slice {
    fn name(&self) -> &'static str {
        "slice"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let out = on_slice!(s, l, "slice", |x| slice_cpu(x, self.batch, self.range));
        Ok((out, self.shape.clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let p = arg.elem_count() / self.batch;
        let lo = self.range.0;
        let s = with_cpu(&grad, |sg, lg| {
            Ok(on_slice!(sg, lg, "slice backward", |g| unslice_cpu(
                g, self.batch, p, lo
            )))
        })?;
        Ok(Some(storage_tensor(s, arg.shape().clone())?))
    }
}
