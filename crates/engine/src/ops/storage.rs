//! What every fused op's candle side shares: the CPU storage helpers (a contiguous slice of a
//! storage, the storage of a tensor, a strided row view), the candle error of a kernel, and the
//! dtype dispatch macros that instantiate a kernel for each storage / accumulation pair.

use candle_core::{
    backend::BackendStorage, CpuStorage, Device, Layout, Shape, Storage, Tensor, WithDType,
};
use rayon::prelude::*;
use std::sync::{Mutex, MutexGuard};

pub(crate) type CResult<T> = candle_core::Result<T>;

/// Elements per parallel work item of the elementwise kernels (big enough to amortise rayon's
/// scheduling, small enough to balance two to a few dozen threads).
pub(crate) const PAR_CHUNK: usize = 1 << 14;

/// A fresh buffer of `rows`·`d` elements (each `zero` first), row r written by `f(r, row)` on
/// rayon tasks of at least [`PAR_CHUNK`] elements: the row loop of the elementwise kernels.
#[inline]
pub(crate) fn par_rows<U: Send + Clone>(
    zero: U,
    (rows, d): (usize, usize),
    f: impl Fn(usize, &mut [U]) + Sync + Send,
) -> Vec<U> {
    let mut o: Vec<U> = vec![zero; rows * d];
    o.par_chunks_mut(d)
        .enumerate()
        .with_min_len((PAR_CHUNK / d.max(1)).max(1))
        .for_each(|(r, row)| f(r, row));
    o
}

/// A tensor of `shape` over a CPU storage the kernels made (f32, f64, bf16 or f16), moved, not
/// copied.
pub(crate) fn storage_tensor(s: CpuStorage, shape: impl Into<Shape>) -> CResult<Tensor> {
    let (shape, dev) = (shape.into(), &Device::Cpu);
    match s {
        CpuStorage::F32(v) => Tensor::from_vec(v, shape, dev),
        CpuStorage::F64(v) => Tensor::from_vec(v, shape, dev),
        CpuStorage::BF16(v) => Tensor::from_vec(v, shape, dev),
        CpuStorage::F16(v) => Tensor::from_vec(v, shape, dev),
        other => Err(err(format!(
            "fused ops: unsupported dtype {:?}",
            other.dtype()
        ))),
    }
}

/// A storage an op's forward keeps for its backward, behind a lock (a custom op's forward and
/// backward take `&self`): set by the forward, read or taken by the backward, freed by
/// [`Saved::release`].
#[derive(Debug, Default)]
pub(crate) struct Saved(Mutex<Option<CpuStorage>>);

impl Saved {
    /// The slot, locked; `poisoned` is the error of a poisoned lock.
    pub(crate) fn lock(&self, poisoned: &str) -> CResult<MutexGuard<'_, Option<CpuStorage>>> {
        self.0.lock().map_err(|_| err(poisoned))
    }

    /// Frees what the slot holds (nothing to free when the lock is poisoned).
    pub(crate) fn release(&self) {
        if let Ok(mut s) = self.0.lock() {
            s.take();
        }
    }
}

/// A candle error with a message (the fused ops' input errors).
pub(crate) fn err(msg: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(msg.into())
}

/// The contiguous slice of a CPU storage under `l`.
pub(crate) fn cpu_slice<'a, T: WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> CResult<&'a [T]> {
    let v = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) if b <= v.len() => Ok(&v[a..b]),
        // A buffer freed by `release` (or a layout beyond its storage): an error, not a panic.
        Some((_, b)) => Err(err(format!(
            "{what}: reads {b} elements of a storage of {} (a released tensor)",
            v.len()
        ))),
        None => Err(err(format!("{what}: expected a contiguous tensor"))),
    }
}

/// [`cpu_slice`] of several storages of one dtype, in order.
pub(crate) fn cpu_slices<'a, T: WithDType, const N: usize>(
    ins: [(&'a CpuStorage, &Layout); N],
    what: &str,
) -> CResult<[&'a [T]; N]> {
    let mut out: [&[T]; N] = [&[]; N];
    for (o, (s, l)) in out.iter_mut().zip(ins) {
        *o = cpu_slice::<T>(s, l, what)?;
    }
    Ok(out)
}

/// Runs `f` on the CPU storage and layout of `t`.
pub(crate) fn with_cpu<R>(
    t: &Tensor,
    f: impl FnOnce(&CpuStorage, &Layout) -> CResult<R>,
) -> CResult<R> {
    let (st, l) = t.storage_and_layout();
    match &*st {
        Storage::Cpu(c) => f(c, l),
        _ => Err(err("fused ops: only CPU tensors have a kernel so far")),
    }
}

/// Runs `f` on the CPU storages and layouts of `ts`, all held at once ([`with_cpu`] for several
/// tensors, in order).
pub(crate) fn with_cpus<const N: usize, R>(
    ts: [&Tensor; N],
    f: impl FnOnce([(&CpuStorage, &Layout); N]) -> CResult<R>,
) -> CResult<R> {
    let held = ts.map(|t| t.storage_and_layout());
    let mut cpu: [Option<(&CpuStorage, &Layout)>; N] = [None; N];
    for (c, (st, l)) in cpu.iter_mut().zip(&held) {
        match &**st {
            Storage::Cpu(s) => *c = Some((s, *l)),
            _ => return Err(err("fused ops: only CPU tensors have a kernel so far")),
        }
    }
    f(cpu.map(|c| c.expect("every storage was matched as a CPU one above")))
}

/// A (rows, d) matrix view with unit column stride: (start offset, row stride). The adaLN chunks
/// are `narrow` views of a (b, 6D) tensor, so rows are 6D apart.
pub(crate) fn rows_view(l: &Layout, rows: usize, d: usize, what: &str) -> CResult<(usize, usize)> {
    match (l.dims(), l.stride()) {
        (&[r, c], &[rs, 1]) if r == rows && c == d => Ok((l.start_offset(), rs)),
        (&[r, c], &[_, 1]) if r == rows && c == d && r == 1 => Ok((l.start_offset(), d)),
        (dims, stride) => Err(err(format!(
            "{what}: expected a ({rows}, {d}) matrix with unit column stride, got dims {dims:?} stride {stride:?}"
        ))),
    }
}

/// Dispatches on one float dtype: storage `$t` and accumulation `$a` (f64 for f64, else f32).
macro_rules! dispatch_float {
    ($dt:expr, $what:expr, |$t:ident, $a:ident| $body:expr) => {
        match $dt {
            DType::F32 => {
                type $t = f32;
                type $a = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                type $a = f64;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                type $a = f32;
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                type $a = f32;
                $body
            }
            other => return Err(err(format!("{}: unsupported dtype {other:?}", $what))),
        }
    };
}
pub(crate) use dispatch_float;

/// Dispatches on (x dtype, output dtype); statistics accumulate in f64 for f64 x, else in f32.
macro_rules! dispatch_ln {
    ($xdt:expr, $odt:expr, |$t:ident, $o:ident, $a:ident| $body:expr) => {{
        macro_rules! inner {
            ($tt:ty, $aa:ty) => {
                match $odt {
                    DType::F32 => {
                        type $t = $tt;
                        type $a = $aa;
                        type $o = f32;
                        $body
                    }
                    DType::F64 => {
                        type $t = $tt;
                        type $a = $aa;
                        type $o = f64;
                        $body
                    }
                    DType::BF16 => {
                        type $t = $tt;
                        type $a = $aa;
                        type $o = half::bf16;
                        $body
                    }
                    DType::F16 => {
                        type $t = $tt;
                        type $a = $aa;
                        type $o = half::f16;
                        $body
                    }
                    other => {
                        return Err(err(format!(
                            "ln_modulate: unsupported output dtype {other:?}"
                        )))
                    }
                }
            };
        }
        match $xdt {
            DType::F32 => inner!(f32, f32),
            DType::F64 => inner!(f64, f64),
            DType::BF16 => inner!(half::bf16, f32),
            DType::F16 => inner!(half::f16, f32),
            other => {
                return Err(err(format!(
                    "ln_modulate: x must be a float tensor, got {other:?}"
                )))
            }
        }
    }};
}

pub(crate) use dispatch_ln;
