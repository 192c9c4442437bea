//! PixArt's segments for the family schedule ([`crate::trainer::family`]).
//!
//! Embed: patch embedding + the sin-cos table (the one stream), the timestep MLP (the embedded
//! timestep, (b, D); with PixArt-α's additional conditions plus the resolution and aspect-ratio
//! embedders' (b, 2D/3) ⊕ (b, D/3)), `adaln_single.linear` on its SiLU (the (b, 6D) block modulation) and the
//! caption projection (b·T, D) in the compute dtype. The conditioning is `[t6, emb, y]`: blocks
//! read t6 and y, the final layer emb.

use std::sync::Arc;

use candle_core::Tensor;

use crate::diffusion::Batch;
use crate::error::Result;
use crate::families::pixart::params::{PIXART_FREQ, SIZE_EMBEDDERS};
use crate::families::pixart::{
    caption_forward, final_forward, pixart_block_forward, CaptionWeights, PixartBlockWeights,
    PixartFinalWeights, PixartGeom, PIXART_BLOCK_LINEARS,
};
use crate::layers::{cast, LinearW};
use crate::model::{patchify, sinusoid_features, unpatchify};
use crate::shapes::Dims;
use crate::trainer::family::{check_text, params_of, BlockIn, Embedded, FamilyStep};
use crate::trainer::state::{FamilyLayout, LinearIdx, ModelLayout, ParamIndex, Trainer};

/// Where one PixArt block's parameters sit.
#[derive(Debug, Clone)]
pub(crate) struct PixartBlockIdx {
    table: usize,
    lin: [LinearIdx; 10],
}

/// Where PixArt's parameters sit in `Trainer::params`.
#[derive(Debug, Clone)]
pub(crate) struct PixartLayout {
    patch: LinearIdx,
    pos: usize,
    t1: LinearIdx,
    /// PixArt-α's resolution embedder's and aspect-ratio embedder's linears (linear_1,
    /// linear_2 each), with `use_additional_conditions`.
    sizes: Option<[LinearIdx; 4]>,
    t2: LinearIdx,
    adaln: LinearIdx,
    caption: Option<[LinearIdx; 2]>,
    blocks: Vec<PixartBlockIdx>,
    out: TableFinal,
    geom: PixartGeom,
}

/// Where an output side of PixArt's kind sits (PixArt's, Sana's, Wan's): the final
/// `scale_shift_table` and `proj_out`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TableFinal {
    pub(crate) table: usize,
    pub(crate) proj_out: LinearIdx,
}

impl TableFinal {
    pub(crate) fn new(p: &ParamIndex<'_>) -> Result<TableFinal> {
        Ok(TableFinal {
            table: p.idx("scale_shift_table")?,
            proj_out: p.lin("proj_out")?,
        })
    }

    /// Its parameter indices: `proj_out`'s, then the table.
    pub(crate) fn params(&self) -> Vec<usize> {
        let mut idx = Trainer::linear_params(&self.proj_out);
        idx.push(self.table);
        idx
    }

    /// The table in the accumulation dtype and `proj_out`, tracked.
    pub(crate) fn weights(&self, tr: &Trainer) -> Result<(Tensor, LinearW)> {
        Ok((
            tr.table_weight(self.table, true)?,
            tr.linear(self.proj_out, true)?,
        ))
    }

    /// PixArt's output side ([`final_forward`], also Sana's) on the stream `x` and the embedded
    /// timestep `emb`: the prediction in the latents' layout, accumulation dtype.
    pub(crate) fn pixart_forward(
        &self,
        tr: &Trainer,
        x: &Tensor,
        emb: &Tensor,
        mb: &Batch,
    ) -> Result<Tensor> {
        let d = tr.dims;
        let (table, proj_out) = self.weights(tr)?;
        let fw = PixartFinalWeights { table, proj_out };
        let out = final_forward(x, emb, &fw, tr.cfg.compute, tr.cfg.accum)?;
        let pred = unpatchify(&out, mb.n, &d)?.narrow(1, 0, d.in_channels)?;
        drop(fw);
        Ok(pred)
    }
}

impl PixartLayout {
    pub(crate) fn new(p: &ParamIndex<'_>, depth: usize, geom: PixartGeom) -> Result<PixartLayout> {
        let blocks = p.blocks("transformer_blocks", depth, |_, b| {
            let l = p.lins(b, PIXART_BLOCK_LINEARS)?;
            Ok(PixartBlockIdx {
                table: p.idx(&format!("{b}.scale_shift_table"))?,
                lin: l,
            })
        })?;
        let te = "adaln_single.emb.timestep_embedder";
        Ok(PixartLayout {
            patch: p.lin("pos_embed.proj")?,
            pos: p.idx("pos_embed.pos_embed")?,
            t1: p.lin(&format!("{te}.linear_1"))?,
            t2: p.lin(&format!("{te}.linear_2"))?,
            sizes: match geom.sizes {
                Some(_) => {
                    let l = |e: &str, k: u8| p.lin(&format!("adaln_single.emb.{e}.linear_{k}"));
                    let [r, a] = SIZE_EMBEDDERS;
                    Some([l(r, 1)?, l(r, 2)?, l(a, 1)?, l(a, 2)?])
                }
                None => None,
            },
            adaln: p.lin("adaln_single.linear")?,
            caption: if geom.caption_projection {
                Some([
                    p.lin("caption_projection.linear_1")?,
                    p.lin("caption_projection.linear_2")?,
                ])
            } else {
                None
            },
            blocks,
            out: TableFinal::new(p)?,
            geom,
        })
    }
}

impl Trainer {
    /// A parameter that is not a linear and is read in the accumulation dtype (PixArt's, Sana's
    /// and Wan's `scale_shift_table`s, Wan's `norm2`; a cast copy only when the dtypes differ).
    pub(crate) fn table_weight(&self, i: usize, track: bool) -> Result<Tensor> {
        cast(self.raw_weight(i, track), self.cfg.accum)
    }

    /// The eight attention linears of a block with a self- and a cross-attention (PixArt's,
    /// Sana's, Wan's): `lin(k)` for k in 0..8, in `cross::self_cross_block_linears` order; the
    /// cross-attention's k and v add their input's gradient into the context sink.
    pub(crate) fn self_cross_attn_linears(
        &self,
        lin: impl Fn(usize) -> Result<LinearW>,
        track: bool,
    ) -> Result<[LinearW; 8]> {
        let sink = || self.ctx_sink_for(track);
        Ok([
            lin(0)?,
            lin(1)?,
            lin(2)?,
            lin(3)?,
            lin(4)?,
            lin(5)?.with_input_sink(sink()),
            lin(6)?.with_input_sink(sink()),
            lin(7)?,
        ])
    }

    pub(crate) fn pixart_block_weights(
        &self,
        b: &PixartBlockIdx,
        track: bool,
    ) -> Result<PixartBlockWeights> {
        let l = |k: usize| self.linear(b.lin[k], track);
        let table = self.table_weight(b.table, track)?;
        let attn = self.self_cross_attn_linears(l, track)?;
        Ok(PixartBlockWeights::new(table, attn, [l(8)?, l(9)?]))
    }
}

impl FamilyStep for PixartLayout {
    fn block_linears(&self, i: usize) -> Vec<LinearIdx> {
        self.blocks[i].lin.to_vec()
    }

    fn final_linears(&self) -> Vec<LinearIdx> {
        vec![self.out.proj_out]
    }

    fn embed(&self, tr: &Trainer, mb: &Batch) -> Result<Embedded> {
        let d = tr.dims;
        let (cd, ad) = (tr.cfg.compute, tr.cfg.accum);
        let b = mb.n;
        check_text(mb, self.geom.text_tokens, self.geom.text_width)?;
        let (xp, xe) = tr.patch_embed(mb, self.patch, |xt| patchify(xt, &d))?;
        let pos = tr.raw_weight(self.pos, true);
        let x0 = cast(xe, ad)?
            .reshape((b, d.tokens, d.hidden))?
            .broadcast_add(&pos)?;
        let [tf, t1, emb] = tr.timestep_mlp(mb, PIXART_FREQ, [self.t1, self.t2])?;
        // PixArt-α's additional conditions: emb + cat[resolution_embedder(sinusoids of (h, w))
        // as (b, 2·D/3), aspect_ratio_embedder(sinusoids of h/w) (b, D/3)] (diffusers
        // `PixArtAlphaCombinedTimestepSizeEmbeddings.forward`).
        let (emb, size_hold) = match (self.sizes, self.geom.sizes) {
            (Some([r1, r2, a1, a2]), Some((hp, wp))) => {
                let (hp, wp) = (f64::from(hp), f64::from(wp));
                let mlp = |l1: LinearIdx, l2: LinearIdx, values: &[f64]| -> Result<Tensor> {
                    let f = cast(sinusoid_features(values, PIXART_FREQ, ad, &tr.dev)?, cd)?;
                    let h = tr.linear(l1, true)?.forward(&f)?.silu()?;
                    cast(tr.linear(l2, true)?.forward(&h)?, ad)
                };
                let res: Vec<f64> = (0..b).flat_map(|_| [hp, wp]).collect();
                let r = mlp(r1, r2, &res)?.reshape((b, 2 * (d.hidden / 3)))?;
                let a = mlp(a1, a2, &vec![hp / wp; b])?;
                // Per sample the resolution's 2D/3 then the aspect ratio's D/3: `torch.cat(…,
                // dim=1)` as the engine's fused concat (its twin: `ops::concat`).
                let sizes = crate::ops::tokens::concat(&r, &a, b, (b, d.hidden))?;
                ((&emb + &sizes)?, vec![emb, r, a, sizes])
            }
            _ => (emb, Vec::new()),
        };
        let (se, t6) = tr.adaln_single(&emb, self.adaln)?;
        let cap = mb.text_tensor(cd, &tr.dev)?;
        let y = match &self.caption {
            Some([l1, l2]) => caption_forward(
                &cap,
                &CaptionWeights {
                    linear_1: tr.linear(*l1, true)?,
                    linear_2: tr.linear(*l2, true)?,
                },
            )?,
            None => cap.clone(),
        };
        Ok(Embedded {
            streams: vec![x0],
            conds: vec![t6, emb, y],
            hold: [vec![xp, pos, tf, t1, se, cap], size_hold].concat(),
        })
    }

    /// `y`, the projected text, third of the conditioning.
    fn ctx_cond(&self) -> Option<usize> {
        Some(2)
    }

    fn depth(&self) -> usize {
        self.blocks.len()
    }

    fn block(&self, tr: &Trainer, i: usize, b: BlockIn<'_>) -> Result<Vec<Tensor>> {
        let BlockIn { x, c, track } = b;
        let w = tr.pixart_block_weights(&self.blocks[i], track)?;
        let out = pixart_block_forward(&x[0], &c[0], &c[2], &w, &tr.cfg)?;
        Ok(vec![out])
    }

    fn final_layer(&self, tr: &Trainer, x: &[Tensor], c: &[Tensor], mb: &Batch) -> Result<Tensor> {
        self.out.pixart_forward(tr, &x[0], &c[1], mb)
    }

    fn embed_linears(&self) -> Vec<LinearIdx> {
        let mut embed = vec![self.patch, self.t1, self.t2];
        embed.extend(self.sizes.iter().flatten().copied());
        embed.push(self.adaln);
        embed.extend(self.caption.iter().flatten().copied());
        embed
    }

    fn block_params(&self, i: usize) -> Vec<usize> {
        let blk = &self.blocks[i];
        let mut idx = vec![blk.table];
        idx.extend(params_of(&blk.lin));
        idx
    }

    fn final_params(&self) -> Vec<usize> {
        self.out.params()
    }
}

impl FamilyLayout for PixartGeom {
    fn layout(&self, p: &ParamIndex<'_>, d: &Dims) -> Result<Arc<dyn ModelLayout>> {
        Ok(Arc::new(PixartLayout::new(p, d.depth, self.clone())?))
    }
}
