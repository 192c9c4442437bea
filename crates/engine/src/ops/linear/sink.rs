//! [`GradSink`]: where a fused linear built by [`super::linear_sunk`] leaves the gradients of
//! its weight and bias, instead of candle's gradient store. Budget twin: the weights' `Sink`
//! gradients of `ditmem_budget::ditmem_cpu::ops` (never folded into the store).

use std::sync::Mutex;

use candle_core::Tensor;

use crate::ops::storage::{err, CResult};

/// Where a fused linear leaves the gradients of its weight and bias (see [`LinearOp`](super::LinearOp)): each
/// backward adds its dW, db here (moved in when the slot is empty, summed otherwise); the owner
/// takes them out after the backward.
#[derive(Debug, Default)]
pub struct GradSink {
    pub(super) want_w: bool,
    pub(super) want_b: bool,
    pub(super) w: Mutex<Option<Tensor>>,
    pub(super) b: Mutex<Option<Tensor>>,
}

impl GradSink {
    /// Whether the sink takes the weight's gradient (the backward then reads the input).
    pub(crate) fn wants_weight(&self) -> bool {
        self.want_w
    }

    /// A sink for the gradients of the weight (`want_w`) and/or the bias (`want_b`).
    pub fn new(want_w: bool, want_b: bool) -> GradSink {
        GradSink {
            want_w,
            want_b,
            ..GradSink::default()
        }
    }

    /// The weight gradient left by the backward passes since the last take, if any.
    pub fn take_w(&self) -> Option<Tensor> {
        self.w.lock().ok().and_then(|mut g| g.take())
    }

    /// The bias gradient left since the last take, if any.
    pub fn take_b(&self) -> Option<Tensor> {
        self.b.lock().ok().and_then(|mut g| g.take())
    }

    /// Adds a backward's weight and bias gradients (either may be absent).
    pub(crate) fn put_both(&self, dw: Option<Tensor>, db: Option<Tensor>) -> CResult<()> {
        GradSink::put(&self.w, dw)?;
        GradSink::put(&self.b, db)
    }

    /// Whether the owner wants the weight's and the bias's gradients.
    pub(crate) fn wants(&self) -> (bool, bool) {
        (self.want_w, self.want_b)
    }

    fn put(slot: &Mutex<Option<Tensor>>, g: Option<Tensor>) -> CResult<()> {
        let Some(g) = g else { return Ok(()) };
        let mut s = slot
            .lock()
            .map_err(|_| err("linear: gradient sink poisoned"))?;
        *s = Some(match s.take() {
            Some(old) => (old + g)?,
            None => g,
        });
        Ok(())
    }
}
