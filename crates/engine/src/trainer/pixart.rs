//! The PixArt microbatch: the DiT's schedule ([`super`]) on PixArt's segments.
//!
//! Embed (kept until the end of the backward): patch embedding + the sin-cos table, the
//! timestep MLP (the embedded timestep, (b, D)), `adaln_single.linear` on its SiLU (the (b, 6D)
//! block modulation) and the caption projection (b·T, D) in the compute dtype. The three enter
//! the blocks and the final layer as leaf copies (`t6`, `emb`, `y`) whose gradients are summed
//! over the segments that read them (in the gradient dtype, from zeros made after the final
//! layer's backward) and backpropagated through the embedders with one surrogate at the end.

use candle_core::{Tensor, Var};

use super::LinearIdx;
use super::{cast, grad_dtype, Saved, Trainer};
use crate::diffusion::Batch;
use crate::error::{EngineError, Result};
use crate::families::pixart::params::PIXART_FREQ;
use crate::families::pixart::{
    caption_forward, final_forward, pixart_block_forward, CaptionWeights, PixartBlockWeights,
    PixartFinalWeights, PixartGeom, PIXART_BLOCK_LINEARS,
};
use crate::measure::{Phase, Recorder};
use crate::model::{patchify, timestep_features, unpatchify};

/// Where one PixArt block's parameters sit.
#[derive(Debug, Clone)]
pub(super) struct PixartBlockIdx {
    table: usize,
    lin: [LinearIdx; 10],
}

/// Where PixArt's parameters sit in `Trainer::params`.
#[derive(Debug, Clone)]
pub(super) struct PixartLayout {
    patch: LinearIdx,
    pos: usize,
    t1: LinearIdx,
    t2: LinearIdx,
    adaln: LinearIdx,
    caption: Option<[LinearIdx; 2]>,
    blocks: Vec<PixartBlockIdx>,
    final_table: usize,
    proj_out: LinearIdx,
    geom: PixartGeom,
}

impl PixartLayout {
    pub(super) fn new(
        lin: &dyn Fn(&str) -> Result<LinearIdx>,
        idx: &dyn Fn(&str) -> Result<usize>,
        depth: usize,
        geom: PixartGeom,
    ) -> Result<PixartLayout> {
        let mut blocks = Vec::with_capacity(depth);
        for i in 0..depth {
            let b = format!("transformer_blocks.{i}");
            let first = lin(&format!("{b}.{}", PIXART_BLOCK_LINEARS[0]))?;
            let mut l = [first; 10];
            for (slot, name) in l.iter_mut().zip(PIXART_BLOCK_LINEARS) {
                *slot = lin(&format!("{b}.{name}"))?;
            }
            blocks.push(PixartBlockIdx {
                table: idx(&format!("{b}.scale_shift_table"))?,
                lin: l,
            });
        }
        let te = "adaln_single.emb.timestep_embedder";
        Ok(PixartLayout {
            patch: lin("pos_embed.proj")?,
            pos: idx("pos_embed.pos_embed")?,
            t1: lin(&format!("{te}.linear_1"))?,
            t2: lin(&format!("{te}.linear_2"))?,
            adaln: lin("adaln_single.linear")?,
            caption: if geom.caption_projection {
                Some([
                    lin("caption_projection.linear_1")?,
                    lin("caption_projection.linear_2")?,
                ])
            } else {
                None
            },
            blocks,
            final_table: idx("scale_shift_table")?,
            proj_out: lin("proj_out")?,
            geom,
        })
    }

    /// Every linear of the model.
    pub(super) fn linears(&self) -> Vec<LinearIdx> {
        let mut v = vec![self.patch, self.t1, self.t2, self.adaln];
        v.extend(self.caption.iter().flatten().copied());
        v.extend(self.blocks.iter().flat_map(|b| b.lin.iter().copied()));
        v.push(self.proj_out);
        v
    }
}

impl Trainer {
    /// A PixArt parameter that is not a linear (a `scale_shift_table`), in the accumulation
    /// dtype (a cast copy only when the dtypes differ).
    fn table_weight(&self, i: usize, track: bool) -> Result<Tensor> {
        cast(self.raw_weight(i, track), self.cfg.accum)
    }

    fn pixart_block_weights(&self, b: &PixartBlockIdx, track: bool) -> Result<PixartBlockWeights> {
        let l = |k: usize| self.linear(b.lin[k], track);
        Ok(PixartBlockWeights {
            table: self.table_weight(b.table, track)?,
            q1: l(0)?,
            k1: l(1)?,
            v1: l(2)?,
            o1: l(3)?,
            q2: l(4)?,
            k2: l(5)?,
            v2: l(6)?,
            o2: l(7)?,
            fc1: l(8)?,
            fc2: l(9)?,
        })
    }

    pub(super) fn pixart_microbatch(
        &mut self,
        lay: &PixartLayout,
        mb: &Batch,
        micro: usize,
        accum: usize,
        rec: &mut Recorder<'_>,
    ) -> Result<f64> {
        let tag = |what: String| {
            if accum > 1 {
                format!("microbatch {micro}: {what}")
            } else {
                what
            }
        };
        let d = self.dims;
        let (cd, ad) = (self.cfg.compute, self.cfg.accum);
        let ld = grad_dtype(self.precision);
        let b = mb.n;
        let t_tokens = lay.geom.text_tokens;
        if mb.text_tokens != t_tokens || mb.text_width != lay.geom.text_width {
            return Err(EngineError::bad_input(
                "batch text",
                format!(
                    "{} tokens of width {}; this model reads {} of width {}",
                    mb.text_tokens, mb.text_width, t_tokens, lay.geom.text_width
                ),
            ));
        }

        // Embed segment (kept until the end of the backward).
        let xt = mb.noisy(&self.acp, ad, &self.dev)?;
        let xp = cast(patchify(&xt, &d)?, cd)?;
        drop(xt);
        let xe = self.linear(lay.patch, true)?.forward(&xp)?;
        let pos = self.raw_weight(lay.pos, true);
        let x0 = cast(xe, ad)?
            .reshape((b, d.tokens, d.hidden))?
            .broadcast_add(&pos)?;
        let tf = cast(
            timestep_features(&mb.timesteps, PIXART_FREQ, ad, &self.dev)?,
            cd,
        )?;
        let t1 = self.linear(lay.t1, true)?.forward(&tf)?.silu()?;
        let emb = cast(self.linear(lay.t2, true)?.forward(&t1)?, ad)?;
        let se = cast(emb.silu()?, cd)?;
        let t6 = cast(self.linear(lay.adaln, true)?.forward(&se)?, ad)?;
        let cap = mb.text_tensor(cd, &self.dev)?;
        let y = match &lay.caption {
            Some([l1, l2]) => caption_forward(
                &cap,
                &CaptionWeights {
                    linear_1: self.linear(*l1, true)?,
                    linear_2: self.linear(*l2, true)?,
                },
            )?,
            None => cap.clone(),
        };
        let t6_leaf = Var::from_tensor(&t6.detach())?;
        let emb_leaf = Var::from_tensor(&emb.detach())?;
        let y_leaf = Var::from_tensor(&y.detach())?;
        rec.mark(tag("embed".into()));

        // Blocks.
        let mut saved: Vec<Saved> = Vec::with_capacity(d.depth);
        let mut cur = x0.clone();
        for i in 0..d.depth {
            if self.spec.recipe.recompute.recomputes_block(i as u32) {
                let input = cur.detach();
                let w = self.pixart_block_weights(&lay.blocks[i], false)?;
                cur = pixart_block_forward(
                    &input,
                    &t6_leaf.as_detached_tensor(),
                    &y_leaf.as_detached_tensor(),
                    &w,
                    &self.cfg,
                )?;
                saved.push(Saved::Recompute { input });
            } else {
                let leaf = Var::from_tensor(&cur.detach())?;
                let w = self.pixart_block_weights(&lay.blocks[i], true)?;
                let out = pixart_block_forward(
                    leaf.as_tensor(),
                    t6_leaf.as_tensor(),
                    y_leaf.as_tensor(),
                    &w,
                    &self.cfg,
                )?;
                cur = out.clone();
                saved.push(Saved::Stored { leaf, out });
            }
            rec.mark(tag(format!("block {i}")));
        }

        // Output side and loss.
        let final_leaf = Var::from_tensor(&cur.detach())?;
        drop(cur);
        let fw = PixartFinalWeights {
            table: self.table_weight(lay.final_table, true)?,
            proj_out: self.linear(lay.proj_out, true)?,
        };
        let pred = {
            let out = final_forward(final_leaf.as_tensor(), emb_leaf.as_tensor(), &fw, cd, ad)?;
            unpatchify(&out, b, &d)?.narrow(1, 0, d.in_channels)?
        };
        drop(fw);
        let pred = cast(pred, ld)?;
        let target = mb.target(&self.acp, self.spec.recipe.prediction, ld, &self.dev)?;
        let loss = (pred - target)?.sqr()?.mean_all()?;
        let loss_value = loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        rec.mark(tag("final".into()));

        rec.enter(Phase::Backward);
        let factor = self.grad_scale / accum as f64;
        let grads = loss.affine(factor, 0.0)?.backward()?;
        drop(loss);
        let mut final_params = Self::linear_params(&lay.proj_out);
        final_params.push(lay.final_table);
        self.accumulate(&final_params, &grads)?;
        let mut gx = grads
            .get(final_leaf.as_tensor())
            .map(Tensor::detach)
            .ok_or_else(|| {
                EngineError::bad_input("backward", "no gradient reached the final layer input")
            })?;
        let g_emb = match grads.get(emb_leaf.as_tensor()) {
            Some(g) => cast(g.detach(), ld)?,
            None => Tensor::zeros((b, d.hidden), ld, &self.dev)?,
        };
        drop(grads);
        drop(final_leaf);
        let mut g6 = Tensor::zeros((b, 6 * d.hidden), ld, &self.dev)?;
        let mut gy = Tensor::zeros((b * t_tokens, d.hidden), ld, &self.dev)?;
        rec.mark(tag("final".into()));

        for i in (0..d.depth).rev() {
            let s = saved
                .pop()
                .ok_or_else(|| EngineError::bad_input("backward", "block state missing"))?;
            let (leaf, out) = match s {
                Saved::Stored { leaf, out } => (leaf, out),
                Saved::Recompute { input } => {
                    let leaf = Var::from_tensor(&input)?;
                    drop(input);
                    let w = self.pixart_block_weights(&lay.blocks[i], true)?;
                    let out = pixart_block_forward(
                        leaf.as_tensor(),
                        t6_leaf.as_tensor(),
                        y_leaf.as_tensor(),
                        &w,
                        &self.cfg,
                    )?;
                    (leaf, out)
                }
            };
            let grads = crate::ops::backward_from(&out, &gx)?;
            drop(out);
            let blk = &lay.blocks[i];
            let mut idx = vec![blk.table];
            for l in &blk.lin {
                idx.extend(Self::linear_params(l));
            }
            self.accumulate(&idx, &grads)?;
            gx = grads
                .get(leaf.as_tensor())
                .map(Tensor::detach)
                .ok_or_else(|| {
                    EngineError::bad_input(
                        "backward",
                        format!("no gradient reached block {i}'s input"),
                    )
                })?;
            if let Some(g) = grads.get(t6_leaf.as_tensor()) {
                g6 = (g6 + cast(g.detach(), ld)?)?;
            }
            if let Some(g) = grads.get(y_leaf.as_tensor()) {
                gy = (gy + cast(g.detach(), ld)?)?;
            }
            drop(grads);
            drop(leaf);
            rec.mark(tag(format!("block {i}")));
        }

        // Embed segment backward: one surrogate over the four outputs.
        let (g6, g_emb, gy) = (cast(g6, ad)?, cast(g_emb, ad)?, cast(gy, cd)?);
        let dt = x0.dtype();
        let sur = (((x0.mul(&gx)?.sum_all()? + t6.mul(&g6)?.sum_all()?)?
            + emb.mul(&g_emb)?.sum_all()?)?
            + cast(y.mul(&gy)?.sum_all()?, dt)?)?;
        let grads = sur.backward()?;
        drop(sur);
        let mut idx = Vec::new();
        let mut embed = vec![lay.patch, lay.t1, lay.t2, lay.adaln];
        embed.extend(lay.caption.iter().flatten().copied());
        for l in &embed {
            idx.extend(Self::linear_params(l));
        }
        self.accumulate(&idx, &grads)?;
        drop(grads);
        // The conditioning leaves go with the embed's outputs (the budget frees them together).
        drop((x0, t6, emb, y, gx, g6, g_emb, gy));
        drop((t6_leaf, emb_leaf, y_leaf));
        rec.mark(tag("embed".into()));
        Ok(loss_value)
    }
}
