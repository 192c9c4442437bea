//! The block scheduler: one training step executed segment by segment under the spec's recipe.
//!
//! Forward: the embed segment (patch/timestep/label embedders) keeps its graph; then each block.
//! A stored block runs on a fresh leaf copy of the previous output and keeps its output (which
//! holds the block's graph); a recomputed block runs untracked (detached weights) and keeps only
//! its input. The final layer and the loss run on a leaf copy of the last block output.
//!
//! Backward: `loss.backward()` on the final segment; then for each block from the last one down:
//! recompute it if needed (same dropout seeds), backprop from its output with the known output
//! gradient ([`crate::ops::backward_from()`]), take the weight gradients (from the linears'
//! gradient sinks) and the input gradient (detached), add the weight gradients into the f32
//! (f64 under fp64) gradient buffers, and drop the block's graph and gradient store at once. The
//! conditioning c is an input of every block and of the final layer: its gradient is summed over
//! them and backpropagated through the embedders with the embed segment's surrogate at the end.
//!
//! Gradient accumulation runs the above per microbatch with the loss scaled by 1/accumulation;
//! the gradient buffers stay live across microbatches and are dropped after the optimizer step
//! (unless [`TrainOptions::keep_gradients`] or [`Trainer::compute_gradients`]).
//!
//! A step runs on a worker of rayon's pool, so the kernels' parallel regions include the thread
//! that opens them (see `on_pool`).

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use ditmem_spec::{AttentionMode, Optimizer as OptKind, Precision, Recompute, Spec};
use serde::Serialize;

use crate::diffusion::{alphas_cumprod, Batch};
use crate::error::{EngineError, Result};
use crate::layers::{cast, AttnImpl, BlockConfig, LinearW};
use crate::measure::{MemoryProbe, Phase, PhasePeaks, Recorder, TimelinePoint};
use crate::model::{init_values, Dims};
use crate::ops::GradSink;
use crate::optim::{AdamW, Ema, LossScaler, Optimizer, Sgd};

pub(crate) mod family;

pub(crate) mod state;

use crate::families::Arch;
pub use state::{dtype, grad_dtype, TrainOptions, Trainer};
use state::{FamilyLayout, LinearIdx, ModelLayout, Param, ParamIndex, Value};

/// The family's [`FamilyLayout`] (the step's concern) over the one registration list, as
/// `Arch::family` gives its `EngineFamily`.
macro_rules! layout_dispatch {
    ($($(#[$doc:meta])* $variant:ident($geom:ty),)*) => {
        fn family_layout(arch: &Arch) -> &dyn FamilyLayout {
            match arch {
                Arch::Dit => &crate::families::dit::Dit,
                $(Arch::$variant(g) => g,)*
            }
        }
    };
}
crate::families::for_each_family!(layout_dispatch);

/// What one step did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepReport {
    /// Mean loss over the microbatches (unscaled).
    pub loss: f64,
    /// The optimizer step was skipped (fp16 overflow).
    pub skipped: bool,
    /// Live bytes at each segment boundary (empty without a probe).
    pub timeline: Vec<TimelinePoint>,
    /// Peak live bytes per phase (zero without a probe).
    pub phase_peaks: PhasePeaks,
    /// L2 norm of the (unscaled) gradient of the trained parameters.
    pub grad_norm: f64,
    /// Loss scale used in this step (1 unless fp16-mixed).
    pub loss_scale: f64,
}

impl Trainer {
    /// Build the model of `spec` with weights drawn from `opts.seed` (in f64, then cast).
    pub fn new(spec: &Spec, opts: TrainOptions) -> Result<Trainer> {
        let (dims, arch) = Dims::with_arch(spec)?;
        // The spec's CPU must be this process's (the budget of the spec assumes it); a spec
        // without one runs as detected. Its bf16 path is the one the ops take from here on.
        let cpu = spec.cpu.unwrap_or_else(crate::host::detect);
        crate::host::check(&cpu)?;
        crate::host::set_bf16_products(cpu.bf16_products);
        // gemm's per-thread slabs now, not on whichever thread first multiplies in a later step.
        let mut on_this_cpu = spec.clone();
        on_this_cpu.cpu = Some(cpu);
        if ditmem_budget::ditmem_cpu::step_uses_gemm(&on_this_cpu) {
            crate::kernels::gemm::allocate_slabs();
        }
        check_recipe(spec)?;
        let r = &spec.recipe;
        let precision = r.precision;
        let compute = dtype(precision.compute_dtype())?;
        // Under LoRA the residual streams run in the frozen base's dtype, as the diffusers
        // scripts cast the whole transformer: bf16 streams under bf16-mixed, not the fp32 of
        // full fine-tuning's masters (`Precision::stream_dtype`, the budget's rule too).
        let accum = dtype(precision.stream_dtype(r.lora.is_some()))?;
        let param_dt = dtype(precision.param_dtype())?;
        let optimizer = optimizer(r.optimizer, &opts, dtype(precision.optimizer_dtype())?)?;
        let attn = match (r.attention, &r.recompute) {
            (AttentionMode::MemoryEfficient, _) => AttnImpl::MemoryEfficient,
            (AttentionMode::Materialized, Recompute::AttentionOnly) => AttnImpl::RecomputeCore,
            (AttentionMode::Materialized, _) => AttnImpl::Materialized,
        };
        let cfg = BlockConfig {
            hidden: dims.hidden,
            heads: dims.heads,
            head_dim: dims.head_dim,
            compute,
            accum,
            attn,
            attn_dropout: spec.model.attn_dropout,
            mlp_dropout: spec.model.mlp_dropout,
        };
        let family = arch.family();
        let shapes = family.param_shapes(spec, &dims);
        let (params, by_name, trained) = make_params(shapes, opts.seed, param_dt, &cfg)?;
        // The family's layout: which schedule runs the step, and where its parameters sit.
        let layout = family_layout(&arch).layout(&ParamIndex { by_name: &by_name }, &dims)?;
        let sinks = grad_sinks(layout.as_ref(), &params);
        let n = params.len();
        let mut t = Trainer {
            spec: spec.clone(),
            opts,
            dev: Device::Cpu,
            dims,
            cfg,
            precision,
            params,
            by_name,
            trained,
            layout,
            sinks,
            ctx_sink: Arc::default(),
            grads: vec![None; n],
            grad_scale: 1.0,
            optimizer,
            ema: None,
            scaler: (precision == Precision::Fp16Mixed
                && !crate::mutation::active(crate::mutation::Mutation::Fp16NoLossScaling))
            .then(|| LossScaler::new(1)),
            acp: alphas_cumprod(),
            steps: 0,
        };
        if let Some(s) = t.scaler.as_mut() {
            *s = LossScaler::new(t.opts.loss_scale_growth_interval);
        }
        if r.ema.enabled {
            let ema_dt = if crate::mutation::active(crate::mutation::Mutation::EmaBf16) {
                DType::BF16
            } else {
                dtype(r.ema.dtype)?
            };
            let vars = t.trained_vars();
            t.ema = Some(Ema::new(&vars, r.ema.decay, ema_dt)?);
        }
        Ok(t)
    }

    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    /// Optimizer steps taken (skipped ones not counted).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The current fp16 loss scale (None unless fp16-mixed).
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.as_ref().map(|s| s.scale)
    }

    /// Set the fp16 loss scale (e.g. to inject an overflow); an error unless fp16-mixed.
    pub fn set_loss_scale(&mut self, scale: f64) -> Result<()> {
        match self.scaler.as_mut() {
            Some(s) if scale.is_finite() && scale > 0.0 => {
                s.set_scale(scale);
                Ok(())
            }
            Some(_) => Err(EngineError::bad_input(
                "loss scale",
                format!("{scale} is not a positive number"),
            )),
            None => Err(EngineError::bad_input(
                "loss scale",
                "only fp16-mixed uses a loss scale",
            )),
        }
    }

    fn trained_vars(&self) -> Vec<&Var> {
        self.trained
            .iter()
            .filter_map(|&i| match &self.params[i].value {
                Value::Trained(v) => Some(v),
                Value::Frozen(_) => None,
            })
            .collect()
    }

    /// Every parameter (name, a copy of its current value in its storage dtype). Copies, because
    /// the optimizer updates the weights in place.
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.params
            .iter()
            .map(|p| Ok((p.name.clone(), self.value_copy(&p.value)?)))
            .collect()
    }

    fn value_copy(&self, v: &Value) -> Result<Tensor> {
        Ok(match v {
            Value::Trained(v) => v.as_detached_tensor().copy()?,
            Value::Frozen(t) => t.copy()?,
        })
    }

    /// A copy of one parameter by name.
    pub fn parameter(&self, name: &str) -> Result<Tensor> {
        let &i = self.by_name.get(name).ok_or_else(|| {
            EngineError::bad_input(
                "parameter",
                format!("'{name}' is not a parameter of this model"),
            )
        })?;
        self.value_copy(&self.params[i].value)
    }

    /// Names of the parameters the optimizer updates.
    pub fn trained_names(&self) -> Vec<String> {
        self.trained
            .iter()
            .map(|&i| self.params[i].name.clone())
            .collect()
    }

    /// Copy values into parameters by name (cast to each parameter's dtype); unknown names and
    /// shape mismatches are errors.
    pub fn load_parameters(&mut self, values: &[(String, Tensor)]) -> Result<()> {
        for (name, v) in values {
            let &i = self.by_name.get(name).ok_or_else(|| {
                EngineError::bad_input(
                    "parameter",
                    format!("'{name}' is not a parameter of this model"),
                )
            })?;
            match &mut self.params[i].value {
                Value::Trained(var) => {
                    if var.shape() != v.shape() {
                        return Err(EngineError::bad_input(
                            name.clone(),
                            format!("shape {:?} ≠ {:?}", v.dims(), var.dims()),
                        ));
                    }
                    var.set(&v.to_dtype(var.dtype())?.contiguous()?)?;
                }
                Value::Frozen(t) => {
                    if t.shape() != v.shape() {
                        return Err(EngineError::bad_input(
                            name.clone(),
                            format!("shape {:?} ≠ {:?}", v.dims(), t.dims()),
                        ));
                    }
                    *t = v.to_dtype(t.dtype())?.copy()?;
                }
            }
        }
        Ok(())
    }

    /// The gradients of the trained parameters accumulated by the last `compute_gradients` (or
    /// `step` with `keep_gradients`), unscaled, in f64.
    pub fn gradients(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for &i in &self.trained {
            if let Some(g) = &self.grads[i] {
                let g = g.to_dtype(DType::F64)?;
                let g = if self.grad_scale != 1.0 {
                    (g / self.grad_scale)?
                } else {
                    g
                };
                out.push((self.params[i].name.clone(), g));
            }
        }
        Ok(out)
    }

    /// The gradient of one trained tensor from the last `compute_gradients` (or `step` with
    /// `keep_gradients`), unscaled, in f64; `None` when no gradient reached it. One tensor at a
    /// time, for callers that must not hold a second copy of every gradient.
    pub fn gradient(&self, name: &str) -> Result<Option<Tensor>> {
        let &i = self.by_name.get(name).ok_or_else(|| {
            EngineError::bad_input(
                "parameter",
                format!("'{name}' is not a parameter of this model"),
            )
        })?;
        let Some(g) = &self.grads[i] else {
            return Ok(None);
        };
        let g = g.to_dtype(DType::F64)?;
        Ok(Some(if self.grad_scale != 1.0 {
            (g / self.grad_scale)?
        } else {
            g
        }))
    }

    /// L2 norm of the gradient of the trained parameters, unscaled (what `step` reports and
    /// what a clipping rule would use); non-finite after an overflow. Needs the gradients of the
    /// last `compute_gradients` (or `step` with `keep_gradients`).
    pub fn gradient_norm(&self) -> Result<f64> {
        let mut sq = 0.0f64;
        for &i in &self.trained {
            if let Some(g) = &self.grads[i] {
                sq += crate::ops::sum_squares(g)?;
            }
        }
        Ok(
            if crate::mutation::active(crate::mutation::Mutation::GradNormBeforeUnscale) {
                sq.sqrt()
            } else {
                sq.sqrt() / self.grad_scale
            },
        )
    }

    /// The EMA weights (name, value) when the recipe keeps an EMA.
    pub fn ema_parameters(&self) -> Option<Vec<(String, Tensor)>> {
        self.ema.as_ref().map(|e| {
            self.trained
                .iter()
                .zip(e.shadow())
                .map(|(&i, t)| (self.params[i].name.clone(), t.clone()))
                .collect()
        })
    }

    /// Bytes of optimizer state (m, v) and of the EMA.
    pub fn state_bytes(&self) -> (u64, u64) {
        (
            self.optimizer.state_bytes(),
            self.ema.as_ref().map_or(0, Ema::state_bytes),
        )
    }

    // -----------------------------------------------------------------------------------------
    // Weights for compute.

    /// Whether parameter `i` is trained (a LoRA base is not).
    pub(crate) fn trains(&self, i: usize) -> bool {
        matches!(self.params[i].value, Value::Trained(_))
    }

    pub(crate) fn raw_weight(&self, i: usize, track: bool) -> Tensor {
        match &self.params[i].value {
            Value::Trained(v) if track => v.as_tensor().clone(),
            Value::Trained(v) => v.as_detached_tensor(),
            Value::Frozen(t) => t.clone(),
        }
    }

    /// A parameter in the compute dtype (a cast copy when the dtypes differ).
    pub(crate) fn weight(&self, i: usize, track: bool) -> Result<Tensor> {
        cast(self.raw_weight(i, track), self.cfg.compute)
    }

    /// A fused linear's weight or bias: f32 master weights go in as they are under a bf16/f16
    /// compute dtype (the op rounds them as it reads them and returns their gradients in f32),
    /// so mixed precision makes no cast copies of them; anything else is cast as by [`weight`].
    pub(crate) fn linear_weight(&self, i: usize, track: bool) -> Result<Tensor> {
        let t = self.raw_weight(i, track);
        if t.dtype() == DType::F32 && matches!(self.cfg.compute, DType::BF16 | DType::F16) {
            Ok(t)
        } else {
            cast(t, self.cfg.compute)
        }
    }

    /// The context gradient's sink for a cross-attention's k and v projections: only on a
    /// tracked forward (a recomputed block's first forward has no backward).
    pub(crate) fn ctx_sink_for(&self, track: bool) -> Option<Arc<crate::ops::InputSink>> {
        track.then(|| Arc::clone(&self.ctx_sink))
    }

    pub(crate) fn linear(&self, l: LinearIdx, track: bool) -> Result<LinearW> {
        self.linear_with(l.w, Some(l.b), l.lora, track, || {
            self.linear_weight(l.b, track)
        })
    }

    /// The linear of weight `w` (its sink shared with the bias `b`, if it has one) and LoRA
    /// factors `lora`; `bias` makes its bias tensor once the weights are ready (a bias-less
    /// linear's zeros: Sana's).
    pub(crate) fn linear_with(
        &self,
        w: usize,
        b: Option<usize>,
        lora: Option<(usize, usize)>,
        track: bool,
        bias: impl FnOnce() -> Result<Tensor>,
    ) -> Result<LinearW> {
        let lora = match lora {
            Some((a, b)) => Some((self.weight(a, track)?, self.weight(b, track)?)),
            None => None,
        };
        let sink = if track {
            self.sinks[w]
                .as_ref()
                .or(b.and_then(|b| self.sinks[b].as_ref()))
                .map(|(s, _)| Arc::clone(s))
        } else {
            None
        };
        // A conv weight (out, C, p, p) (PixArt's patch embedding) multiplies as its
        // (out, C·p·p) view; candle reshapes its gradient back.
        let w = self.linear_weight(w, track)?;
        let w = if w.rank() > 2 { w.flatten_from(1)? } else { w };
        Ok(LinearW {
            w,
            b: bias()?,
            lora,
            sink,
            dx_sink: None,
        })
    }

    pub(crate) fn linear_params(l: &LinearIdx) -> Vec<usize> {
        let mut v = vec![l.w, l.b];
        if let Some((a, b)) = l.lora {
            v.extend([a, b]);
        }
        v
    }

    /// Add the gradients of `idx` found in `grads` into the buffers.
    pub(crate) fn accumulate(
        &mut self,
        idx: &[usize],
        grads: &candle_core::backprop::GradStore,
    ) -> Result<()> {
        let gd = grad_dtype(self.precision);
        for &i in idx {
            let Value::Trained(v) = &self.params[i].value else {
                continue;
            };
            let sunk = match &self.sinks[i] {
                Some((s, true)) => s.take_w(),
                Some((s, false)) => s.take_b(),
                None => None,
            };
            let Some(g) = sunk.or_else(|| grads.get(v.as_tensor()).map(Tensor::detach)) else {
                continue;
            };
            let g = cast(g, gd)?;
            let g = if g.dims() != v.dims() {
                g.reshape(v.shape())?
            } else {
                g
            };
            self.grads[i] = Some(match self.grads[i].take() {
                Some(old) if crate::mutation::active(crate::mutation::Mutation::AccumulateBf16) => {
                    cast((cast(old, DType::BF16)? + cast(g, DType::BF16)?)?, gd)?
                }
                Some(old) => (old + g)?,
                None => g,
            });
        }
        Ok(())
    }

    // -----------------------------------------------------------------------------------------
    // The step.

    /// Forward and backward over every microbatch of `batch` (microbatch × accumulation
    /// samples); the gradients stay in the buffers. Returns the mean loss.
    pub fn compute_gradients(&mut self, batch: &Batch) -> Result<f64> {
        on_pool(|| {
            let mut rec = Recorder::new(None);
            self.forward_backward(batch, &mut rec)
        })
    }

    fn forward_backward(&mut self, batch: &Batch, rec: &mut Recorder<'_>) -> Result<f64> {
        batch.check(&self.dims)?;
        let w = &self.spec.workload;
        let (micro, accum) = (w.microbatch as usize, w.accumulation as usize);
        if batch.n != micro * accum {
            return Err(EngineError::bad_input(
                "batch",
                format!("{} samples; this spec takes microbatch × accumulation = {micro} × {accum} = {} per step", batch.n, micro * accum),
            ));
        }
        for g in self.grads.iter_mut() {
            *g = None;
        }
        self.grad_scale = self.scaler.as_ref().map_or(1.0, |s| s.scale);
        let mut loss_sum = 0.0;
        let layout = Arc::clone(&self.layout);
        for m in 0..accum {
            // One microbatch is the batch itself: no copy of its f64 latents, noise and text
            // (budget twin: `ditmem_cpu::step::replay` lays out a slice only under accumulation).
            let slice;
            let mb = if accum == 1 {
                batch
            } else {
                slice = batch.slice(m * micro, micro)?;
                &slice
            };
            rec.enter(Phase::Forward);
            loss_sum += layout.microbatch(self, mb, m, accum, rec)?;
        }
        Ok(loss_sum / accum as f64)
    }

    /// One optimizer step on `batch` (microbatch × accumulation samples).
    pub fn step(&mut self, batch: &Batch, probe: Option<&dyn MemoryProbe>) -> Result<StepReport> {
        // The step runs on a worker of rayon's pool (see `on_pool`).
        on_pool(|| self.step_on_pool(batch, probe))
    }

    fn step_on_pool(
        &mut self,
        batch: &Batch,
        probe: Option<&dyn MemoryProbe>,
    ) -> Result<StepReport> {
        let mut rec = Recorder::new(probe);
        let loss = self.forward_backward(batch, &mut rec)?;
        let (skipped, grad_norm, scale) = self.update(&mut rec)?;
        let (timeline, phase_peaks) = rec.finish();
        Ok(StepReport {
            loss,
            skipped,
            timeline,
            phase_peaks,
            grad_norm,
            loss_scale: scale,
        })
    }

    /// The optimizer step of [`Trainer::step`] on the gradients [`Trainer::compute_gradients`]
    /// left in the buffers: `compute_gradients(b)` then `apply_gradients()` is `step(b)`, bit
    /// for bit (the same calls in the same order). Returns whether the step was skipped (fp16
    /// overflow). `verify`'s reference takes its first trajectory step this way from the
    /// one-step gradients it has just stored, instead of computing them a second time.
    pub fn apply_gradients(&mut self) -> Result<bool> {
        if self.grads.iter().all(Option::is_none) {
            return Err(EngineError::bad_input(
                "apply_gradients",
                "no gradients: call compute_gradients first",
            ));
        }
        on_pool(|| {
            let mut rec = Recorder::new(None);
            self.update(&mut rec).map(|(skipped, _, _)| skipped)
        })
    }

    /// The next optimizer step is the last this trainer takes: the optimizer holds one tensor's
    /// state at a time during it and none after ([`Optimizer::release_state_after_next_step`]);
    /// the weights it computes are the same. Memory of a run that stops there, not of training.
    pub fn release_optimizer_state_after_next_step(&mut self) {
        self.optimizer.release_state_after_next_step();
    }

    /// The optimizer phase of a step: gradient norm, loss scaler, update, EMA, gradient buffers
    /// dropped (unless kept). Returns (skipped, gradient norm, loss scale of the gradients).
    fn update(&mut self, rec: &mut Recorder<'_>) -> Result<(bool, f64, f64)> {
        rec.enter(Phase::Optimizer);
        let scale = self.grad_scale;
        let grad_norm = self.gradient_norm()?;
        let skipped = match self.scaler.as_mut() {
            Some(s) => s.update(grad_norm.is_finite()),
            None => false,
        };
        if !skipped {
            let gd = grad_dtype(self.precision);
            let mut gs: Vec<Tensor> = Vec::with_capacity(self.trained.len());
            for &i in &self.trained {
                gs.push(match (&self.grads[i], &self.params[i].value) {
                    (Some(g), _) => g.clone(),
                    (None, Value::Trained(v)) => Tensor::zeros(v.shape(), gd, &self.dev)?,
                    (None, Value::Frozen(t)) => Tensor::zeros(t.shape(), gd, &self.dev)?,
                });
            }
            let vars: Vec<&Var> = self
                .trained
                .iter()
                .filter_map(|&i| match &self.params[i].value {
                    Value::Trained(v) => Some(v),
                    Value::Frozen(_) => None,
                })
                .collect();
            let grefs: Vec<&Tensor> = gs.iter().collect();
            self.optimizer.step(&vars, &grefs, 1.0 / scale)?;
            drop(grefs);
            drop(gs);
            if let Some(e) = self.ema.as_mut() {
                e.update(&vars)?;
            }
            self.steps += 1;
        }
        if !self.opts.keep_gradients {
            for g in self.grads.iter_mut() {
                *g = None;
            }
        }
        rec.mark("optimizer");
        Ok((skipped, grad_norm, scale))
    }
}

/// The recipe fields the engine does not execute: an error naming the first
/// ([`ditmem_budget::ditmem_cpu::not_executed`], the list the planner reads too).
fn check_recipe(spec: &Spec) -> Result<()> {
    let r = &spec.recipe;
    if let Some(n) = ditmem_budget::ditmem_cpu::not_executed(spec)
        .into_iter()
        .next()
    {
        return Err(EngineError::unsupported(n.field, n.instead));
    }
    if r.attention == AttentionMode::MemoryEfficient && spec.model.attn_dropout > 0.0 {
        return Err(EngineError::unsupported(
            "attention dropout with memory-efficient attention",
            "use materialized attention or model.attn_dropout = 0",
        ));
    }
    Ok(())
}

/// The recipe's optimizer, its state in `opt_dt`.
fn optimizer(kind: OptKind, opts: &TrainOptions, opt_dt: DType) -> Result<Box<dyn Optimizer>> {
    Ok(match kind {
        OptKind::AdamW => Box::new(AdamW::new(opts.lr, opts.weight_decay, opt_dt)),
        OptKind::Sgd => Box::new(Sgd {
            lr: opts.lr,
            weight_decay: opts.weight_decay,
            dtype: opt_dt,
        }),
        // `check_recipe` has refused it already (`not_executed`); the match names every kind.
        OptKind::AdamW8bit => {
            return Err(EngineError::unsupported(
                "recipe.optimizer = adamw-8bit",
                "8-bit AdamW is not implemented by the engine; use adamw or sgd",
            ))
        }
    })
}

/// What [`make_params`] makes: the parameters, their indices by name, the trained indices.
type MadeParams = (Vec<Param>, HashMap<String, usize>, Vec<usize>);

/// The parameters of `shapes`, drawn from `seed` in f64 and cast: trained ones in `param_dt`,
/// the frozen position table in the accumulation dtype, other frozen ones (a LoRA base) in the
/// compute dtype. Returns them, their indices by name and the trained indices.
fn make_params(
    shapes: Vec<crate::shapes::ParamShape>,
    seed: u64,
    param_dt: DType,
    cfg: &BlockConfig,
) -> Result<MadeParams> {
    let dev = Device::Cpu;
    let mut params = Vec::new();
    let mut by_name = HashMap::new();
    let mut trained = Vec::new();
    for (i, p) in shapes.into_iter().enumerate() {
        let values = init_values(&p, seed)?;
        let t = Tensor::from_vec(values, p.shape.clone(), &dev)?;
        let value = if p.trainable {
            trained.push(i);
            Value::Trained(Var::from_tensor(&t.to_dtype(param_dt)?)?)
        } else if p.name == "pos_embed" || p.name == "pos_embed.pos_embed" {
            Value::Frozen(t.to_dtype(cfg.accum)?)
        } else {
            Value::Frozen(t.to_dtype(cfg.compute)?)
        };
        by_name.insert(p.name.clone(), i);
        params.push(Param {
            name: p.name,
            value,
        });
    }
    Ok((params, by_name, trained))
}

/// Per parameter, the gradient sink of the fused linear it belongs to (a trained weight or
/// bias of one of the layout's linears) and whether it is that linear's weight.
fn grad_sinks(layout: &dyn ModelLayout, params: &[Param]) -> Vec<Option<(Arc<GradSink>, bool)>> {
    let mut sinks: Vec<Option<(Arc<GradSink>, bool)>> = vec![None; params.len()];
    let is_trained = |i: usize| matches!(params[i].value, Value::Trained(_));
    for l in layout.linears().iter() {
        let (tw, tb) = (is_trained(l.w), is_trained(l.b));
        if tw || tb {
            let sink = Arc::new(GradSink::new(tw, tb));
            if tw {
                sinks[l.w] = Some((Arc::clone(&sink), true));
            }
            if tb {
                sinks[l.b] = Some((sink, false));
            }
        }
    }
    for w in layout.weight_only_linears() {
        if is_trained(w) {
            sinks[w] = Some((Arc::new(GradSink::new(true, false)), true));
        }
    }
    sinks
}

/// Runs `f` on a worker thread of rayon's global pool (directly when already on one).
///
/// Every kernel of the step splits its work with rayon. Called from a thread outside the pool,
/// each of those few thousand parallel regions per step hands its jobs to the pool and puts the
/// caller to sleep until they finish (two context switches per region, and the caller's core
/// idles). From a worker, the caller takes part in its own region and only the other workers
/// are woken.
fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}
