//! [`backward_from`]: backpropagation from a segment's output with its known gradient, seeded
//! by a one-element custom op instead of the composed root `sum(out · grad)` (whose forward and
//! backward each made output-sized temporaries). Budget twin: `ditmem_budget::ditmem_cpu::ops::seed`
//! (`Kind::Seed`: only `out`'s zeros + add).

use candle_core::{backend::BackendStorage, CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

use super::storage::{err, CResult};

/// A one-element node on `out` whose backward hands `grad` to `out` as is: the root of a
/// segment's backward when the gradient of its output is already known. The composed root
/// `sum(out · grad)` made an output-sized product in forward, and in backward a zeros + add for
/// the product, the product `1·grad`, a zeros + add for `out`, and the product `1·out` plus its
/// zeros + add for `grad` (kept in the store until it is dropped); this makes only `out`'s
/// zeros + add.
#[derive(Debug)]
struct GradSeed {
    grad: Tensor,
}

impl CustomOp1 for GradSeed {
    fn name(&self) -> &'static str {
        "grad-seed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let zero = match s.dtype() {
            DType::F32 => CpuStorage::F32(vec![0.0]),
            DType::F64 => CpuStorage::F64(vec![0.0]),
            DType::BF16 => CpuStorage::BF16(vec![half::bf16::ZERO]),
            DType::F16 => CpuStorage::F16(vec![half::f16::ZERO]),
            other => return Err(err(format!("grad seed: unsupported dtype {other:?}"))),
        };
        Ok((zero, Shape::from(())))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, _grad: &Tensor) -> CResult<Option<Tensor>> {
        Ok(Some(self.grad.clone()))
    }
}

/// Backpropagates `grad` (the gradient of `out`, same shape and dtype, untracked) through the
/// graph of `out`.
pub fn backward_from(out: &Tensor, grad: &Tensor) -> CResult<candle_core::backprop::GradStore> {
    if out.shape() != grad.shape() || out.dtype() != grad.dtype() {
        return Err(err(format!(
            "backward: gradient {:?} {:?} does not match the output {:?} {:?}",
            grad.shape(),
            grad.dtype(),
            out.shape(),
            out.dtype()
        )));
    }
    out.apply_op1(GradSeed {
        grad: grad.detach(),
    })?
    .backward()
}

/// Backpropagates the gradients `grads` of several segment outputs `outs` (pairwise same shape
/// and dtype) through their graphs at once: one seed per output, their one-element sum the
/// root. With one output this is [`backward_from`] itself (no sum node).
pub fn backward_from_many(
    outs: &[Tensor],
    grads: &[Tensor],
) -> CResult<candle_core::backprop::GradStore> {
    if outs.len() != grads.len() || outs.is_empty() {
        return Err(err(format!(
            "backward: {} gradients for {} outputs",
            grads.len(),
            outs.len()
        )));
    }
    if let ([out], [grad]) = (outs, grads) {
        return backward_from(out, grad);
    }
    let mut root: Option<Tensor> = None;
    for (out, grad) in outs.iter().zip(grads) {
        if out.shape() != grad.shape() || out.dtype() != grad.dtype() {
            return Err(err(format!(
                "backward: gradient {:?} {:?} does not match the output {:?} {:?}",
                grad.shape(),
                grad.dtype(),
                out.shape(),
                out.dtype()
            )));
        }
        let seed = out
            .apply_op1(GradSeed {
                grad: grad.detach(),
            })?
            .to_dtype(DType::F64)?;
        root = Some(match root {
            None => seed,
            Some(r) => (r + seed)?,
        });
    }
    root.ok_or_else(|| err("backward: no output".to_string()))?
        .backward()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Two outputs sharing an input: the gradient reaching it is the sum of both paths, as a
    /// composed root `sum(a·ga) + sum(b·gb)` gives.
    #[test]
    fn several_outputs_sum_their_paths() {
        let dev = Device::Cpu;
        let x = Var::from_vec(vec![1.0f32, 2.0, 3.0], 3, &dev).unwrap();
        let a = x.as_tensor().sqr().unwrap();
        let b = x.as_tensor().affine(3.0, 0.0).unwrap();
        let ga = Tensor::new(&[1.0f32, 0.5, 2.0], &dev).unwrap();
        let gb = Tensor::new(&[2.0f32, 1.0, -1.0], &dev).unwrap();
        let g = backward_from_many(&[a.clone(), b.clone()], &[ga.clone(), gb.clone()]).unwrap();
        let got: Vec<f32> = g.get(x.as_tensor()).unwrap().to_vec1().unwrap();
        // d/dx: 2x·ga + 3·gb
        assert_eq!(got, vec![2.0 + 6.0, 2.0 + 3.0, 12.0 - 3.0]);
        let one = backward_from_many(&[a], &[ga]).unwrap();
        let got1: Vec<f32> = one.get(x.as_tensor()).unwrap().to_vec1().unwrap();
        assert_eq!(got1, vec![2.0, 2.0, 12.0]);
        assert!(backward_from_many(&[b], &[]).is_err());
    }
}
