//! [`CpuOp`]: an engine op of two or three inputs, its inputs an array — the forward over their
//! CPU storages, the backward over the tensors — and [`Op`], the adapter candle's `apply_op2` /
//! `apply_op3` take (`x.apply_op2(w, Op(RmsNorm { eps }))`); [`CpuInplaceOp`], an update of one
//! tensor from another in place (`p.inplace_op2(&g, &Op(update))`).
//!
//! Why: candle's `CustomOp2` / `CustomOp3` spell each input as two parameters (a storage and a
//! layout, in the forward) and return the gradients as a tuple, so each of the engine's two-
//! and three-input ops restated the same signatures; written once here, an op states what it
//! computes. The one-input ops implement candle's `CustomOp1` directly: its signatures are one
//! line each. `Op<T>` wraps the op alone (a newtype): the node candle keeps is `T`'s size (the
//! budget's `*_OP_BYTES` count `size_of` the op), and candle's backward folds the gradients in
//! the order it always did (input 1, 2, 3).

use candle_core::{CpuStorage, CustomOp2, CustomOp3, InplaceOp2, Layout, Shape, Tensor};

use super::storage::CResult;

/// One input of a forward: its CPU storage and its layout.
pub(crate) type Cpu<'a> = (&'a CpuStorage, &'a Layout);

/// A backward's result: one gradient per input, `None` for an input that gets none.
pub(crate) type Grads<const N: usize> = CResult<[Option<Tensor>; N]>;

/// An engine op of `N` inputs (2 or 3), applied through [`Op`].
pub(crate) trait CpuOp<const N: usize> {
    /// The name candle reports in errors.
    fn name(&self) -> &'static str;

    /// The output (storage and shape) of the inputs.
    fn fwd(&self, ins: [Cpu<'_>; N]) -> CResult<(CpuStorage, Shape)>;

    /// The inputs' gradients from the output's (`grad`), the inputs and the output (`res`).
    fn bwd(&self, ins: [&Tensor; N], res: &Tensor, grad: &Tensor) -> Grads<N>;
}

/// An engine op that writes into its first tensor (`dst`, in place) from its second (`src`):
/// the optimizer's and the EMA's updates, the input-gradient sink.
pub(crate) trait CpuInplaceOp {
    /// The name candle reports in errors.
    fn name(&self) -> &'static str;

    /// `dst` updated from `src`.
    fn fwd(&self, dst: (&mut CpuStorage, &Layout), src: Cpu<'_>) -> CResult<()>;
}

/// The adapter from a [`CpuOp`] to candle's `CustomOp2` / `CustomOp3`, and from a
/// [`CpuInplaceOp`] to its `InplaceOp2`.
pub(crate) struct Op<T>(pub(crate) T);

impl<T: CpuOp<2>> CustomOp2 for Op<T> {
    fn name(&self) -> &'static str {
        CpuOp::<2>::name(&self.0)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        self.0.fwd([(s1, l1), (s2, l2)])
    }

    fn bwd(
        &self,
        a1: &Tensor,
        a2: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let [g1, g2] = self.0.bwd([a1, a2], res, grad)?;
        Ok((g1, g2))
    }
}

impl<T: CpuOp<3>> CustomOp3 for Op<T> {
    fn name(&self) -> &'static str {
        CpuOp::<3>::name(&self.0)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        self.0.fwd([(s1, l1), (s2, l2), (s3, l3)])
    }

    fn bwd(
        &self,
        a1: &Tensor,
        a2: &Tensor,
        a3: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [g1, g2, g3] = self.0.bwd([a1, a2, a3], res, grad)?;
        Ok((g1, g2, g3))
    }
}

impl<T: CpuInplaceOp> InplaceOp2 for Op<T> {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<()> {
        self.0.fwd((s1, l1), (s2, l2))
    }
}
