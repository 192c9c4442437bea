//! [`backward_from`]: backpropagation from a segment's output with its known gradient, seeded
//! by a one-element custom op instead of the composed root `sum(out · grad)` (whose forward and
//! backward each made output-sized temporaries). Budget twin: `ditmem_budget::ditmem_cpu::ops::seed`
//! (`Kind::Seed`: only `out`'s zeros + add).
//!
//! The seed takes the gradient by value and hands it to candle's store at its own node: once
//! candle has added it into `out`'s entry, the caller's gradient is freed, as PyTorch frees the
//! incoming gradient of `torch.autograd.backward(out, grad)` once its node has run
//! (`torch/csrc/autograd/engine.cpp`: the input buffer is moved into the node's call). Kept by
//! the caller for the whole backward, it was one output-sized buffer more at every moment of
//! the segment's backward (the worst moment of a DiT-S/2 bf16 block at 4,096 rows: 6 MiB of
//! 27 MiB).

use std::sync::Mutex;

use candle_core::{backend::BackendStorage, CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

use super::storage::{err, CResult};

/// A one-element node on `out` whose backward hands `grad` to `out` as is: the root of a
/// segment's backward when the gradient of its output is already known. The composed root
/// `sum(out · grad)` made an output-sized product in forward, and in backward a zeros + add for
/// the product, the product `1·grad`, a zeros + add for `out`, and the product `1·out` plus its
/// zeros + add for `grad` (kept in the store until it is dropped); this makes only `out`'s
/// zeros + add. The gradient is taken out by the backward (one backward per seed).
#[derive(Debug)]
struct GradSeed {
    grad: Mutex<Option<Tensor>>,
}

impl GradSeed {
    fn new(grad: Tensor) -> Self {
        Self {
            grad: Mutex::new(Some(grad.detach())),
        }
    }
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
        let grad = self
            .grad
            .lock()
            .map_err(|_| err("grad seed: gradient poisoned"))?
            .take()
            .ok_or_else(|| {
                err("grad seed: its gradient was already handed on (one backward per seed)")
            })?;
        Ok(Some(grad))
    }
}

/// `grad` must have `out`'s shape and dtype.
fn check_grad(out: &Tensor, grad: &Tensor) -> CResult<()> {
    if out.shape() != grad.shape() || out.dtype() != grad.dtype() {
        return Err(err(format!(
            "backward: gradient {:?} {:?} does not match the output {:?} {:?}",
            grad.shape(),
            grad.dtype(),
            out.shape(),
            out.dtype()
        )));
    }
    Ok(())
}

/// Backpropagates `grad` (the gradient of `out`, same shape and dtype, untracked) through the
/// graph of `out`. The gradient is taken by value: freed once it reaches `out`'s entry (unless
/// the caller kept another handle on it).
pub fn backward_from(out: &Tensor, grad: Tensor) -> CResult<candle_core::backprop::GradStore> {
    check_grad(out, &grad)?;
    out.apply_op1(GradSeed::new(grad))?.backward()
}

/// Backpropagates the gradients `grads` of several segment outputs `outs` (pairwise same shape
/// and dtype) through their graphs at once: one seed per output, their one-element sum the
/// root. With one output this is [`backward_from`] itself (no sum node). The gradients are
/// taken by value, as there.
pub(crate) fn backward_from_many(
    outs: &[Tensor],
    grads: Vec<Tensor>,
) -> CResult<candle_core::backprop::GradStore> {
    if outs.len() != grads.len() || outs.is_empty() {
        return Err(err(format!(
            "backward: {} gradients for {} outputs",
            grads.len(),
            outs.len()
        )));
    }
    if outs.len() == 1 {
        let grad = grads
            .into_iter()
            .next()
            .ok_or_else(|| err("backward: no gradient"))?;
        return backward_from(&outs[0], grad);
    }
    let mut root: Option<Tensor> = None;
    for (out, grad) in outs.iter().zip(grads) {
        check_grad(out, &grad)?;
        let seed = out.apply_op1(GradSeed::new(grad))?.to_dtype(DType::F64)?;
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
        let g = backward_from_many(&[a.clone(), b.clone()], vec![ga.clone(), gb]).unwrap();
        let got: Vec<f32> = g.get(x.as_tensor()).unwrap().to_vec1().unwrap();
        // d/dx: 2x·ga + 3·gb
        assert_eq!(got, vec![2.0 + 6.0, 2.0 + 3.0, 12.0 - 3.0]);
        let one = backward_from_many(&[a], vec![ga]).unwrap();
        let got1: Vec<f32> = one.get(x.as_tensor()).unwrap().to_vec1().unwrap();
        assert_eq!(got1, vec![2.0, 2.0, 12.0]);
        assert!(backward_from_many(&[b], vec![]).is_err());
    }
}
