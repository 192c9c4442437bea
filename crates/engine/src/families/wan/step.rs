//! Wan's segments for the family schedule ([`crate::trainer::family`]).
//!
//! Embed: the 3-D patchify + `patch_embedding` (the one stream), the timestep MLP (`temb`,
//! (b, D)), `time_proj` on its SiLU (the (b, 6D) block modulation), the text projection of the
//! umT5 states (b·T, D) in the compute dtype, and the per-step RoPE tables (s, d_h/2) (f32,
//! f64 under fp64). The conditioning is `[t6, temb, ctx, cos, sin]`: blocks read t6, ctx and
//! the tables, the final layer temb; nothing differentiates the tables (the RoPE op holds
//! them as constants), so their summed gradients stay the zeros the schedule makes.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::diffusion::Batch;
use crate::error::Result;
use crate::families::pixart::step::TableFinal;
use crate::families::wan::{
    final_forward, patchify3d, rope_tables, text_forward, unpatchify3d, wan_block_forward,
    WanBlockWeights, WanConds, WanFinalWeights, WanGeom, WAN_BLOCK_LINEARS, WAN_BLOCK_NORMS,
};
use crate::layers::cast;
use crate::shapes::Dims;
use crate::trainer::family::{check_text, params_of, BlockIn, Embedded, FamilyStep};
use crate::trainer::state::{FamilyLayout, LinearIdx, ModelLayout, ParamIndex, Trainer};

/// Where one Wan block's parameters sit.
#[derive(Debug, Clone)]
pub(crate) struct WanBlockIdx {
    table: usize,
    lin: [LinearIdx; 10],
    norms: [usize; 4],
    norm2: Option<(usize, usize)>,
}

/// Where Wan's parameters sit in `Trainer::params`.
#[derive(Debug, Clone)]
pub(crate) struct WanLayout {
    patch: LinearIdx,
    t1: LinearIdx,
    t2: LinearIdx,
    time_proj: LinearIdx,
    text: [LinearIdx; 2],
    blocks: Vec<WanBlockIdx>,
    out: TableFinal,
    geom: WanGeom,
}

impl WanLayout {
    pub(crate) fn new(p: &ParamIndex<'_>, depth: usize, geom: WanGeom) -> Result<WanLayout> {
        let blocks = p.blocks("blocks", depth, |_, b| {
            let l = p.lins(b, WAN_BLOCK_LINEARS)?;
            let mut norms = [0; 4];
            for (slot, name) in norms.iter_mut().zip(WAN_BLOCK_NORMS) {
                *slot = p.idx(&format!("{b}.{name}.weight"))?;
            }
            let norm2 = if geom.cross_attn_norm {
                Some((
                    p.idx(&format!("{b}.norm2.weight"))?,
                    p.idx(&format!("{b}.norm2.bias"))?,
                ))
            } else {
                None
            };
            Ok(WanBlockIdx {
                table: p.idx(&format!("{b}.scale_shift_table"))?,
                lin: l,
                norms,
                norm2,
            })
        })?;
        let ce = "condition_embedder";
        Ok(WanLayout {
            patch: p.lin("patch_embedding")?,
            t1: p.lin(&format!("{ce}.time_embedder.linear_1"))?,
            t2: p.lin(&format!("{ce}.time_embedder.linear_2"))?,
            time_proj: p.lin(&format!("{ce}.time_proj"))?,
            text: [
                p.lin(&format!("{ce}.text_embedder.linear_1"))?,
                p.lin(&format!("{ce}.text_embedder.linear_2"))?,
            ],
            blocks,
            out: TableFinal::new(p)?,
            geom,
        })
    }
}

impl Trainer {
    pub(crate) fn wan_block_weights(
        &self,
        b: &WanBlockIdx,
        track: bool,
    ) -> Result<WanBlockWeights> {
        let l = |k: usize| self.linear(b.lin[k], track);
        let n = |k: usize| self.weight(b.norms[k], track);
        let table = self.table_weight(b.table, track)?;
        let [q1, k1, v1, o1, q2, k2, v2, o2] = self.self_cross_attn_linears(l, track)?;
        Ok(WanBlockWeights {
            table,
            q1,
            k1,
            v1,
            o1,
            norm_q1: n(0)?,
            norm_k1: n(1)?,
            q2,
            k2,
            v2,
            o2,
            norm_q2: n(2)?,
            norm_k2: n(3)?,
            norm2: match b.norm2 {
                Some((w, bias)) => Some((
                    self.table_weight(w, track)?,
                    self.table_weight(bias, track)?,
                )),
                None => None,
            },
            fc1: l(8)?,
            fc2: l(9)?,
        })
    }
}

impl FamilyStep for WanLayout {
    fn block_linears(&self, i: usize) -> Vec<LinearIdx> {
        self.blocks[i].lin.to_vec()
    }

    fn final_linears(&self) -> Vec<LinearIdx> {
        vec![self.out.proj_out]
    }

    fn embed(&self, tr: &Trainer, mb: &Batch) -> Result<Embedded> {
        let d = tr.dims;
        let g = &self.geom;
        let (cd, ad) = (tr.cfg.compute, tr.cfg.accum);
        let b = mb.n;
        check_text(mb, g.text_tokens, g.text_dim)?;
        let (xp, xe) = tr.patch_embed(mb, self.patch, |xt| {
            patchify3d(xt, d.in_channels, g.frames, d.rows, d.cols, d.patch)
        })?;
        let x0 = cast(xe, ad)?.reshape((b, d.tokens, d.hidden))?;
        let [tf, t1, temb] = tr.timestep_mlp(mb, g.freq, [self.t1, self.t2])?;
        let (st, t6) = tr.adaln_single(&temb, self.time_proj)?;
        let cap = mb.text_tensor(cd, &tr.dev)?;
        let ctx = text_forward(
            &cap,
            &tr.linear(self.text[0], true)?,
            &tr.linear(self.text[1], true)?,
        )?;
        let rd = if cd == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let (cv, sv) = rope_tables(g, d.rows, d.cols);
        let half = cv.len() / d.tokens.max(1);
        let cos = Tensor::from_vec(cv, (d.tokens, half), &tr.dev)?.to_dtype(rd)?;
        let sin = Tensor::from_vec(sv, (d.tokens, half), &tr.dev)?.to_dtype(rd)?;
        Ok(Embedded {
            streams: vec![x0],
            conds: vec![t6, temb, ctx, cos, sin],
            hold: vec![xp, tf, t1, st, cap],
        })
    }

    /// `ctx`, the projected text, third of the conditioning.
    fn ctx_cond(&self) -> Option<usize> {
        Some(2)
    }

    fn depth(&self) -> usize {
        self.blocks.len()
    }

    fn block(&self, tr: &Trainer, i: usize, b: BlockIn<'_>) -> Result<Vec<Tensor>> {
        let BlockIn { x, c, track } = b;
        let w = tr.wan_block_weights(&self.blocks[i], track)?;
        let conds = WanConds {
            t6: &c[0],
            ctx: &c[2],
            cos: &c[3],
            sin: &c[4],
        };
        Ok(vec![wan_block_forward(&x[0], conds, &w, &tr.cfg)?])
    }

    fn final_layer(&self, tr: &Trainer, x: &[Tensor], c: &[Tensor], mb: &Batch) -> Result<Tensor> {
        let d = tr.dims;
        let g = &self.geom;
        let (table, proj_out) = self.out.weights(tr)?;
        let fw = WanFinalWeights { table, proj_out };
        let out = final_forward(&x[0], &c[1], &fw, tr.cfg.compute, tr.cfg.accum)?;
        drop(fw);
        let shape: Vec<usize> = if g.frames == 1 {
            vec![mb.n, g.out_channels, d.latent_h, d.latent_w]
        } else {
            vec![mb.n, g.out_channels, g.frames, d.latent_h, d.latent_w]
        };
        let geo = (g.out_channels, g.frames, d.rows, d.cols, d.patch);
        let pred = unpatchify3d(&out, mb.n, geo, &shape)?;
        Ok(pred.narrow(1, 0, d.in_channels)?)
    }

    fn embed_linears(&self) -> Vec<LinearIdx> {
        let mut embed = vec![self.patch, self.t1, self.t2, self.time_proj];
        embed.extend(self.text);
        embed
    }

    fn block_params(&self, i: usize) -> Vec<usize> {
        let blk = &self.blocks[i];
        let mut idx = vec![blk.table];
        idx.extend(blk.norms);
        if let Some((w, b)) = blk.norm2 {
            idx.extend([w, b]);
        }
        idx.extend(params_of(&blk.lin));
        idx
    }

    fn final_params(&self) -> Vec<usize> {
        self.out.params()
    }
}

impl FamilyLayout for WanGeom {
    fn layout(&self, p: &ParamIndex<'_>, d: &Dims) -> Result<Arc<dyn ModelLayout>> {
        Ok(Arc::new(WanLayout::new(p, d.depth, self.clone())?))
    }
}
