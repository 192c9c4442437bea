//! [`joint_linear`]: two linears on two token streams written as one per-sample concatenation,
//! `[la(a); lc(c)]` for each of `batch` samples, as one node on (a, c): SD3's joint attention
//! input, where q, k and v of the image and the text stream are projected apart and joined.
//! Budget twin: `ditmem_budget::ditmem_cpu::ops::joint_linear` and its workspace
//! `joint_linear_workspace` (the one statement of it; the agreement grid holds it to the measured
//! peaks).
//!
//! Why: composed (two linears and [`cat_tokens`](super::cat_tokens)), candle's graph keeps both
//! projections until the block's backward ends though no backward reads them (a linear's
//! backward reads its input, the concatenation's none of its inputs): the joint tensor's size
//! again, per projection, beside the concatenation itself. This op keeps nothing; its output is
//! the joint tensor, and its backward takes each stream's part of the gradient as workspace,
//! hands candle da and dc, the weight gradients to the linears' [`GradSink`](super::GradSink)s.
//!
//! Numerics: the same linear calls on the same inputs, the same per-sample copies, so the same
//! bits as the composition in every dtype.

use candle_core::{backend::BackendStorage, CpuStorage, Layout, Shape, Tensor};

use super::fused_mlp::MlpLinear;
use super::linear::storage_tensor;
use super::storage::{err, with_cpu, CResult};
use super::tokens::{concat_storage, slice_storage};
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};

/// Two linears joined per sample (see the module docs).
#[derive(Debug)]
pub(crate) struct JointLinear {
    la: MlpLinear,
    lc: MlpLinear,
    batch: usize,
}

/// `[la(a); lc(c)]` per sample: a (batch·ta, inp) and c (batch·tc, inp) → (batch·(ta + tc),
/// out), as [`cat_tokens`](super::cat_tokens) of the two linears. A linear's weights must not
/// track unless it has a sink (the op returns only da and dc to candle).
pub fn joint_linear(
    a: &Tensor,
    c: &Tensor,
    la: MlpLinear,
    lc: MlpLinear,
    batch: usize,
) -> CResult<Tensor> {
    MlpLinear::require_sinks(
        &[&la, &lc],
        "joint_linear: a linear whose weights track needs a gradient sink",
    )?;
    let ((ra, ia), (rc, ic)) = (a.dims2()?, c.dims2()?);
    let ((oa, wia), (oc, wic)) = (la.w.dims2()?, lc.w.dims2()?);
    if batch == 0
        || !ra.is_multiple_of(batch)
        || !rc.is_multiple_of(batch)
        || ia != wia
        || ic != wic
        || oa != oc
        || a.dtype() != c.dtype()
    {
        return Err(err(format!(
            "joint_linear: a {:?} {:?} through {:?} and c {:?} {:?} through {:?} do not join in \
             {batch} samples",
            a.dims(),
            a.dtype(),
            la.w.dims(),
            c.dims(),
            c.dtype(),
            lc.w.dims()
        )));
    }
    a.apply_op2(c, Op(JointLinear { la, lc, batch }))
}

impl JointLinear {
    /// One stream's backward on its part [lo, hi) of each sample's gradient: dx (when x
    /// tracks) returned, dW and db to the linear's sink.
    fn bwd_part(
        &self,
        l: &MlpLinear,
        x: &Tensor,
        (sg, lg): (&CpuStorage, &Layout),
        range: (usize, usize),
    ) -> CResult<Option<Tensor>> {
        let part = slice_storage((sg, lg), self.batch, range)?;
        let (rows, out) = (x.dims2()?.0, l.w.dims2()?.0);
        let lp = Layout::contiguous((rows, out));
        let (dx, dw, db) = l.grads(x, (&part, &lp), x.track_op())?;
        drop(part);
        l.sink_grads(dw, db)?;
        dx.map(|v| storage_tensor(v, x.shape())).transpose()
    }
}

impl CpuOp<2> for JointLinear {
    fn name(&self) -> &'static str {
        "joint-linear"
    }

    fn fwd(&self, [(sa, la), (sc, lc)]: [Cpu<'_>; 2]) -> CResult<(CpuStorage, Shape)> {
        let (ra, rc) = (la.dims()[0], lc.dims()[0]);
        let out = self.la.w.dims2()?.0;
        let (ya, _) = self.la.forward((sa, la))?;
        let (yc, _) = self.lc.forward((sc, lc))?;
        let y = concat_storage(
            (&ya, &Layout::contiguous((ra, out))),
            (&yc, &Layout::contiguous((rc, out))),
            self.batch,
        )?;
        if y.dtype() != sa.dtype() {
            return Err(err("joint_linear: output dtype differs from the input's"));
        }
        Ok((y, Shape::from((ra + rc, out))))
    }

    fn bwd(&self, [a, c]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> Grads<2> {
        let grad = grad.contiguous()?;
        let out = grad.dims2()?.1;
        let ta = a.dims2()?.0 / self.batch;
        let tc = c.dims2()?.0 / self.batch;
        with_cpu(&grad, |sg, lg| {
            let da = self.bwd_part(&self.la, a, (sg, lg), (0, ta * out))?;
            let dc = self.bwd_part(&self.lc, c, (sg, lg), (ta * out, (ta + tc) * out))?;
            Ok([da, dc])
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_values::*;
    use crate::ops::{cat_tokens, linear_sunk};
    use candle_core::{DType, Var};
    use std::sync::Arc;

    /// y, da, dc, dWa, dba, dWc, dbc for `batch` samples of ta and tc tokens, fused or composed
    /// of the sunk linears and `cat_tokens`.
    fn run(
        fused: bool,
        (dt, wdt): (DType, DType),
        (batch, ta, tc, inp, out): (usize, usize, usize, usize, usize),
    ) -> Vec<Tensor> {
        let (ra, rc) = (batch * ta, batch * tc);
        let a = Var::from_tensor(&t(ra * inp, &[ra, inp], 1, dt)).unwrap();
        let c = Var::from_tensor(&t(rc * inp, &[rc, inp], 7, dt)).unwrap();
        let (s1, s2) = (new_sink(), new_sink());
        let la = seeded_linear((out, inp), 2, wdt, Some(Arc::clone(&s1)));
        let lc = seeded_linear((out, inp), 4, wdt, Some(Arc::clone(&s2)));
        let r = t((ra + rc) * out, &[ra + rc, out], 6, dt);
        let y = if fused {
            joint_linear(a.as_tensor(), c.as_tensor(), la, lc, batch).unwrap()
        } else {
            let ya = linear_sunk(a.as_tensor(), &la.w, &la.b, &s1).unwrap();
            let yc = linear_sunk(c.as_tensor(), &lc.w, &lc.b, &s2).unwrap();
            cat_tokens(&ya, &yc, batch).unwrap()
        };
        let grads = grads_against(&y, &r);
        let da = grads.get(a.as_tensor()).unwrap().clone();
        let dc = grads.get(c.as_tensor()).unwrap().clone();
        [vec![y, da, dc], take_sunk(&[&s1, &s2])].concat()
    }

    /// The joint linear's output, da, dc and the four weight gradients it sinks are the
    /// composition's, bit for bit, on f64, f32, bf16 and f16 with weights in the compute dtype or
    /// f32 masters, at whole and ragged (multi-chunk) row counts.
    #[test]
    fn joint_linear_equals_the_composition_bit_for_bit() {
        let names = ["y", "da", "dc", "dWa", "dba", "dWc", "dbc"];
        let cases = [(2, 3, 5, 8, 8), (3, 50, 17, 16, 12)];
        assert_fused_is_composition(&names, &[1, 2], &cases, run);
    }

    /// Streams that do not split into the batch, mismatched widths and tracking weights
    /// without a sink are refused, not panicked on.
    #[test]
    fn bad_inputs_are_errors() {
        let a = t(6 * 8, &[6, 8], 1, DType::F32);
        let c = t(4 * 8, &[4, 8], 2, DType::F32);
        let l = |o: usize, i: usize| seeded_linear((o, i), 3, DType::F32, None);
        assert!(joint_linear(&a, &c, l(8, 8), l(8, 8), 4).is_err());
        assert!(joint_linear(&a, &c, l(8, 8), l(4, 8), 2).is_err());
        assert!(joint_linear(&a, &c, l(8, 8), l(8, 8), 0).is_err());
        assert!(joint_linear(&a, &c, l(8, 8), l(8, 8), 2).is_ok());
        let tracked = tracking(seeded_linear((8, 8), 2, DType::F32, None));
        let e = joint_linear(&a, &c, tracked, l(8, 8), 2).unwrap_err();
        assert!(e.to_string().contains("sink"), "{e}");
    }
}
