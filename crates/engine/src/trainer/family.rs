//! The microbatch of a diffusers family: the DiT's schedule ([`super`]) over a family's three
//! kinds of segment, which the family supplies through [`FamilyStep`].
//!
//! - **Embed** (kept until the end of the backward): the family's embedders produce the residual
//!   streams entering block 0 and the conditioning tensors (embedded timestep, block modulation,
//!   projected caption, RoPE tables …). Each conditioning tensor enters the blocks and the final
//!   layer as a shared leaf copy; its gradient is summed over the segments that read it (in the
//!   gradient dtype, from zeros made after the final layer's backward when the final layer does
//!   not read it) and backpropagated through the embedders, with the streams' gradients, from
//!   one seed per output at the end (`ops::backward_from_many`). The text context of a
//!   cross-attention family ([`FamilyStep::ctx_cond`]) is summed in place instead: its k and v
//!   projections add their dx into that zeros buffer through `Trainer::ctx_sink`
//!   (`ops::InputSink`), so no block's store holds a context-sized gradient.
//! - **Blocks**, stored or recomputed as the recipe says. A block reads one or more streams
//!   (PixArt one; a joint-attention block two: text and image) and returns one or more: the
//!   count may change from block to block (Flux's single-stream blocks after its double-stream
//!   ones, SD3's last `context_pre_only` block).
//! - **Final**: the output side and the loss on leaf copies of the last streams.
//!
//! The order of every allocation and free here is what the `ditmem-cpu` budget replays
//! (`ditmem_budget::runtime::ditmem_cpu::step`): change one only with its twin.

use candle_core::{Tensor, Var};

use super::state::{grad_dtype, LinearIdx, ModelLayout, SegmentTag, Trainer};
use crate::diffusion::Batch;
use crate::error::{EngineError, Result};
use crate::layers::cast;
use crate::measure::{Phase, Recorder};
use crate::model::timestep_features;

/// What a family's embed segment hands the blocks.
pub(crate) struct Embedded {
    /// The residual streams entering block 0 (tracked: the embed's graph).
    pub streams: Vec<Tensor>,
    /// Tensors every block and the final layer may read; each becomes one shared leaf.
    pub conds: Vec<Tensor>,
    /// Locals of the embed that live until the microbatch returns (inputs and casts the
    /// embed's graph references), so the step frees them where the budget does.
    pub hold: Vec<Tensor>,
}

/// What a block reads: the streams `x`, the conditioning leaves `c`, and `track`, false for the
/// untracked forward of a recomputed block (detached weights).
#[derive(Clone, Copy)]
pub(crate) struct BlockIn<'a> {
    pub(crate) x: &'a [Tensor],
    pub(crate) c: &'a [Tensor],
    pub(crate) track: bool,
}

impl<'a> BlockIn<'a> {
    /// A stored block's forward, or a recomputed one's replay in the backward.
    fn tracked(x: &'a [Tensor], c: &'a [Tensor]) -> BlockIn<'a> {
        BlockIn { x, c, track: true }
    }

    /// A recomputed block's first forward (nothing of it is kept).
    fn untracked(x: &'a [Tensor], c: &'a [Tensor]) -> BlockIn<'a> {
        BlockIn { x, c, track: false }
    }
}

/// A family's segments for [`Trainer::family_microbatch`]. Every `FamilyStep` is the trainer's
/// [`ModelLayout`] (below): a family implements this trait in its file and is registered by one
/// line of `Trainer::new`.
pub(crate) trait FamilyStep {
    /// Every linear of the model with a bias (for their gradient sinks): the embed's, each
    /// block's, the final layer's.
    fn linears(&self) -> Vec<LinearIdx> {
        let mut v = self.embed_linears();
        for i in 0..self.depth() {
            v.extend(self.block_linears(i));
        }
        v.extend(self.final_linears());
        v
    }
    /// The linears with a bias of block `i`, of the final layer.
    fn block_linears(&self, i: usize) -> Vec<LinearIdx>;
    fn final_linears(&self) -> Vec<LinearIdx>;
    /// The weights of linears without a bias (Sana's): their sinks take dW only.
    fn weight_only(&self) -> Vec<usize> {
        Vec::new()
    }
    /// The embed segment, tracked (its graph stays until the embed backward).
    fn embed(&self, tr: &Trainer, mb: &Batch) -> Result<Embedded>;
    /// Number of blocks.
    fn depth(&self) -> usize;
    /// Block `i` on what it reads ([`BlockIn`]).
    fn block(&self, tr: &Trainer, i: usize, b: BlockIn<'_>) -> Result<Vec<Tensor>>;
    /// The output side on the last streams: the prediction in the latents' layout, accumulation
    /// dtype. Its weights are dropped before it returns.
    fn final_layer(&self, tr: &Trainer, x: &[Tensor], c: &[Tensor], mb: &Batch) -> Result<Tensor>;
    /// The embed segment's linears (the first of [`FamilyStep::linears`]), in the order their
    /// gradients land.
    fn embed_linears(&self) -> Vec<LinearIdx>;
    /// Parameter indices of the embed segment (by default its linears'), of block `i`, of the
    /// final layer.
    fn embed_params(&self) -> Vec<usize> {
        params_of(&self.embed_linears())
    }
    fn block_params(&self, i: usize) -> Vec<usize>;
    fn final_params(&self) -> Vec<usize> {
        params_of(&self.final_linears())
    }
    /// How many of the last conditioning tensors are fixed tables (Flux's RoPE cos and sin):
    /// the blocks and the final layer read them as they are, after the leaves, with no leaf
    /// copy and no gradient.
    fn fixed_conds(&self) -> usize {
        0
    }
    /// The index among the conditioning leaves of the text context whose gradient the blocks'
    /// cross-attention k and v projections add in place into `Trainer::ctx_sink` (see
    /// `ops::InputSink`), if the family has one.
    fn ctx_cond(&self) -> Option<usize> {
        None
    }
}

/// The parameter indices of `lins` (each weight, bias and LoRA factors).
pub(crate) fn params_of(lins: &[LinearIdx]) -> Vec<usize> {
    lins.iter().flat_map(Trainer::linear_params).collect()
}

/// The batch's cached caption must be what the model reads: `tokens` tokens of `width`.
pub(crate) fn check_text(mb: &Batch, tokens: usize, width: usize) -> Result<()> {
    if mb.text_tokens != tokens || mb.text_width != width {
        return Err(EngineError::bad_input(
            "batch text",
            format!(
                "{} tokens of width {}; this model reads {tokens} of width {width}",
                mb.text_tokens, mb.text_width
            ),
        ));
    }
    Ok(())
}

/// The batch's cached text must also carry a pooled embedding of `pooled` (SD3's and Flux's
/// CLIP pooled output) beside `tokens` tokens of `width`.
pub(crate) fn check_pooled_text(
    mb: &Batch,
    tokens: usize,
    width: usize,
    pooled: usize,
) -> Result<()> {
    if mb.text_tokens != tokens || mb.text_width != width || mb.pooled_width != pooled {
        return Err(EngineError::bad_input(
            "batch text",
            format!(
                "{} tokens of width {} and a pooled width of {}; this model reads {tokens} of \
                 width {width} and a pooled width of {pooled}",
                mb.text_tokens, mb.text_width, mb.pooled_width
            ),
        ));
    }
    Ok(())
}

/// The embed segments' common steps, in the order every family's embed runs them (the order of
/// allocations the `ditmem-cpu` budget replays).
impl Trainer {
    /// The noisy latents of `mb` patchified (`patchify`) in the compute dtype (`xp`, which the
    /// embed's graph reads; the latents go once patchified) and the patch embedding `patch` on
    /// them, in the compute dtype: (xp, xe).
    pub(crate) fn patch_embed(
        &self,
        mb: &Batch,
        patch: LinearIdx,
        patchify: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let xt = mb.noisy(&self.acp, self.cfg.accum, &self.dev)?;
        let xp = cast(patchify(&xt)?, self.cfg.compute)?;
        drop(xt);
        let xe = self.linear(patch, true)?.forward(&xp)?;
        Ok((xp, xe))
    }

    /// The timestep MLP (linear_1, SiLU, linear_2) on the `freq`-wide sinusoids of `mb`'s
    /// timesteps, made in the accumulation dtype and cast to the compute dtype: [the features,
    /// linear_1's SiLU (both read by the embed's graph), the embedded timestep (b, D) in the
    /// accumulation dtype].
    pub(crate) fn timestep_mlp(
        &self,
        mb: &Batch,
        freq: usize,
        [l1, l2]: [LinearIdx; 2],
    ) -> Result<[Tensor; 3]> {
        let (cd, ad) = (self.cfg.compute, self.cfg.accum);
        let tf = cast(timestep_features(&mb.timesteps, freq, ad, &self.dev)?, cd)?;
        let t1 = self.linear(l1, true)?.forward(&tf)?.silu()?;
        let emb = cast(self.linear(l2, true)?.forward(&t1)?, ad)?;
        Ok([tf, t1, emb])
    }

    /// adaLN-single's shared modulation (`adaln_single.linear`, Sana's `time_embed.linear`,
    /// Wan's `time_proj`): `linear` on SiLU(emb) in the compute dtype: (that SiLU, which the
    /// graph reads, the (b, 6D) modulation in the accumulation dtype).
    pub(crate) fn adaln_single(&self, emb: &Tensor, linear: LinearIdx) -> Result<(Tensor, Tensor)> {
        let se = cast(emb.silu()?, self.cfg.compute)?;
        let t6 = cast(self.linear(linear, true)?.forward(&se)?, self.cfg.accum)?;
        Ok((se, t6))
    }
}

/// A family's layout runs the family schedule.
impl<F: FamilyStep + Send + Sync> ModelLayout for F {
    fn linears(&self) -> Vec<LinearIdx> {
        FamilyStep::linears(self)
    }

    fn weight_only_linears(&self) -> Vec<usize> {
        self.weight_only()
    }

    fn microbatch(
        &self,
        tr: &mut Trainer,
        mb: &Batch,
        micro: usize,
        accum: usize,
        rec: &mut Recorder<'_>,
    ) -> Result<f64> {
        tr.family_microbatch(self, mb, SegmentTag { micro, accum }, rec)
    }
}

/// What the forward keeps of a block until its backward: of one stream (the DiT's schedule,
/// `Saved<Var, Tensor>`) or of several (a family's, `Saved<Vec<Var>, Vec<Tensor>>`).
pub(crate) enum Saved<L, T> {
    /// The leaves the block ran on and its outputs (holding the block's graph).
    Stored { leaves: L, outs: T },
    /// The block's inputs only (sharing storage with the previous outputs).
    Recompute { inputs: T },
}

fn leaves_of(xs: &[Tensor]) -> Result<Vec<Var>> {
    Ok(xs
        .iter()
        .map(|x| Var::from_tensor(&x.detach()))
        .collect::<candle_core::Result<Vec<_>>>()?)
}

/// The stream once: a stored segment's leaves are copies of its input streams (the previous
/// block's stored outputs, or the embed's), and no backward reads those (a seed reads only their
/// dtype; their producers' rules, the gated residual's, a cast's, a sum's, read no output), so
/// their buffers go once copied (`ops::release`; a stream that is a view of a larger buffer
/// stays). PyTorch holds each stream once. Budget twin: `SegSim::output_data`,
/// `Sims::streams_once`.
fn release_streams(xs: &[Tensor]) -> Result<()> {
    for x in xs {
        crate::ops::release_whole(x)?;
    }
    Ok(())
}

fn tensors(vs: &[Var]) -> Vec<Tensor> {
    vs.iter().map(|v| v.as_tensor().clone()).collect()
}

fn detached(vs: &[Var]) -> Vec<Tensor> {
    vs.iter().map(|v| v.as_detached_tensor()).collect()
}

/// The gradient of `leaf` in `grads`, detached; an error naming `what` when none reached it
/// (`what` is formatted on that error only).
pub(crate) fn leaf_grad(
    grads: &candle_core::backprop::GradStore,
    leaf: &Var,
    what: impl std::fmt::Display,
) -> Result<Tensor> {
    grads
        .get(leaf.as_tensor())
        .map(Tensor::detach)
        .ok_or_else(|| EngineError::bad_input("backward", format!("no gradient reached {what}")))
}

/// The gradients of `leaves` in `grads`, detached ([`leaf_grad`]).
fn leaf_grads(
    grads: &candle_core::backprop::GradStore,
    leaves: &[Var],
    what: &str,
) -> Result<Vec<Tensor>> {
    leaves.iter().map(|l| leaf_grad(grads, l, what)).collect()
}

impl Trainer {
    /// The conditioning gradients the final layer produced (`grads`, of the leaves
    /// `cond_leaves`), in the gradient dtype; the others start from zeros of their `conds`
    /// once the final layer's graph (`grads`, `final_leaves`) is gone.
    fn cond_grads_after_final(
        &self,
        grads: candle_core::backprop::GradStore,
        final_leaves: Vec<Var>,
        cond_leaves: &[Var],
        conds: &[Tensor],
    ) -> Result<Vec<Tensor>> {
        let ld = grad_dtype(self.precision);
        let mut gc: Vec<Option<Tensor>> = cond_leaves
            .iter()
            .map(|l| grads.get(l.as_tensor()).map(|g| cast(g.detach(), ld)))
            .map(Option::transpose)
            .collect::<Result<_>>()?;
        drop(grads);
        drop(final_leaves);
        for (g, c) in gc.iter_mut().zip(conds) {
            if g.is_none() {
                *g = Some(Tensor::zeros(c.shape(), ld, &self.dev)?);
            }
        }
        Ok(gc.into_iter().flatten().collect())
    }

    /// A block backward's conditioning gradients (`grads` of the leaves `cond_leaves`) added to
    /// their running sums `gc`; the text context's (`ctx`) into the context sink.
    fn add_cond_grads(
        &self,
        gc: &mut [Tensor],
        grads: &candle_core::backprop::GradStore,
        cond_leaves: &[Var],
        ctx: Option<usize>,
    ) -> Result<()> {
        let ld = grad_dtype(self.precision);
        for (k, (sum, l)) in gc.iter_mut().zip(cond_leaves).enumerate() {
            if let Some(g) = grads.get(l.as_tensor()) {
                if ctx == Some(k) {
                    // Any other reader of the context than the k and v projections (all of
                    // which add into the sink, LoRA'd or not): into the same sum.
                    self.ctx_sink.add(&g.detach())?;
                } else {
                    *sum = (&*sum + cast(g.detach(), ld)?)?;
                }
            }
        }
        Ok(())
    }

    // Kept whole (> 100 lines): every local's drop point is where the `ditmem-cpu` budget frees
    // it (`ditmem_cpu::step::replay`); split into functions, the locals would have to travel in
    // holders whose own heap blocks the measured peak counts (a `Vec` of six tensors moved the
    // DiT's measured peaks by 48 bytes when its microbatch was split in round 2 of issue 45).
    pub(crate) fn family_microbatch<F: FamilyStep>(
        &mut self,
        fam: &F,
        mb: &Batch,
        tag: SegmentTag,
        rec: &mut Recorder<'_>,
    ) -> Result<f64> {
        let ld = grad_dtype(self.precision);

        // Embed segment (kept until the end of the backward).
        let Embedded {
            streams: x0,
            mut conds,
            hold,
        } = fam.embed(self, mb)?;
        // A frozen embed (LoRA on the blocks alone, the scripts' defaults): nothing
        // differentiates the embedders, so the conditioning enters the segments as it is (no
        // leaf copies, no gradients, no context sink), the embed's locals go now and there is
        // no embed backward; PyTorch likewise saves nothing before the first adapted linear.
        // Untracked, the modulation makes the gates frozen, so the blocks release what only a
        // gate's gradient would read (`ops::release`).
        let frozen_embed = fam.embed_params().iter().all(|&i| !self.trains(i));
        let mut hold = Some(hold);
        if frozen_embed {
            drop(hold.take());
        }
        let fixed = conds.split_off(conds.len() - fam.fixed_conds().min(conds.len()));
        let cond_leaves = if frozen_embed {
            Vec::new()
        } else {
            leaves_of(&conds)?
        };
        // The conditioning a segment reads: the leaves (or the frozen embed's outputs), then
        // the fixed tables; `detach` for a recomputed block's untracked forward.
        let cond_in = |detach: bool| -> Vec<Tensor> {
            let c = if frozen_embed {
                conds.clone()
            } else if detach {
                detached(&cond_leaves)
            } else {
                tensors(&cond_leaves)
            };
            if fixed.is_empty() {
                c
            } else {
                c.into_iter().chain(fixed.iter().cloned()).collect()
            }
        };
        rec.mark(tag.at("embed".into()));

        // Blocks.
        let depth = fam.depth();
        // Whether segment `i` (`depth`: the final layer) reads the embed's streams or a stored
        // block's outputs, which `release_streams` may free once copied (a recomputed block's
        // untracked output is freed whole).
        let recipe = &self.spec.recipe;
        let reads_stored = |i: usize| i == 0 || !recipe.recompute.recomputes_block(i as u32 - 1);
        let mut saved: Vec<Saved<Vec<Var>, Vec<Tensor>>> = Vec::with_capacity(depth);
        let mut cur = x0.clone();
        for i in 0..depth {
            if self.spec.recipe.recompute.recomputes_block(i as u32) {
                let inputs: Vec<Tensor> = cur.iter().map(Tensor::detach).collect();
                cur = fam.block(self, i, BlockIn::untracked(&inputs, &cond_in(true)))?;
                saved.push(Saved::Recompute { inputs });
            } else {
                let leaves = leaves_of(&cur)?;
                if reads_stored(i) {
                    release_streams(&cur)?;
                }
                let c = cond_in(false);
                let outs = fam.block(self, i, BlockIn::tracked(&tensors(&leaves), &c))?;
                cur = outs.clone();
                saved.push(Saved::Stored { leaves, outs });
            }
            rec.mark(tag.at(format!("block {i}")));
        }

        // Output side and loss.
        let final_leaves = leaves_of(&cur)?;
        if reads_stored(depth) {
            release_streams(&cur)?;
        }
        drop(cur);
        let c = cond_in(false);
        let pred = fam.final_layer(self, &tensors(&final_leaves), &c, mb)?;
        let pred = cast(pred, ld)?;
        let target = mb.target(&self.acp, self.spec.recipe.prediction, ld, &self.dev)?;
        // One node keeping pred − target (`ops::mse_loss`; the target goes once subtracted);
        // its rule reads no prediction, which goes too unless a narrowed view
        // (`ops::release`), as PyTorch keeps pred − target alone.
        let loss = crate::ops::mse_loss(&pred, target)?;
        crate::ops::release_whole(&pred)?;
        drop(pred);
        let loss_value = loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        rec.mark(tag.at("final".into()));

        rec.enter(Phase::Backward);
        let factor = self.grad_scale / tag.accum as f64;
        let grads = loss.affine(factor, 0.0)?.backward()?;
        drop(loss);
        self.accumulate(&fam.final_params(), &grads)?;
        let mut gx = leaf_grads(&grads, &final_leaves, "the final layer's input")?;
        let mut gc = self.cond_grads_after_final(grads, final_leaves, &cond_leaves, &conds)?;
        // The context's running sum is the sink's buffer: the blocks' k and v projections add
        // into it in place (the handle in gc sees the sums).
        let ctx = fam.ctx_cond().filter(|&k| k < gc.len());
        if let Some(k) = ctx {
            self.ctx_sink.set(gc[k].clone())?;
        }
        rec.mark(tag.at("final".into()));

        for i in (0..depth).rev() {
            let s = saved
                .pop()
                .ok_or_else(|| EngineError::bad_input("backward", "block state missing"))?;
            let (leaves, outs) = match s {
                Saved::Stored { leaves, outs } => (leaves, outs),
                Saved::Recompute { inputs } => {
                    let leaves = leaves_of(&inputs)?;
                    drop(inputs);
                    let c = cond_in(false);
                    let outs = fam.block(self, i, BlockIn::tracked(&tensors(&leaves), &c))?;
                    (leaves, outs)
                }
            };
            // gx moves into the seeds and is freed once each reaches its output's entry.
            let grads = crate::ops::backward_from_many(&outs, gx)?;
            drop(outs);
            self.accumulate(&fam.block_params(i), &grads)?;
            gx = leaf_grads(&grads, &leaves, &format!("block {i}'s input"))?;
            self.add_cond_grads(&mut gc, &grads, &cond_leaves, ctx)?;
            drop(grads);
            drop(leaves);
            rec.mark(tag.at(format!("block {i}")));
        }

        if ctx.is_some() {
            self.ctx_sink.take();
        }

        // Embed segment backward: from the known gradients of the streams and the conditioning,
        // one seed each (a composed root Σ sum(out·grad) made an output-sized product per term
        // in forward and several in backward: at DiT-S/2 256² batch 2 with block recompute the
        // step's worst moment). None for a frozen embed.
        if x0.is_empty() {
            return Err(EngineError::bad_input("embed", "no residual stream"));
        }
        if frozen_embed {
            drop(gx);
            drop((x0, conds, fixed));
            rec.mark(tag.at("embed".into()));
            return Ok(loss_value);
        }
        let gc = gc
            .into_iter()
            .zip(&conds)
            .map(|(g, c)| cast(g, c.dtype()))
            .collect::<Result<Vec<_>>>()?;
        let outs: Vec<Tensor> = x0.iter().chain(&conds).cloned().collect();
        let seeds: Vec<Tensor> = gx.into_iter().chain(gc).collect();
        let grads = crate::ops::backward_from_many(&outs, seeds)?;
        drop(outs);
        self.accumulate(&fam.embed_params(), &grads)?;
        drop(grads);
        // The conditioning leaves go with the embed's outputs (the budget frees them together).
        drop((x0, conds, fixed));
        drop(cond_leaves);
        rec.mark(tag.at("embed".into()));
        drop(hold);
        Ok(loss_value)
    }
}
