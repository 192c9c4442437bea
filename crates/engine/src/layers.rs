//! The layers every family's blocks are built of: a linear's weights as the fused ops take them
//! ([`LinearW`], [`mlp_linear`]), the feed-forward, the blocks' static configuration
//! ([`BlockConfig`], [`AttnImpl`]), casts and the release helpers, LayerNorm and modulation. The
//! DiT's own block is in [`crate::families::dit`], each family's in `families/<family>/block.rs`.
//! `cd` is the compute dtype of matmuls and attention, `ad` the accumulation dtype of the
//! residual stream, norms, softmax and modulation.
//!
//! A linear's weight and bias arrive in the compute dtype, or as the f32 master weights under a
//! bf16/f16 compute dtype (the fused linear rounds them as it reads them, so mixed precision
//! makes no cast copies); LoRA adapters arrive as cast copies. Every linear runs on a 2-D view
//! as one fused node ([`crate::ops::linear()`]), plus `(x·Aᵀ)·Bᵀ` when it carries LoRA.

use std::sync::Arc;

use candle_core::{DType, Tensor, D};

use crate::error::Result;
use crate::ops::{gated_residual, gelu_tanh, GradSink, InputSink, MlpLinear};

/// LayerNorm epsilon of DiT (elementwise_affine=False, eps=1e-6).
pub const LN_EPS: f64 = 1e-6;

/// A linear's weights (see the module docs for their dtypes); `lora` = (A (r, in), B (out, r)).
/// With a `sink`, a linear whose input tracks gradients hands dW and db to it instead of to
/// candle's gradient store (see [`crate::ops::LinearOp`]); with a `dx_sink`, its dx is added
/// into that running sum instead (the text context's k and v projections, see
/// [`crate::ops::InputSink`]); LoRA's branch still hands its share of dx to the store.
#[derive(Debug, Clone)]
pub struct LinearW {
    pub w: Tensor,
    pub b: Tensor,
    pub lora: Option<(Tensor, Tensor)>,
    pub sink: Option<Arc<GradSink>>,
    pub dx_sink: Option<Arc<InputSink>>,
}

impl LinearW {
    /// A linear without a gradient sink.
    pub fn new(w: Tensor, b: Tensor, lora: Option<(Tensor, Tensor)>) -> LinearW {
        LinearW {
            w,
            b,
            lora,
            sink: None,
            dx_sink: None,
        }
    }

    /// The same linear with its input's gradient added into `dx_sink` (when the input tracks).
    pub(crate) fn with_input_sink(mut self, dx_sink: Option<Arc<InputSink>>) -> LinearW {
        self.dx_sink = dx_sink;
        self
    }

    /// Whether the backward reads the input's values: for dW (a trained weight) or for LoRA's
    /// branch. A frozen linear's dx = g·W reads only W, so its caller may release the input
    /// once nothing else reads it (`ops::release`), as PyTorch saves nothing of it.
    pub fn reads_input(&self) -> bool {
        self.lora.is_some()
            || self.w.track_op()
            || self.sink.as_ref().is_some_and(|s| s.wants_weight())
    }

    /// y = x·Wᵀ + b (+ (x·Aᵀ)·Bᵀ) on a 2-D input.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // Under LoRA the frozen base and the branch are one node (`ops::lora_linear`).
        if let Some((a, bm)) = &self.lora {
            let dx = self.dx_sink.as_ref().filter(|_| x.track_op());
            return Ok(crate::ops::lora_linear(x, a, bm, (&self.w, &self.b), dx)?);
        }
        // One fused node (see `ops::LinearOp`): the product and the biased sum are one buffer.
        // Only a tracked input makes candle call the op's backward.
        let y = match (&self.sink, &self.dx_sink) {
            (sink, Some(dx)) if x.track_op() => match sink {
                Some(s) => {
                    crate::ops::linear_into(x, &self.w.detach(), &self.b.detach(), Some(s), dx)?
                }
                None => crate::ops::linear_into(x, &self.w, &self.b, None, dx)?,
            },
            (Some(sink), _) if x.track_op() => {
                crate::ops::linear_sunk(x, &self.w.detach(), &self.b.detach(), sink)?
            }
            _ => crate::ops::linear(x, &self.w, &self.b)?,
        };
        Ok(y)
    }
}

/// A linear as the fused MLP takes it (see [`crate::ops::fused_mlp()`]), or None where it must
/// run composed: with LoRA, or with tracking weights and no sink the op can hand their
/// gradients to (as [`LinearW::forward`], a sink only when the input tracks).
pub(crate) fn mlp_linear(l: &LinearW, x_tracks: bool) -> Option<MlpLinear> {
    if l.lora.is_some() {
        return None;
    }
    match &l.sink {
        Some(sink) if x_tracks => Some(MlpLinear {
            w: l.w.detach(),
            b: l.b.detach(),
            sink: Some(Arc::clone(sink)),
        }),
        _ if !l.w.track_op() && !l.b.track_op() => Some(MlpLinear {
            w: l.w.clone(),
            b: l.b.clone(),
            sink: None,
        }),
        _ => None,
    }
}

/// The feed-forward `fc2(gelu_tanh(fc1(h)))` on a 2-D input: one fused node
/// ([`crate::ops::fused_mlp()`]: keeps fc1's output only, no wide gradient in candle's store)
/// where both linears allow it (see [`mlp_linear`]), in every dtype, else composed of the two
/// linears and the GELU. Both give the same values, bit for bit. (On f32/f64 it ran composed
/// until the budget counted `gemm`'s per-call packing, `ditmem_cpu::ops::linear_workspace`: the
/// fused backward's lower peak sat where the direct linear's packing buffers set it.)
pub fn feed_forward(h: &Tensor, fc1: &LinearW, fc2: &LinearW) -> Result<Tensor> {
    let t = h.track_op();
    match (mlp_linear(fc1, t), mlp_linear(fc2, t)) {
        (Some(l1), Some(l2)) => Ok(crate::ops::fused_mlp(h, l1, l2)?),
        _ => {
            // Locals until fc2's output exists (the budget holds them so).
            let f1 = fc1.forward(h)?;
            let g = gelu_tanh(&f1)?;
            fc2.forward(&g)
        }
    }
}

/// How the attention core runs inside a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnImpl {
    Materialized,
    MemoryEfficient,
    /// Materialized, but P is recomputed in backward (the attention-only policy).
    RecomputeCore,
}

/// Static configuration of the blocks of a model under a recipe.
#[derive(Debug, Clone, Copy)]
pub struct BlockConfig {
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub compute: DType,
    pub accum: DType,
    pub attn: AttnImpl,
    pub attn_dropout: f64,
    pub mlp_dropout: f64,
}

/// `l.forward(x)`, then x's buffer released when the linear is frozen (x read by nothing else:
/// a slice of the attention's output made for this linear, the output side's modulated norm).
pub(crate) fn linear_then_release(l: &LinearW, x: &Tensor) -> Result<Tensor> {
    let y = l.forward(x)?;
    if !l.reads_input() {
        crate::ops::release(x)?;
    }
    Ok(y)
}

/// `feed_forward(h, fc1, fc2)`, then h's buffer released when fc1 is frozen (the fused MLP's
/// and the composed fc1's rules read h only for fc1's weight or LoRA's branch; h, a modulated
/// norm, is read by nothing else).
pub(crate) fn feed_forward_then_release(
    h: &Tensor,
    fc1: &LinearW,
    fc2: &LinearW,
) -> Result<Tensor> {
    let f = feed_forward(h, fc1, fc2)?;
    if !fc1.reads_input() {
        crate::ops::release(h)?;
    }
    Ok(f)
}

/// `gated_residual(x, y, gate)`, then y's buffer released under a frozen gate (its rule reads y
/// for dgate alone; y is read by nothing else).
pub(crate) fn gated_then_release(x: &Tensor, y: Tensor, gate: &Tensor) -> Result<Tensor> {
    let out = gated_residual(x, &y, gate)?;
    if !gate.track_op() {
        crate::ops::release(&y)?;
    }
    Ok(out)
}

/// `cast(y, dtype)`, then y's buffer released when the cast made a copy (the cast's rule reads
/// no values; y is read by nothing else).
pub(crate) fn cast_then_release(y: Tensor, dtype: DType) -> Result<Tensor> {
    if y.dtype() == dtype {
        return Ok(y);
    }
    let out = cast(y.clone(), dtype)?;
    crate::ops::release(&y)?;
    Ok(out)
}

/// Cast only when the dtype differs (a cast is a copy).
pub fn cast(t: Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        Ok(t)
    } else {
        Ok(t.to_dtype(dtype)?)
    }
}

/// LayerNorm over the last axis without affine, composed from differentiable ops:
/// mean, xc = x − mean, var = mean(xc²), rstd = (var + eps)^(−1/2), xc·rstd.
pub fn layer_norm(x: &Tensor) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let rstd = var.affine(1.0, LN_EPS)?.powf(-0.5)?;
    Ok(xc.broadcast_mul(&rstd)?)
}

/// x·(1 + scale) + shift with scale, shift (b, D) broadcast over the tokens of x (b, s, D).
pub fn modulate(x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
    let one_plus = scale.unsqueeze(1)?.affine(1.0, 1.0)?;
    Ok(x.broadcast_mul(&one_plus)?
        .broadcast_add(&shift.unsqueeze(1)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn composed_layer_norm_matches_definition_and_has_grad() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(
            &Tensor::from_vec(
                (0..24)
                    .map(|i| ((i * 7) % 11) as f64 * 0.3)
                    .collect::<Vec<_>>(),
                (2, 3, 4),
                &dev,
            )
            .unwrap(),
        )
        .unwrap();
        let y = layer_norm(x.as_tensor()).unwrap();
        let rows: Vec<Vec<f64>> = y.reshape((6, 4)).unwrap().to_vec2().unwrap();
        let xs: Vec<Vec<f64>> = x.as_tensor().reshape((6, 4)).unwrap().to_vec2().unwrap();
        for (r, xr) in rows.iter().zip(&xs) {
            let m = xr.iter().sum::<f64>() / 4.0;
            let v = xr.iter().map(|a| (a - m).powi(2)).sum::<f64>() / 4.0;
            for (a, b) in r.iter().zip(xr) {
                assert!((a - (b - m) / (v + LN_EPS).sqrt()).abs() < 1e-12);
            }
        }
        // Finite-difference check of d/dx sum(y·w).
        let wv: Vec<f64> = (0..24).map(|i| (i as f64 * 0.37).sin()).collect();
        let wt = Tensor::from_vec(wv, (2, 3, 4), &dev).unwrap();
        let f = |t: &Tensor| {
            layer_norm(t)
                .unwrap()
                .mul(&wt)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        let g = layer_norm(x.as_tensor())
            .unwrap()
            .mul(&wt)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g: Vec<f64> = g
            .get(x.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let base: Vec<f64> = x.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        for i in [0, 5, 13, 23] {
            let eps = 1e-6;
            let mut p = base.clone();
            p[i] += eps;
            let mut m = base.clone();
            m[i] -= eps;
            let fp = f(&Tensor::from_vec(p, (2, 3, 4), &dev).unwrap());
            let fm = f(&Tensor::from_vec(m, (2, 3, 4), &dev).unwrap());
            let fd = (fp - fm) / (2.0 * eps);
            assert!(
                (fd - g[i]).abs() < 1e-6 * (1.0 + fd.abs()),
                "i={i}: fd {fd} vs {}",
                g[i]
            );
        }
    }
}
