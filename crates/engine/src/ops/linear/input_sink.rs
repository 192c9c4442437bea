//! [`InputSink`]: where the fused linears that read a shared input (the cross-attention's k and
//! v projections of the text context, in every block) add that input's gradient, in place,
//! instead of handing it to candle's store; the fused cross-attention
//! ([`crate::ops::cross_attention`]) adds both of its projections' parts the same way. Budget
//! twin: `Node::sunk_input` of `ditmem_budget::ditmem_cpu` (dx made, added, freed; nothing in
//! the store).
//!
//! Why: candle folds a node's input gradient into its store as `zeros_like(x) + dx` on the
//! first contribution and `old + dx` on the next, each a new context-sized tensor beside the
//! ones it sums; the trainer then summed each block's context gradient into its running sum
//! out of place again. With T text tokens above the image tokens (PixArt's 300, Wan's 512) that
//! was the block backward's worst moment: up to five context-sized buffers alive at once. Here
//! each dx is added into the one running sum the trainer owns, and freed.

use std::sync::Mutex;

use candle_core::{backend::BackendStorage, CpuStorage, Layout, Tensor};

use crate::ops::custom_op::{Cpu, CpuInplaceOp, Op};
use crate::ops::storage::{err, CResult};

/// The running sum of a shared input's gradient (see the module docs): the trainer sets its
/// buffer (contiguous, f32 or f64, the input's shape) before the backward and takes it after;
/// each linear's backward adds its dx into it.
#[derive(Debug, Default)]
pub struct InputSink {
    acc: Mutex<Option<Tensor>>,
}

impl InputSink {
    /// Sets the buffer the backward passes add into (it is updated in place: the caller's
    /// handle sees the sums).
    pub fn set(&self, acc: Tensor) -> CResult<()> {
        *self.lock()? = Some(acc);
        Ok(())
    }

    /// The buffer, leaving the sink empty.
    pub fn take(&self) -> Option<Tensor> {
        self.acc.lock().ok().and_then(|mut s| s.take())
    }

    /// Adds `g` (the input's shape; any float dtype) into the buffer in place, converting each
    /// element to the buffer's dtype. Without a buffer, `g` becomes it.
    pub fn add(&self, g: &Tensor) -> CResult<()> {
        let mut s = self.lock()?;
        match &*s {
            Some(acc) => {
                if acc.elem_count() != g.elem_count() {
                    return Err(err(format!(
                        "input gradient sink: a gradient of {:?} into a sum of {:?}",
                        g.shape(),
                        acc.shape()
                    )));
                }
                acc.inplace_op2(g, &Op(AddInto))
            }
            None => {
                *s = Some(g.clone());
                Ok(())
            }
        }
    }

    fn lock(&self) -> CResult<std::sync::MutexGuard<'_, Option<Tensor>>> {
        self.acc
            .lock()
            .map_err(|_| err("input gradient sink poisoned"))
    }
}

/// `acc += g` elementwise, g converted to acc's dtype (f32 or f64) as it is read.
struct AddInto;

fn add_into<A: Copy + std::ops::AddAssign, G: Copy>(acc: &mut [A], g: &[G], f: impl Fn(G) -> A) {
    for (a, &x) in acc.iter_mut().zip(g) {
        *a += f(x);
    }
}

impl CpuInplaceOp for AddInto {
    fn name(&self) -> &'static str {
        "input-grad-add"
    }

    fn fwd(&self, (s1, l1): (&mut CpuStorage, &Layout), (s2, l2): Cpu<'_>) -> CResult<()> {
        let range = |l: &Layout| {
            l.contiguous_offsets()
                .ok_or_else(|| err("input gradient sink: expected contiguous tensors"))
        };
        let ((a0, a1), (g0, g1)) = (range(l1)?, range(l2)?);
        if a1 - a0 != g1 - g0 {
            return Err(err("input gradient sink: lengths differ"));
        }
        use CpuStorage as S;
        match (s1, s2) {
            (S::F32(a), S::F32(g)) => add_into(&mut a[a0..a1], &g[g0..g1], |x| x),
            (S::F32(a), S::BF16(g)) => add_into(&mut a[a0..a1], &g[g0..g1], f32::from),
            (S::F32(a), S::F16(g)) => add_into(&mut a[a0..a1], &g[g0..g1], f32::from),
            (S::F64(a), S::F64(g)) => add_into(&mut a[a0..a1], &g[g0..g1], |x| x),
            (S::F64(a), S::F32(g)) => add_into(&mut a[a0..a1], &g[g0..g1], f64::from),
            (a, g) => {
                return Err(err(format!(
                    "input gradient sink: cannot add {:?} into {:?}",
                    g.dtype(),
                    a.dtype()
                )))
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Sums in place into the caller's buffer, widening bf16; a mismatch is an error.
    #[test]
    fn adds_in_place_into_the_callers_buffer() {
        let dev = Device::Cpu;
        let acc = Tensor::zeros((2, 3), DType::F32, &dev).unwrap();
        let sink = InputSink::default();
        sink.set(acc.clone()).unwrap();
        let g = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &dev).unwrap();
        sink.add(&g).unwrap();
        sink.add(&g.to_dtype(DType::BF16).unwrap()).unwrap();
        let want = vec![vec![2f32, 4., 6.], vec![8., 10., 12.]];
        assert_eq!(acc.to_vec2::<f32>().unwrap(), want);
        let taken = sink.take().unwrap();
        assert_eq!(taken.to_vec2::<f32>().unwrap(), want);
        assert!(sink.take().is_none());
        sink.set(acc).unwrap();
        assert!(sink
            .add(&Tensor::zeros(4, DType::F32, &dev).unwrap())
            .is_err());
        assert!(sink
            .add(&Tensor::zeros((2, 3), DType::U32, &dev).unwrap())
            .is_err());
    }
}
