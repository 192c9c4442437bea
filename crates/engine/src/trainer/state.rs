//! The trainer's state: the [`Trainer`] struct every schedule file reads (the DiT's in
//! `trainer.rs`, the families' in `family.rs` and `<family>.rs`), the parameters it holds, and the
//! trait its model layout is held as ([`ModelLayout`]). This file names no schedule file: the
//! schedules stand on it, and `trainer.rs` registers each family's layout (`Trainer::new`).

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use ditmem_spec::{Dtype, Precision, Spec};

use crate::diffusion::Batch;
use crate::error::{EngineError, Result};
use crate::layers::BlockConfig;
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

pub(crate) enum Value {
    Trained(Var),
    Frozen(Tensor),
}

pub(crate) struct Param {
    pub(crate) name: String,
    pub(crate) value: Value,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct LinearIdx {
    pub(crate) w: usize,
    pub(crate) b: usize,
    pub(crate) lora: Option<(usize, usize)>,
}

/// The model's parameters by name, as a family's layout finds them (`EngineFamily::layout`).
pub(crate) struct ParamIndex<'a> {
    pub(crate) by_name: &'a HashMap<String, usize>,
}

impl ParamIndex<'_> {
    /// The index of parameter `n`; an error naming it when the model has none.
    pub(crate) fn idx(&self, n: &str) -> Result<usize> {
        self.find(n)
            .ok_or_else(|| EngineError::bad_input("parameter", format!("'{n}' is missing")))
    }

    /// The index of parameter `n`, if the model has it.
    pub(crate) fn find(&self, n: &str) -> Option<usize> {
        self.by_name.get(n).copied()
    }

    /// A linear (`{prefix}.weight`, `{prefix}.bias`) and its LoRA factors: the DiT's
    /// (`.lora_a`, `.lora_b`) or PEFT's (a family's).
    pub(crate) fn lin(&self, prefix: &str) -> Result<LinearIdx> {
        let lora = match (
            self.find(&format!("{prefix}.lora_a")),
            self.find(&format!("{prefix}.lora_b")),
        ) {
            (Some(a), Some(b)) => Some((a, b)),
            _ => crate::families::lora::factor_indices(&|n| self.find(n), prefix),
        };
        Ok(LinearIdx {
            w: self.idx(&format!("{prefix}.weight"))?,
            b: self.idx(&format!("{prefix}.bias"))?,
            lora,
        })
    }

    /// One entry per block of a model of `depth` blocks named `{prefix}.{i}`: `block(i, name)`.
    pub(crate) fn blocks<T>(
        &self,
        prefix: &str,
        depth: usize,
        block: impl Fn(usize, &str) -> Result<T>,
    ) -> Result<Vec<T>> {
        (0..depth)
            .map(|i| block(i, &format!("{prefix}.{i}")))
            .collect()
    }

    /// The linears `{block}.{name}` of one block, in the order of `names`.
    pub(crate) fn lins<const N: usize>(
        &self,
        block: &str,
        names: [&str; N],
    ) -> Result<[LinearIdx; N]> {
        let v = names
            .iter()
            .map(|name| self.lin(&format!("{block}.{name}")))
            .collect::<Result<Vec<_>>>()?;
        v.try_into()
            .map_err(|_| EngineError::bad_input("block", "linear count"))
    }
}

/// A family's step concern: where its parameters sit (its layout), which also says which
/// schedule runs it. Each family implements it for its geometry in its `step.rs`; `trainer.rs`
/// dispatches to it over the registration list (`families::for_each_family!`).
pub(crate) trait FamilyLayout {
    fn layout(&self, p: &ParamIndex<'_>, d: &Dims) -> Result<Arc<dyn ModelLayout>>;
}

/// The name of a segment boundary in the step's timeline: "block 3", or "microbatch 1: block 3"
/// under gradient accumulation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SegmentTag {
    pub(crate) micro: usize,
    pub(crate) accum: usize,
}

impl SegmentTag {
    pub(crate) fn at(&self, what: String) -> String {
        if self.accum > 1 {
            format!("microbatch {}: {what}", self.micro)
        } else {
            what
        }
    }
}

/// The model's parameters by role, as the step reads them: the original DiT's layout
/// (`trainer.rs`) or a diffusers family's (`<family>.rs`, through `family::FamilyStep`).
pub(crate) trait ModelLayout: Send + Sync {
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
    pub(crate) spec: Spec,
    pub(crate) opts: TrainOptions,
    pub(crate) dev: Device,
    pub(crate) dims: Dims,
    pub(crate) cfg: BlockConfig,
    pub(crate) precision: Precision,
    pub(crate) params: Vec<Param>,
    pub(crate) by_name: HashMap<String, usize>,
    pub(crate) trained: Vec<usize>,
    /// Shared, so a step reads it without a copy (a copy would be step memory).
    pub(crate) layout: Arc<dyn ModelLayout>,
    /// Per parameter: the gradient sink of the fused linear it belongs to, if it is a trained
    /// linear weight or bias (see `ops::LinearOp`), and whether it is that linear's weight.
    pub(crate) sinks: Vec<Option<(Arc<GradSink>, bool)>>,
    /// The running sum of the text context's gradient that the cross-attentions' k and v
    /// projections add into (families with cross-attention; see `ops::InputSink`). Set by the
    /// family schedule for each microbatch's backward, empty between.
    pub(crate) ctx_sink: Arc<crate::ops::InputSink>,
    pub(crate) grads: Vec<Option<Tensor>>,
    pub(crate) grad_scale: f64,
    pub(crate) optimizer: Box<dyn Optimizer>,
    pub(crate) ema: Option<Ema>,
    pub(crate) scaler: Option<LossScaler>,
    pub(crate) acp: Vec<f64>,
    pub(crate) steps: u64,
}
