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
