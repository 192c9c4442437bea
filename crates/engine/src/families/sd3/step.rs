//! SD3 on the trainer: where its parameters sit and its three segments (embed, joint block,
//! output side) as the family schedule runs them.
//!
//! Embed (kept until the end of the backward): the patch embedding plus the cropped sin-cos
//! table (the image stream, `ad`), `context_embedder` on the cached caption (the context
//! stream, `ad`), and SiLU(temb) in `cd` with temb = the timestep MLP + the pooled-text MLP:
//! every modulation linear (`norm1`, `norm1_context`, `norm_out`) reads SiLU(temb), so it is the
//! one conditioning tensor, made once. Streams enter block 0 as [context, image]; the last
//! block (`context_pre_only`) returns [image].

use std::sync::Arc;

use candle_core::Tensor;

use crate::diffusion::Batch;
use crate::error::{EngineError, Result};
use crate::families::sd3::{
    block_linears, final_forward, sd3_block_forward, silu_mlp, ContextOut, DualAttn,
    Sd3BlockWeights, Sd3Geom, DUAL_LINEARS, DUAL_QK_NORMS, QK_NORMS, SD3_FREQ,
};
use crate::layers::cast;
use crate::model::{patchify, timestep_features, unpatchify};
use crate::shapes::Dims;
use crate::trainer::family::{check_pooled_text, BlockIn, Embedded, FamilyStep};
use crate::trainer::state::{FamilyLayout, LinearIdx, ModelLayout, ParamIndex, Trainer};

/// Where one joint block's parameters sit: its linears in [`block_linears`] order and the q/k
/// norm weights.
#[derive(Debug, Clone)]
pub(crate) struct Sd3BlockIdx {
    lin: Vec<LinearIdx>,
    qk: Option<[usize; 4]>,
    /// A dual-attention block's `attn2` linears ([`DUAL_LINEARS`] order) and q/k norms.
    dual: Option<([LinearIdx; 4], Option<[usize; 2]>)>,
}

/// Where SD3's parameters sit in `Trainer::params`.
#[derive(Debug, Clone)]
pub(crate) struct Sd3Layout {
    patch: LinearIdx,
    pos: usize,
    t1: LinearIdx,
    t2: LinearIdx,
    p1: LinearIdx,
    p2: LinearIdx,
    context: LinearIdx,
    blocks: Vec<Sd3BlockIdx>,
    norm_out: LinearIdx,
    proj_out: LinearIdx,
    pub(crate) geom: Sd3Geom,
}

impl Sd3Layout {
    pub(crate) fn new(p: &ParamIndex<'_>, depth: usize, geom: Sd3Geom) -> Result<Sd3Layout> {
        let blocks = p.blocks("transformer_blocks", depth, |i, b| {
            let l = block_linears(i + 1 == depth)
                .into_iter()
                .map(|n| p.lin(&format!("{b}.{n}")))
                .collect::<Result<Vec<_>>>()?;
            let qk = if geom.qk_norm {
                let n = |k: usize| p.idx(&format!("{b}.{}.weight", QK_NORMS[k]));
                Some([n(0)?, n(1)?, n(2)?, n(3)?])
            } else {
                None
            };
            let dual = if geom.is_dual(i) {
                let l = |k: usize| p.lin(&format!("{b}.{}", DUAL_LINEARS[k]));
                let qk = if geom.qk_norm {
                    let n = |k: usize| p.idx(&format!("{b}.{}.weight", DUAL_QK_NORMS[k]));
                    Some([n(0)?, n(1)?])
                } else {
                    None
                };
                Some(([l(0)?, l(1)?, l(2)?, l(3)?], qk))
            } else {
                None
            };
            Ok(Sd3BlockIdx { lin: l, qk, dual })
        })?;
        let te = "time_text_embed.timestep_embedder";
        let pe = "time_text_embed.text_embedder";
        Ok(Sd3Layout {
            patch: p.lin("pos_embed.proj")?,
            pos: p.idx("pos_embed.pos_embed")?,
            t1: p.lin(&format!("{te}.linear_1"))?,
            t2: p.lin(&format!("{te}.linear_2"))?,
            p1: p.lin(&format!("{pe}.linear_1"))?,
            p2: p.lin(&format!("{pe}.linear_2"))?,
            context: p.lin("context_embedder")?,
            blocks,
            norm_out: p.lin("norm_out.linear")?,
            proj_out: p.lin("proj_out")?,
            geom,
        })
    }
}

impl Trainer {
    pub(crate) fn sd3_block_weights(
        &self,
        lay: &Sd3Layout,
        i: usize,
        track: bool,
    ) -> Result<Sd3BlockWeights> {
        let b = &lay.blocks[i];
        let l = |k: usize| self.linear(b.lin[k], track);
        let last = i + 1 == lay.depth();
        // block_linears order: norm1, norm1_context, to_q, to_k, to_v, add_k, add_v, add_q,
        // to_out.0, [to_add_out], ff.0, ff.2, [ff_context.0, ff_context.2].
        let (ff, ctx) = if last {
            (9, None)
        } else {
            (
                10,
                Some(ContextOut {
                    to_add_out: l(9)?,
                    ff1: l(12)?,
                    ff2: l(13)?,
                }),
            )
        };
        let qk = match b.qk {
            Some(q) => Some([
                self.weight(q[0], track)?,
                self.weight(q[1], track)?,
                self.weight(q[2], track)?,
                self.weight(q[3], track)?,
            ]),
            None => None,
        };
        let dual = match &b.dual {
            Some((d, n)) => Some(DualAttn {
                to_q: self.linear(d[0], track)?,
                to_k: self.linear(d[1], track)?,
                to_v: self.linear(d[2], track)?,
                to_out: self.linear(d[3], track)?,
                qk: match n {
                    Some(n) => Some([self.weight(n[0], track)?, self.weight(n[1], track)?]),
                    None => None,
                },
            }),
            None => None,
        };
        Ok(Sd3BlockWeights {
            norm1: l(0)?,
            norm1_context: l(1)?,
            to_q: l(2)?,
            to_k: l(3)?,
            to_v: l(4)?,
            add_k: l(5)?,
            add_v: l(6)?,
            add_q: l(7)?,
            to_out: l(8)?,
            ff1: l(ff)?,
            ff2: l(ff + 1)?,
            ctx,
            qk,
            dual,
        })
    }
}

impl FamilyStep for Sd3Layout {
    /// The joint block's linears, then its second attention's (SD3.5's dual blocks).
    fn block_linears(&self, i: usize) -> Vec<LinearIdx> {
        let b = &self.blocks[i];
        let mut v = b.lin.clone();
        v.extend(b.dual.iter().flat_map(|(d, _)| d.iter().copied()));
        v
    }

    fn final_linears(&self) -> Vec<LinearIdx> {
        vec![self.norm_out, self.proj_out]
    }

    /// The embed segment on a microbatch (tracked graph).
    fn embed(&self, tr: &Trainer, mb: &Batch) -> Result<Embedded> {
        let lay = self;
        let d = tr.dims;
        let g = &lay.geom;
        let (cd, ad) = (tr.cfg.compute, tr.cfg.accum);
        let b = mb.n;
        check_pooled_text(mb, g.text_tokens, g.text_width, g.pooled_width)?;
        // Image stream: patches + the position table cropped to the token grid (centred, as
        // diffusers' `cropped_pos_embed`), a strided view the sum reads in place.
        let (xp, xe) = tr.patch_embed(mb, lay.patch, |xt| patchify(xt, &d))?;
        let side = g.pos_side;
        let (top, left) = ((side - d.rows) / 2, (side - d.cols) / 2);
        let pos = tr
            .raw_weight(lay.pos, true)
            .reshape((side, side, d.hidden))?
            .narrow(0, top, d.rows)?
            .narrow(1, left, d.cols)?;
        let x0 = cast(xe, ad)?
            .reshape((b, d.rows, d.cols, d.hidden))?
            .broadcast_add(&pos)?
            .reshape((b, d.tokens, d.hidden))?;
        // temb = timestep MLP + pooled-text MLP; every block reads SiLU(temb).
        let tf = cast(timestep_features(&mb.timesteps, SD3_FREQ, ad, &tr.dev)?, cd)?;
        let tt = silu_mlp(&tf, &tr.linear(lay.t1, true)?, &tr.linear(lay.t2, true)?)?;
        let pooled = mb.pooled_tensor(cd, &tr.dev)?;
        let tp = silu_mlp(
            &pooled,
            &tr.linear(lay.p1, true)?,
            &tr.linear(lay.p2, true)?,
        )?;
        let se = (tt + tp)?.silu()?;
        // Context stream: context_embedder on the cached caption.
        let cap = mb.text_tensor(cd, &tr.dev)?;
        let c0 = cast(tr.linear(lay.context, true)?.forward(&cap)?, ad)?.reshape((
            b,
            g.text_tokens,
            d.hidden,
        ))?;
        Ok(Embedded {
            streams: vec![c0, x0],
            conds: vec![se],
            hold: vec![xp, tf, pooled, cap],
        })
    }

    fn depth(&self) -> usize {
        self.blocks.len()
    }

    /// Joint block `i` on the streams [context, image] with the conditioning [SiLU(temb)].
    fn block(&self, tr: &Trainer, i: usize, b: BlockIn<'_>) -> Result<Vec<Tensor>> {
        let BlockIn { x, c, track } = b;
        let ([ctx, img], [se]) = (x, c) else {
            return Err(EngineError::bad_input(
                "sd3 block",
                format!(
                    "{} streams and {} conditioning tensors; a joint block reads [context, image] \
                     and [SiLU(temb)]",
                    x.len(),
                    c.len()
                ),
            ));
        };
        let w = tr.sd3_block_weights(self, i, track)?;
        sd3_block_forward(ctx, img, se, &w, &tr.cfg)
    }

    /// The output side on the image stream: the prediction in the latents' layout, `ad`.
    fn final_layer(&self, tr: &Trainer, x: &[Tensor], c: &[Tensor], mb: &Batch) -> Result<Tensor> {
        let lay = self;
        let ([img], [se]) = (x, c) else {
            return Err(EngineError::bad_input(
                "sd3 output",
                "the output side reads the image stream alone after the context_pre_only block",
            ));
        };
        let d = tr.dims;
        let (cd, ad) = (tr.cfg.compute, tr.cfg.accum);
        let out = final_forward(
            img,
            se,
            &tr.linear(lay.norm_out, true)?,
            &tr.linear(lay.proj_out, true)?,
            cd,
            ad,
        )?;
        Ok(unpatchify(&out, mb.n, &d)?.narrow(1, 0, d.in_channels)?)
    }

    fn embed_linears(&self) -> Vec<LinearIdx> {
        vec![self.patch, self.t1, self.t2, self.p1, self.p2, self.context]
    }

    fn block_params(&self, i: usize) -> Vec<usize> {
        let b = &self.blocks[i];
        let mut v: Vec<usize> = b.lin.iter().flat_map(Trainer::linear_params).collect();
        v.extend(b.qk.iter().flatten().copied());
        if let Some((d, n)) = &b.dual {
            v.extend(d.iter().flat_map(Trainer::linear_params));
            v.extend(n.iter().flatten().copied());
        }
        v
    }
}

impl FamilyLayout for Sd3Geom {
    fn layout(&self, p: &ParamIndex<'_>, d: &Dims) -> Result<Arc<dyn ModelLayout>> {
        Ok(Arc::new(Sd3Layout::new(p, d.depth, self.clone())?))
    }
}
