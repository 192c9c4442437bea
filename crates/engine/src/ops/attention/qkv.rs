//! [`qkv_attention`] and its node [`QkvAttention`] (see [`super`]). A file of its own, re-exported
//! by `attention/mod.rs`, so that the projected attention (`projected.rs`) builds on it without
//! a circle through the folder's `mod.rs` (`crates/cli/tests/no_import_cycles.rs`).

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, WithDType,
};

use super::bf16;
use super::dropout::Dropout;
use super::generic::{attn_bwd_cpu, attn_bwd_cpu_over, attn_fwd_cpu};
use super::geom::{attn_geom, AttnKeep};
use super::head::BwdIn;
use crate::ops::linear::storage_tensor;
use crate::ops::storage::Saved;
use crate::ops::storage::{cpu_slice, dispatch_float, err, with_cpus, CResult};

/// Attention over the (b·s, 3D) output of the qkv projection, written as (b·s, D): q, k, v are
/// read in place (no narrow, no transposes, no contiguous copies), the output already has the
/// layout the output projection wants, and the gradient comes back as one (b·s, 3D) tensor, so
/// candle never pads a narrow's gradient. Heads run in parallel, each on a private scratch of
/// accumulation-type buffers; every product is a `gemm` call.
#[derive(Debug)]
pub(crate) struct QkvAttention {
    batch: usize,
    heads: usize,
    keep: AttnKeep,
    dropout: Option<Dropout>,
    /// Whether the input tracks: an untracked forward saves nothing.
    track: bool,
    saved: Saved,
}

/// Fused attention from the qkv projection (see [`QkvAttention`]).
pub fn qkv_attention(
    qkv: &Tensor,
    batch: usize,
    heads: usize,
    keep: AttnKeep,
    dropout: Option<Dropout>,
) -> CResult<Tensor> {
    qkv.apply_op1(QkvAttention::new(
        batch,
        heads,
        keep,
        dropout,
        qkv.track_op(),
    )?)
}

impl QkvAttention {
    /// The op's settings; dropout needs the materialized kernels (the streaming one has no
    /// mask), and a dropout of p = 0 is none. `track`: whether the forward saves for a backward.
    pub(super) fn new(
        batch: usize,
        heads: usize,
        keep: AttnKeep,
        dropout: Option<Dropout>,
        track: bool,
    ) -> CResult<QkvAttention> {
        if dropout.is_some() && keep == AttnKeep::LogSumExp {
            return Err(err(
                "attention dropout needs materialized attention (the streaming kernel has no mask)",
            ));
        }
        Ok(QkvAttention {
            batch,
            heads,
            keep,
            dropout: dropout.filter(|d| d.p > 0.0),
            track,
            saved: Saved::default(),
        })
    }

    /// The attention's forward on the qkv storage: the output (b·s, D), with what the op keeps
    /// for its backward saved when it tracks.
    pub(super) fn attn_fwd(&self, st: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let g = attn_geom(l, self.batch, self.heads)?;
        if st.dtype() == DType::BF16 && bf16::applies() {
            let qkv = cpu_slice::<half::bf16>(st, l, "attention qkv")?;
            let (o, saved) = if self.keep == AttnKeep::LogSumExp {
                bf16::forward_streaming(qkv, &g, self.track)
            } else {
                bf16::forward(qkv, &g, self.keep, self.dropout, self.track)
            };
            *self.saved.lock("attention lock poisoned")? = saved;
            return Ok((CpuStorage::BF16(o), Shape::from((g.b * g.s, g.d()))));
        }
        let (out, saved) = dispatch_float!(st.dtype(), "attention", |T, A| {
            let qkv = cpu_slice::<T>(st, l, "attention qkv")?;
            let (o, saved) = attn_fwd_cpu::<T, A>(qkv, &g, self.keep, self.dropout, self.track);
            (T::to_cpu_storage_owned(o), saved)
        });
        *self.saved.lock("attention lock poisoned")? = saved;
        Ok((out, Shape::from((g.b * g.s, g.d()))))
    }

    /// The attention's backward: dqkv (b·s, 3D) as a bare storage, from qkv, the output and
    /// its gradient (contiguous).
    fn dqkv(
        &self,
        (sq, lq): (&CpuStorage, &Layout),
        (so, lo): (&CpuStorage, &Layout),
        (sg, lg): (&CpuStorage, &Layout),
    ) -> CResult<CpuStorage> {
        let guard = self.saved.lock("attention lock poisoned")?;
        let g = attn_geom(lq, self.batch, self.heads)?;
        if sq.dtype() == DType::BF16 && bf16::applies() {
            let n = "attention";
            let (qkv, go) = (
                cpu_slice::<half::bf16>(sq, lq, n)?,
                cpu_slice::<half::bf16>(sg, lg, n)?,
            );
            let dqkv = if self.keep == AttnKeep::LogSumExp {
                let o = cpu_slice::<half::bf16>(so, lo, n)?;
                bf16::backward_streaming(qkv, o, go, guard.as_ref(), &g)?
            } else {
                bf16::backward(qkv, go, guard.as_ref(), &g, self.keep, self.dropout)?
            };
            return Ok(CpuStorage::BF16(dqkv));
        }
        drop(guard);
        self.generic_dqkv(QkvIn::Shared(sq), lq, (so, lo), (sg, lg))
    }

    /// The generic kernels' backward: dqkv fresh beside a shared qkv, or written over an owned
    /// one.
    fn generic_dqkv(
        &self,
        qkv: QkvIn<'_>,
        lq: &Layout,
        (so, lo): (&CpuStorage, &Layout),
        (sg, lg): (&CpuStorage, &Layout),
    ) -> CResult<CpuStorage> {
        let guard = self.saved.lock("attention lock poisoned")?;
        let g = attn_geom(lq, self.batch, self.heads)?;
        let mode = (self.keep, self.dropout);
        Ok(dispatch_float!(
            qkv.dtype(),
            "attention backward",
            |T, A| {
                let ins = BwdIn::<T>::read((so, lo), (sg, lg), guard.as_ref(), mode)?;
                match qkv {
                    QkvIn::Shared(sq) => {
                        let qkv = cpu_slice::<T>(sq, lq, "attention qkv")?;
                        T::to_cpu_storage_owned(attn_bwd_cpu::<T, A>(qkv, &ins, &g)?)
                    }
                    QkvIn::Owned(st) => {
                        let mut v = T::cpu_storage_data(st)?;
                        attn_bwd_cpu_over::<T, A>(&mut v, &ins, &g)?;
                        T::to_cpu_storage_owned(v)
                    }
                }
            }
        ))
    }
}

/// qkv for [`QkvAttention::generic_dqkv`]: borrowed (dqkv fresh) or owned (dqkv over it).
enum QkvIn<'a> {
    Shared(&'a CpuStorage),
    Owned(CpuStorage),
}

impl QkvIn<'_> {
    fn dtype(&self) -> DType {
        match self {
            QkvIn::Shared(s) => s.dtype(),
            QkvIn::Owned(s) => s.dtype(),
        }
    }
}

impl QkvAttention {
    /// [`Self::dqkv`] from an owned qkv (contiguous, (b·s, 3D)): on the generic kernels dqkv is
    /// written over qkv's own buffer (`generic::attn_bwd_cpu_over`), so only one (b·s, 3D)
    /// buffer exists; on the AVX512-BF16 kernels (which read q, k, v in place through the whole
    /// head) dqkv is fresh and qkv is freed once it is made. The same bits either way.
    pub(super) fn dqkv_from_owned(
        &self,
        qkv: CpuStorage,
        lq: &Layout,
        (so, lo): (&CpuStorage, &Layout),
        (sg, lg): (&CpuStorage, &Layout),
    ) -> CResult<CpuStorage> {
        if qkv.dtype() == DType::BF16 && bf16::applies() {
            return self.dqkv((&qkv, lq), (so, lo), (sg, lg));
        }
        if !lq.is_contiguous() || lq.start_offset() != 0 {
            return Err(err(
                "attention backward: the owned qkv must be contiguous and whole",
            ));
        }
        self.generic_dqkv(QkvIn::Owned(qkv), lq, (so, lo), (sg, lg))
    }
}

impl CustomOp1 for QkvAttention {
    fn name(&self) -> &'static str {
        "qkv-attention"
    }

    fn cpu_fwd(&self, st: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        self.attn_fwd(st, l)
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let dqkv = with_cpus([arg, res, &grad], |[sq, so, sg]| self.dqkv(sq, so, sg))?;
        Ok(Some(storage_tensor(dqkv, arg.shape())?))
    }
}
