//! The trainer's state: the [`Trainer`] struct every schedule file reads (the DiT's in
//! `trainer.rs`, the families' in `family.rs` and `<family>.rs`), the parameters it holds, and the
//! trait its model layout is held as ([`ModelLayout`]). This file names no schedule file: the
//! schedules stand on it, and `trainer.rs` registers each family's layout (`Trainer::new`).

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use ditmem_spec::{Dtype, Precision, Spec};

use crate::block::BlockConfig;
use crate::diffusion::Batch;
use crate::error::{EngineError, Result};
use crate::measure::Recorder;
use crate::model::Dims;
use crate::ops::GradSink;
use crate::optim::{Ema, LossScaler, Optimizer};

/// Candle dtype of a spec dtype.
pub fn dtype(d: Dtype) -> Result<DType> {
    Ok(match d {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::Bf16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::U8 => {
            return Err(EngineError::unsupported(
                "u8 weights",
                "only float dtypes hold weights",
            ))
        }
    })
}

/// Dtype of the gradient buffers (and of the loss): the budget's rule
/// (`ditmem_budget::ditmem_cpu::grad_dtype`: f64 under fp64, f32 otherwise), the one
/// definition both crates read, as a candle dtype. That rule names float dtypes only, so the
/// conversion cannot fail; f32 stands for an impossible error rather than a panic.
pub fn grad_dtype(p: Precision) -> DType {
    dtype(ditmem_budget::ditmem_cpu::grad_dtype(p)).unwrap_or(DType::F32)
}

/// Options of a trainer that are not part of the spec.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainOptions {
    /// Seed of the weight init and of the dropout masks.
    pub seed: u64,
    pub lr: f64,
    pub weight_decay: f64,
    /// Clean steps before the fp16 loss scale doubles.
    pub loss_scale_growth_interval: u32,
    /// Keep the gradient buffers after the optimizer step (for `gradients()`); by default they
    /// are dropped after the update, like `zero_grad(set_to_none=True)`.
    pub keep_gradients: bool,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            seed: 0,
            lr: 1e-4,
            weight_decay: 0.0,
            loss_scale_growth_interval: 2000,
            keep_gradients: false,
        }
    }
}

pub(super) enum Value {
    Trained(Var),
    Frozen(Tensor),
}

pub(super) struct Param {
    pub(super) name: String,
    pub(super) value: Value,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct LinearIdx {
    pub(super) w: usize,
    pub(super) b: usize,
    pub(super) lora: Option<(usize, usize)>,
}

/// The model's parameters by role, as the step reads them: the original DiT's layout
/// (`trainer.rs`) or a diffusers family's (`<family>.rs`, through `family::FamilyStep`).
pub(super) trait ModelLayout: Send + Sync {
    /// Every linear of the model (for their gradient sinks).
    fn linears(&self) -> Vec<LinearIdx>;
    /// The weights of linears without a bias (Sana's): their sinks take dW only.
    fn weight_only_linears(&self) -> Vec<usize> {
        Vec::new()
    }
    /// One microbatch's forward and backward under this layout's schedule; its loss.
    fn microbatch(
        &self,
        tr: &mut Trainer,
        mb: &Batch,
        micro: usize,
        accum: usize,
        rec: &mut Recorder<'_>,
    ) -> Result<f64>;
}

/// A DiT under a spec's recipe, with its optimizer state; runs training steps.
pub struct Trainer {
    pub(super) spec: Spec,
    pub(super) opts: TrainOptions,
    pub(super) dev: Device,
    pub(super) dims: Dims,
    pub(super) cfg: BlockConfig,
    pub(super) precision: Precision,
    pub(super) params: Vec<Param>,
    pub(super) by_name: HashMap<String, usize>,
    pub(super) trained: Vec<usize>,
    /// Shared, so a step reads it without a copy (a copy would be step memory).
    pub(super) layout: Arc<dyn ModelLayout>,
    /// Per parameter: the gradient sink of the fused linear it belongs to, if it is a trained
    /// linear weight or bias (see `ops::LinearOp`), and whether it is that linear's weight.
    pub(super) sinks: Vec<Option<(Arc<GradSink>, bool)>>,
    /// The running sum of the text context's gradient that the cross-attentions' k and v
    /// projections add into (families with cross-attention; see `ops::InputSink`). Set by the
    /// family schedule for each microbatch's backward, empty between.
    pub(super) ctx_sink: Arc<crate::ops::InputSink>,
    pub(super) grads: Vec<Option<Tensor>>,
    pub(super) grad_scale: f64,
    pub(super) optimizer: Box<dyn Optimizer>,
    pub(super) ema: Option<Ema>,
    pub(super) scaler: Option<LossScaler>,
    pub(super) acp: Vec<f64>,
    pub(super) steps: u64,
}
