//! [`projected_attention`]: the qkv projection and the fused attention as one node on the
//! projection's input. Budget twin: `ditmem_budget::ditmem_cpu::ops::fused_qkv_attention`.

use candle_core::{backend::BackendStorage, CpuStorage, CustomOp1, Layout, Shape, Tensor};

use super::{AttnKeep, Dropout, QkvAttention};
use crate::ops::linear::storage_tensor;
use crate::ops::storage::Saved;
use crate::ops::storage::{err, with_cpu, with_cpus, CResult};
use crate::ops::{release_whole, MlpLinear};

/// `attention(x·Wᵀ + b)` on a 2-D x (b·s, D), written as (b·s, D): the projection runs inside
/// the op and the op keeps its output qkv (a bare buffer) for the backward, which makes dqkv
/// (over qkv's own buffer on the generic kernels; fresh, qkv then freed, on the AVX512-BF16
/// ones), turns it into dx, dW and db at once (dW, db to the projection's sink, or none for a
/// frozen projection), frees it and returns dx only.
///
/// Why: as two nodes, the attention's dqkv (b·s, 3D) entered candle's gradient store as
/// `zeros_like` + `add`, three qkv-sized buffers at once, and the projection's backward then
/// made dx beside it; here dqkv never leaves the op and only dx (width D) enters the store.
/// At DiT-S/2 256² batch 16 with block recompute this was the worst moment of a block's
/// backward. The values are the two nodes' bit for bit (the same kernels in the same order).
#[derive(Debug)]
pub(crate) struct ProjectedAttention {
    attn: QkvAttention,
    proj: MlpLinear,
    /// qkv from the forward, taken by the backward, which writes dqkv over it (or frees it once
    /// dqkv is made): the projection's products (dx, dW and `gemm`'s packing of dqkv) run
    /// without it, as PyTorch frees the attention's saved q, k, v once its node has run (the
    /// budget's node releases it, `Node::released_by_bwd`). A second backward on the same graph
    /// recomputes it from x.
    qkv: Saved,
}

/// The projected attention (see [`ProjectedAttention`]). `proj`'s weights must not track unless
/// it has a sink (the op returns only dx to candle); x must track (an untracked forward saves
/// nothing and has no backward: use the projection and [`super::qkv_attention`] there).
pub(crate) fn projected_attention(
    x: &Tensor,
    proj: &MlpLinear,
    batch: usize,
    heads: usize,
    keep: AttnKeep,
    dropout: Option<Dropout>,
) -> CResult<Tensor> {
    let attn = QkvAttention::new(batch, heads, keep, dropout, true)?;
    if !x.track_op() {
        return Err(err(
            "projected attention: the input does not track (use the projection and qkv_attention)",
        ));
    }
    MlpLinear::require_sinks(
        &[proj],
        "projected attention: tracking projection weights need a gradient sink",
    )?;
    x.apply_op1(ProjectedAttention {
        attn,
        proj: proj.clone(),
        qkv: Saved::default(),
    })
}

impl CustomOp1 for ProjectedAttention {
    fn name(&self) -> &'static str {
        "projected-attention"
    }

    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (qkv, shape) = self.proj.forward((sx, lx))?;
        let lq = Layout::contiguous(shape);
        let out = self.attn.attn_fwd(&qkv, &lq)?;
        *self.qkv.lock("projected attention: qkv poisoned")? = Some(qkv);
        Ok(out)
    }

    fn bwd(&self, x: &Tensor, res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let (rows, _) = x.dims2()?;
        let (out, _) = self.proj.w.dims2()?;
        let lq = Layout::contiguous((rows, out));
        let kept = self.qkv.lock("projected attention: qkv poisoned")?.take();
        // qkv, from the forward or (a second backward) recomputed from x.
        let qkv = match kept {
            Some(qkv) => qkv,
            None => with_cpu(x, |sx, lx| self.proj.forward((sx, lx)))?.0,
        };
        // dqkv over qkv's own buffer where the kernels allow (the generic ones), else fresh with
        // qkv freed once it is made.
        let dqkv = with_cpus([res, &grad], |[so, sg]| {
            self.attn.dqkv_from_owned(qkv, &lq, so, sg)
        })?;
        // The projection's products read dqkv, x and W, not the output gradient: its buffer
        // (the store's sum, which candle drops only after this call) is freed here, as PyTorch
        // frees a node's incoming gradient once the last rule reading it has run.
        release_whole(&grad)?;
        let (dx, dw, db) = self.proj.grads(x, (&dqkv, &lq), true)?;
        debug_assert_eq!(dqkv.dtype(), x.dtype());
        drop(dqkv);
        self.proj.sink_grads(dw, db)?;
        dx.map(|v| storage_tensor(v, x.shape())).transpose()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::{DType, Var};

    use super::*;
    use crate::ops::test_values::*;
    use crate::ops::{linear_sunk, qkv_attention};

    /// o, dx, dW, db of x (b·s, D) through the projection (3D, D) and the attention with
    /// `heads` heads, gradient r of o: projected, or the sunk linear then `qkv_attention`.
    fn run(
        projected: bool,
        (dt, wdt): (DType, DType),
        (keep, (b, s, heads, dh)): (AttnKeep, (usize, usize, usize, usize)),
    ) -> Vec<Tensor> {
        let (rows, d) = (b * s, heads * dh);
        let x = Var::from_tensor(&t(rows * d, &[rows, d], 1, dt)).unwrap();
        let sink = new_sink();
        let proj = seeded_linear((3 * d, d), 2, wdt, Some(Arc::clone(&sink)));
        let r = t(rows * d, &[rows, d], 4, dt);
        let o = if projected {
            projected_attention(x.as_tensor(), &proj, b, heads, keep, None).unwrap()
        } else {
            let qkv = linear_sunk(x.as_tensor(), &proj.w, &proj.b, &sink).unwrap();
            qkv_attention(&qkv, b, heads, keep, None).unwrap()
        };
        let grads = grads_against(&o, &r);
        let dx = grads.get(x.as_tensor()).unwrap().clone();
        [vec![o, dx], take_sunk(&[&sink])].concat()
    }

    /// The projected attention's output, dx and the sunk dW, db are the two nodes', bit for bit,
    /// in every mode, on f64, f32, bf16 (weights bf16 or f32 masters) and f16, at a token count
    /// that is not a multiple of the key block.
    #[test]
    fn projected_attention_equals_the_two_nodes_bit_for_bit() {
        let keeps = [
            AttnKeep::LogSumExp,
            AttnKeep::Probabilities,
            AttnKeep::Nothing,
        ];
        let cases: Vec<_> = keeps
            .into_iter()
            .flat_map(|keep| [(2, 6, 2, 4), (1, 150, 3, 8)].map(|geom| (keep, geom)))
            .collect();
        assert_fused_is_composition(&["o", "dx", "dW", "db"], &[1], &cases, run);
    }

    /// A frozen projection (no sink, untracked weights) hands back dx only; a second backward on
    /// the same graph (the first freed qkv) recomputes it and gives the same dx.
    #[test]
    fn a_frozen_projection_gives_dx_and_a_second_backward_agrees() {
        let (rows, d) = (12, 8);
        let x = Var::from_tensor(&t(rows * d, &[rows, d], 1, DType::F32)).unwrap();
        let proj = seeded_linear((3 * d, d), 2, DType::F32, None);
        let o = projected_attention(x.as_tensor(), &proj, 2, 2, AttnKeep::LogSumExp, None).unwrap();
        let dx = assert_backward_twice_agrees(&o, &[x.as_tensor()]);
        assert!(nonzero(&dx[0]));
    }

    /// With a sink, a second backward (qkv recomputed) gives the same dx and hands the sink the
    /// same dW and db as the first.
    #[test]
    fn a_second_backward_with_a_sink_gives_the_same_gradients() {
        let (rows, d) = (10, 8);
        let x = Var::from_tensor(&t(rows * d, &[rows, d], 1, DType::F32)).unwrap();
        let sink = new_sink();
        let proj = seeded_linear((3 * d, d), 2, DType::F32, Some(Arc::clone(&sink)));
        let o = projected_attention(x.as_tensor(), &proj, 2, 2, AttnKeep::LogSumExp, None).unwrap();
        let loss = o.sqr().unwrap().sum_all().unwrap();
        let mut runs = Vec::new();
        for _ in 0..2 {
            let g = loss.backward().unwrap();
            let dx = g.get(x.as_tensor()).unwrap().clone();
            let (dw, db) = (sink.take_w().unwrap(), sink.take_b().unwrap());
            runs.push([bits(&dx), bits(&dw), bits(&db)]);
        }
        assert_eq!(runs[0], runs[1]);
        assert!(runs[0][1].iter().any(|&v| f64::from_bits(v) != 0.0));
    }

    /// The op's heap bytes beside what it keeps are the budget's
    /// (`PROJECTED_ATTENTION_OP_BYTES`: candle's `Arc<Box<dyn CustomOp1>>` and the op).
    #[test]
    fn op_bytes_are_the_budgets() {
        use ditmem_budget::ditmem_cpu::ops::PROJECTED_ATTENTION_OP_BYTES;
        assert_eq!(
            32 + std::mem::size_of::<ProjectedAttention>() as u64,
            PROJECTED_ATTENTION_OP_BYTES
        );
    }

    /// What the op cannot do is refused with a message: an untracked input, tracking weights
    /// without a sink, dropout on the streaming kernel.
    #[test]
    fn inputs_it_cannot_take_are_refused() {
        let (rows, d) = (4, 4);
        let x = Var::from_tensor(&t(rows * d, &[rows, d], 1, DType::F32)).unwrap();
        let frozen = seeded_linear((3 * d, d), 2, DType::F32, None);
        let untracked = x.as_detached_tensor();
        let e = projected_attention(&untracked, &frozen, 1, 1, AttnKeep::LogSumExp, None);
        assert!(e.unwrap_err().to_string().contains("does not track"));
        let tracked = tracking(frozen.clone());
        let e = projected_attention(x.as_tensor(), &tracked, 1, 1, AttnKeep::LogSumExp, None);
        assert!(e.unwrap_err().to_string().contains("need a gradient sink"));
        let drop = Some(Dropout { p: 0.1, seed: 1 });
        let e = projected_attention(x.as_tensor(), &frozen, 1, 1, AttnKeep::LogSumExp, drop);
        assert!(e.unwrap_err().to_string().contains("dropout"));
    }
}
