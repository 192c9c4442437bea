//! Sana's segments for the family schedule ([`crate::trainer::family`]).
//!
//! Embed: the patch embedding (the one stream; no position table), the timestep MLP (the
//! embedded timestep, (b, D)), `time_embed.linear` on its SiLU (the (b, 6D) block modulation)
//! and the caption projection + `caption_norm` (b·T, D) in the compute dtype. The conditioning
//! is `[t6, emb, y]`: blocks read t6 and y, the final layer emb.
//!
//! A linear without a bias in diffusers (attn1's q/k/v unless `attention_bias`, `conv_point`)
//! runs as the fused linear on a zero bias that the block's weights share ([`zero_bias`]); its
//! weight's gradient goes to a sink that takes dW only.

use std::sync::Arc;

use candle_core::Tensor;

use crate::diffusion::Batch;
use crate::error::Result;
use crate::families::lora::factor_indices;
use crate::families::pixart::step::TableFinal;
use crate::families::sana::{
    caption_forward, sana_block_forward, zero_bias, SanaBlockGeom, SanaBlockWeights,
    SanaCaptionWeights, SanaGeom, SANA_BLOCK_LINEARS, SANA_FREQ,
};
use crate::layers::cast;
use crate::layers::LinearW;
use crate::model::patchify;
use crate::shapes::Dims;
use crate::trainer::family::{check_text, params_of, BlockIn, Embedded, FamilyStep};
use crate::trainer::state::{FamilyLayout, LinearIdx, ModelLayout, ParamIndex, Trainer};

/// A linear's weight, its bias when it has one, and its LoRA factors (A, B) when adapted.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lin {
    w: usize,
    b: Option<usize>,
    lora: Option<(usize, usize)>,
}

/// Where one Sana block's parameters sit: the table, then attn1's q, k, v, out, attn2's q, k,
/// v, out, `conv_inverted`, `conv_point` (in `lin`), and `conv_depth`'s weight and bias.
#[derive(Debug, Clone)]
pub(crate) struct SanaBlockIdx {
    table: usize,
    lin: [Lin; 10],
    depth: (usize, usize),
}

/// Where Sana's parameters sit in `Trainer::params`.
#[derive(Debug, Clone)]
pub(crate) struct SanaLayout {
    patch: LinearIdx,
    t1: LinearIdx,
    t2: LinearIdx,
    adaln: LinearIdx,
    caption: [LinearIdx; 2],
    caption_norm: usize,
    blocks: Vec<SanaBlockIdx>,
    out: TableFinal,
    geom: SanaGeom,
    grid: (usize, usize),
}

impl SanaLayout {
    pub(crate) fn new(p: &ParamIndex<'_>, dims: &Dims, geom: SanaGeom) -> Result<SanaLayout> {
        // A linear by module name, with its LoRA factors when it has them.
        let any = |m: &str| -> Result<Lin> {
            Ok(Lin {
                w: p.idx(&format!("{m}.weight"))?,
                b: p.find(&format!("{m}.bias")),
                lora: factor_indices(&|n| p.find(n), m),
            })
        };
        let blocks = p.blocks("transformer_blocks", dims.depth, |_, b| {
            let mut l = [Lin {
                w: 0,
                b: None,
                lora: None,
            }; 10];
            for (slot, name) in l.iter_mut().zip(SANA_BLOCK_LINEARS) {
                *slot = any(&format!("{b}.{name}"))?;
            }
            Ok(SanaBlockIdx {
                table: p.idx(&format!("{b}.scale_shift_table"))?,
                lin: l,
                depth: (
                    p.idx(&format!("{b}.ff.conv_depth.weight"))?,
                    p.idx(&format!("{b}.ff.conv_depth.bias"))?,
                ),
            })
        })?;
        let te = "time_embed.emb.timestep_embedder";
        Ok(SanaLayout {
            patch: p.lin("patch_embed.proj")?,
            t1: p.lin(&format!("{te}.linear_1"))?,
            t2: p.lin(&format!("{te}.linear_2"))?,
            adaln: p.lin("time_embed.linear")?,
            caption: [
                p.lin("caption_projection.linear_1")?,
                p.lin("caption_projection.linear_2")?,
            ],
            caption_norm: p.idx("caption_norm.weight")?,
            blocks,
            out: TableFinal::new(p)?,
            geom,
            grid: (dims.rows, dims.cols),
        })
    }
}

impl Trainer {
    /// A linear of a Sana block; a bias-less one reads `zero` (D) as its bias.
    pub(crate) fn sana_linear(&self, l: Lin, zero: &Tensor, track: bool) -> Result<LinearW> {
        match l.b {
            Some(b) => self.linear(
                LinearIdx {
                    w: l.w,
                    b,
                    lora: l.lora,
                },
                track,
            ),
            None => self.linear_with(l.w, None, l.lora, track, || Ok(zero.clone())),
        }
    }

    pub(crate) fn sana_block_weights(
        &self,
        b: &SanaBlockIdx,
        track: bool,
    ) -> Result<SanaBlockWeights> {
        // One zero bias (D) for every bias-less linear of the block (all write D).
        let wdt = self.linear_weight(b.lin[3].w, false)?.dtype();
        let zero = zero_bias(self.dims.hidden, wdt)?;
        let l = |k: usize| self.sana_linear(b.lin[k], &zero, track);
        let table = self.table_weight(b.table, track)?;
        let attn = self.self_cross_attn_linears(l, track)?;
        let conv_inverted = l(8)?;
        let conv_depth = (
            self.linear_weight(b.depth.0, track)?,
            self.linear_weight(b.depth.1, track)?,
        );
        Ok(SanaBlockWeights::new(
            table,
            attn,
            conv_inverted,
            conv_depth,
            l(9)?,
        ))
    }
}

impl FamilyStep for SanaLayout {
    /// The block's linears with a bias.
    fn block_linears(&self, i: usize) -> Vec<LinearIdx> {
        let with_bias = |l: &Lin| {
            l.b.map(|b| LinearIdx {
                w: l.w,
                b,
                lora: l.lora,
            })
        };
        self.blocks[i].lin.iter().filter_map(with_bias).collect()
    }

    fn final_linears(&self) -> Vec<LinearIdx> {
        vec![self.out.proj_out]
    }

    /// The weights of the linears without a bias (their sinks take dW only).
    fn weight_only(&self) -> Vec<usize> {
        self.blocks
            .iter()
            .flat_map(|b| b.lin.iter().filter(|l| l.b.is_none()).map(|l| l.w))
            .collect()
    }

    fn embed(&self, tr: &Trainer, mb: &Batch) -> Result<Embedded> {
        let d = tr.dims;
        let (cd, ad) = (tr.cfg.compute, tr.cfg.accum);
        let b = mb.n;
        check_text(mb, self.geom.text_tokens, self.geom.text_width)?;
        let (xp, xe) = tr.patch_embed(mb, self.patch, |xt| patchify(xt, &d))?;
        let x0 = cast(xe, ad)?.reshape((b, d.tokens, d.hidden))?;
        let [tf, t1, emb] = tr.timestep_mlp(mb, SANA_FREQ, [self.t1, self.t2])?;
        let (se, t6) = tr.adaln_single(&emb, self.adaln)?;
        let cap = mb.text_tensor(cd, &tr.dev)?;
        let y = caption_forward(
            &cap,
            &SanaCaptionWeights {
                linear_1: tr.linear(self.caption[0], true)?,
                linear_2: tr.linear(self.caption[1], true)?,
                norm: tr.linear_weight(self.caption_norm, true)?,
            },
        )?;
        Ok(Embedded {
            streams: vec![x0],
            conds: vec![t6, emb, y],
            hold: vec![xp, tf, t1, se, cap],
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
        let w = tr.sana_block_weights(&self.blocks[i], track)?;
        let geo = SanaBlockGeom {
            rows: self.grid.0,
            cols: self.grid.1,
            cross_heads: self.geom.cross_heads,
        };
        let out = sana_block_forward(&x[0], &c[0], &c[2], &w, &tr.cfg, &geo)?;
        Ok(vec![out])
    }

    /// PixArt's output side (`norm_out`, the table's modulation, `proj_out`).
    fn final_layer(&self, tr: &Trainer, x: &[Tensor], c: &[Tensor], mb: &Batch) -> Result<Tensor> {
        self.out.pixart_forward(tr, &x[0], &c[1], mb)
    }

    fn embed_linears(&self) -> Vec<LinearIdx> {
        let mut embed = vec![self.patch, self.t1, self.t2, self.adaln];
        embed.extend(self.caption);
        embed
    }

    /// The linears', then `caption_norm`'s weight.
    fn embed_params(&self) -> Vec<usize> {
        let mut idx = params_of(&self.embed_linears());
        idx.push(self.caption_norm);
        idx
    }

    fn block_params(&self, i: usize) -> Vec<usize> {
        let blk = &self.blocks[i];
        let mut idx = vec![blk.table, blk.depth.0, blk.depth.1];
        for l in &blk.lin {
            idx.push(l.w);
            idx.extend(l.b);
            if let Some((a, b)) = l.lora {
                idx.extend([a, b]);
            }
        }
        idx
    }

    fn final_params(&self) -> Vec<usize> {
        self.out.params()
    }
}

impl FamilyLayout for SanaGeom {
    fn layout(&self, p: &ParamIndex<'_>, d: &Dims) -> Result<Arc<dyn ModelLayout>> {
        Ok(Arc::new(SanaLayout::new(p, d, self.clone())?))
    }
}
