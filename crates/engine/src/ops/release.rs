//! [`release`]: frees the buffer of a tensor that candle's graph holds but whose values no
//! backward reads; the tensor (its node, shape and dtype) stays.
//!
//! Why: a candle node holds its inputs (`Op::CustomOp3(x, y, gate, op)`), so every input of a
//! tracked op lives until the backward ends, though many backward rules read only shapes. PyTorch
//! saves only what a rule reads: with a frozen gate the gated residual saves the gate, not the
//! branch's output; a frozen linear saves nothing of its input; a concatenation saves nothing.
//! Under LoRA most of a block is frozen, and an SD3 joint block held its six q/k/v projections
//! beside their concatenations, both streams' branch outputs under frozen gates and the frozen
//! feed-forwards' inputs: 808 KiB of its 2.19 MiB (the tiny `sd3-bf16-lora4-none` spec).
//!
//! The caller knows every reader of the tensor and releases it after the last forward reader,
//! when no backward rule of any reader reads its values (each such rule reads them only for a
//! gradient it is not asked for: a frozen weight's, a frozen gate's). A kernel that reads a
//! released tensor gets an error, never garbage (`storage::cpu_slice` checks the length).
//!
//! Budget twin: `Graph::release` of `ditmem_budget::ditmem_cpu::graph` (the node keeps its
//! bookkeeping, its buffer leaves the live bytes at the release).

use candle_core::{CpuStorage, InplaceOp1, Layout, Tensor};

use super::storage::{err, CResult};

/// Elements of a float storage (None for another dtype).
fn float_len(s: &CpuStorage) -> Option<usize> {
    match s {
        CpuStorage::F32(v) => Some(v.len()),
        CpuStorage::F64(v) => Some(v.len()),
        CpuStorage::BF16(v) => Some(v.len()),
        CpuStorage::F16(v) => Some(v.len()),
        _ => None,
    }
}

/// Swaps the storage's buffer for an empty one of the same dtype.
struct Release;

impl InplaceOp1 for Release {
    fn name(&self) -> &'static str {
        "release"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> CResult<()> {
        let len = float_len(s).ok_or_else(|| err("release: only float tensors are released"))?;
        // Only a tensor that is its whole storage: a view would free what its owner still reads.
        if l.contiguous_offsets() != Some((0, len)) {
            return Err(err(format!(
                "release: a {:?} view of a storage of {len} elements is not its own buffer",
                l.dims()
            )));
        }
        *s = match &*s {
            CpuStorage::F32(_) => CpuStorage::F32(Vec::new()),
            CpuStorage::F64(_) => CpuStorage::F64(Vec::new()),
            CpuStorage::BF16(_) => CpuStorage::BF16(Vec::new()),
            _ => CpuStorage::F16(Vec::new()),
        };
        Ok(())
    }
}

/// Frees `t`'s buffer (see the module docs). `t` must own its whole storage (no view).
pub fn release(t: &Tensor) -> CResult<()> {
    t.inplace_op1(&Release)
}

/// [`release`] when `t` covers its whole storage (a prediction not narrowed to fewer channels
/// than the model outputs); returns whether it did.
pub(crate) fn release_whole(t: &Tensor) -> CResult<bool> {
    let whole = {
        let (s, l) = t.storage_and_layout();
        match &*s {
            candle_core::Storage::Cpu(c) => {
                float_len(c).is_some_and(|len| len > 0 && l.contiguous_offsets() == Some((0, len)))
            }
            _ => false,
        }
    };
    if whole {
        release(t)?;
    }
    Ok(whole)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gated_residual;
    use candle_core::{DType, Device, Var};

    #[test]
    fn released_branch_under_a_frozen_gate_gives_the_same_gradients() {
        let dev = Device::Cpu;
        let run = |rel: bool| {
            let x = Var::from_tensor(
                &Tensor::arange(0f32, 24.0, &dev)
                    .unwrap()
                    .reshape((2, 3, 4))
                    .unwrap(),
            )
            .unwrap();
            let w = Var::from_tensor(&Tensor::ones((6, 4), DType::F32, &dev).unwrap()).unwrap();
            let y = x
                .as_tensor()
                .reshape((6, 4))
                .unwrap()
                .mul(w.as_tensor())
                .unwrap();
            let y = y.reshape((2, 3, 4)).unwrap().contiguous().unwrap();
            let gate = Tensor::new(&[[0.5f32, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]], &dev).unwrap();
            let out = gated_residual(x.as_tensor(), &y, &gate).unwrap();
            if rel {
                release(&y).unwrap();
            }
            let g = out.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            let of = |v: &Var| {
                let t = g.get(v.as_tensor()).unwrap();
                t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            };
            (of(&x), of(&w))
        };
        assert_eq!(run(false), run(true));
    }

    #[test]
    fn reading_a_released_tensor_is_an_error_and_views_are_refused() {
        let dev = Device::Cpu;
        let t = Tensor::ones((4, 3), DType::BF16, &dev).unwrap();
        let v = t.narrow(0, 1, 2).unwrap();
        assert!(release(&v).is_err(), "a view must not free its owner");
        assert_eq!(
            t.sum_all()
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            12.0
        );
        release(&t).unwrap();
        let (s, l) = t.storage_and_layout();
        let candle_core::Storage::Cpu(c) = &*s else {
            panic!("cpu")
        };
        assert!(crate::ops::storage::cpu_slice::<half::bf16>(c, l, "released").is_err());
        assert_eq!(t.dims(), &[4, 3]);
    }
}
