//! The diffusers DiT's segments for the family schedule ([`crate::trainer::family`]).
//!
//! Embed: patch embedding + the sin-cos table (the one stream); the timestep features
//! (`downscale_freq_shift=1`, in the compute dtype) and the label rows, which every block's own
//! embedder reads (fixed tables: no leaf, no gradient); and block 0's embedder once more for
//! the output side (`conditioning = self.transformer_blocks[0].norm1.emb(...)` in diffusers),
//! whose SiLU in the compute dtype is the one conditioning leaf. So block 0's embedder
//! parameters are read by two segments: block 0 lands their gradients, the embed's backward
//! adds its own into them. The conditioning is `[SiLU(emb₀), features, label rows]`.

use std::sync::Arc;

use candle_core::Tensor;

use crate::diffusion::Batch;
use crate::error::{EngineError, Result};
use crate::families::dit::class_ids;
use crate::families::dit_diffusers::{
    combined_embedding, ditd_block_forward, final_forward, label_timestep_features,
    DitdBlockWeights, DitdGeom, EmbWeights, DITD_BLOCK_LINEARS, DITD_EMB_LINEARS, DITD_FREQ,
    DITD_LABEL_TABLE,
};
use crate::layers::cast;
use crate::model::{patchify, unpatchify};
use crate::shapes::Dims;
use crate::trainer::family::{params_of, BlockIn, Embedded, FamilyStep};
use crate::trainer::state::Trainer;
use crate::trainer::state::{FamilyLayout, LinearIdx, ModelLayout, ParamIndex};

/// Where one block's embedder sits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EmbIdx {
    lin: [LinearIdx; 2],
    table: usize,
}

/// Where one block's parameters sit.
#[derive(Debug, Clone)]
pub(crate) struct DitdBlockIdx {
    emb: EmbIdx,
    lin: [LinearIdx; 7],
}

/// Where the diffusers DiT's parameters sit in `Trainer::params`.
#[derive(Debug, Clone)]
pub(crate) struct DitdLayout {
    patch: LinearIdx,
    pos: usize,
    blocks: Vec<DitdBlockIdx>,
    proj_out: [LinearIdx; 2],
    geom: DitdGeom,
}

impl DitdLayout {
    pub(crate) fn new(p: &ParamIndex<'_>, depth: usize, geom: DitdGeom) -> Result<DitdLayout> {
        let blocks = p.blocks("transformer_blocks", depth, |_, b| {
            let emb = EmbIdx {
                lin: p.lins(b, DITD_EMB_LINEARS)?,
                table: p.idx(&format!("{b}.{DITD_LABEL_TABLE}"))?,
            };
            let l = p.lins(b, DITD_BLOCK_LINEARS)?;
            Ok(DitdBlockIdx { emb, lin: l })
        })?;
        if blocks.is_empty() {
            return Err(EngineError::bad_input(
                "model.depth",
                "0; allowed: at least 1",
            ));
        }
        Ok(DitdLayout {
            patch: p.lin("pos_embed.proj")?,
            pos: p.idx("pos_embed.pos_embed")?,
            blocks,
            proj_out: [p.lin("proj_out_1")?, p.lin("proj_out_2")?],
            geom,
        })
    }
}

fn emb_params(e: &EmbIdx) -> Vec<usize> {
    let mut v = params_of(&e.lin);
    v.push(e.table);
    v
}

impl Trainer {
    pub(crate) fn ditd_emb_weights(&self, e: &EmbIdx, track: bool) -> Result<EmbWeights> {
        Ok(EmbWeights {
            linear_1: self.linear(e.lin[0], track)?,
            linear_2: self.linear(e.lin[1], track)?,
            table: self.raw_weight(e.table, track),
        })
    }

    pub(crate) fn ditd_block_weights(
        &self,
        b: &DitdBlockIdx,
        track: bool,
    ) -> Result<DitdBlockWeights> {
        let l = |k: usize| self.linear(b.lin[k], track);
        Ok(DitdBlockWeights {
            emb: self.ditd_emb_weights(&b.emb, track)?,
            norm1: l(0)?,
            q: l(1)?,
            k: l(2)?,
            v: l(3)?,
            o: l(4)?,
            fc1: l(5)?,
            fc2: l(6)?,
        })
    }
}

impl FamilyStep for DitdLayout {
    /// The block's embedder's linears, then its own.
    fn block_linears(&self, i: usize) -> Vec<LinearIdx> {
        let b = &self.blocks[i];
        [&b.emb.lin[..], &b.lin[..]].concat()
    }

    fn final_linears(&self) -> Vec<LinearIdx> {
        self.proj_out.to_vec()
    }

    fn embed(&self, tr: &Trainer, mb: &Batch) -> Result<Embedded> {
        let d = tr.dims;
        let (cd, ad) = (tr.cfg.compute, tr.cfg.accum);
        let b = mb.n;
        let (xp, xe) = tr.patch_embed(mb, self.patch, |xt| patchify(xt, &d))?;
        let pos = tr.raw_weight(self.pos, true);
        let x0 = cast(xe, ad)?
            .reshape((b, d.tokens, d.hidden))?
            .broadcast_add(&pos)?;
        let tf = cast(
            label_timestep_features(&mb.timesteps, DITD_FREQ, ad, &tr.dev)?,
            cd,
        )?;
        // `LabelEmbedding.token_drop`: a dropped label reads the null row (num_classes).
        let ids = class_ids(mb, Some(self.geom.classes as u32), &tr.dev)?;
        let w0 = tr.ditd_emb_weights(&self.blocks[0].emb, true)?;
        let se0 = cast(combined_embedding(&tf, &ids, &w0, ad)?.silu()?, cd)?;
        drop(w0);
        Ok(Embedded {
            streams: vec![x0],
            conds: vec![se0, tf, ids],
            hold: vec![xp, pos],
        })
    }

    /// The timestep features and the label rows: read by every block, differentiated by none.
    fn fixed_conds(&self) -> usize {
        2
    }

    fn depth(&self) -> usize {
        self.blocks.len()
    }

    fn block(&self, tr: &Trainer, i: usize, b: BlockIn<'_>) -> Result<Vec<Tensor>> {
        let BlockIn { x, c, track } = b;
        let w = tr.ditd_block_weights(&self.blocks[i], track)?;
        let out = ditd_block_forward(&x[0], &c[1], &c[2], &w, &tr.cfg, self.geom.norm_eps)?;
        Ok(vec![out])
    }

    fn final_layer(&self, tr: &Trainer, x: &[Tensor], c: &[Tensor], mb: &Batch) -> Result<Tensor> {
        let d = tr.dims;
        let p1 = tr.linear(self.proj_out[0], true)?;
        let p2 = tr.linear(self.proj_out[1], true)?;
        let out = final_forward(&x[0], &c[0], &p1, &p2, tr.cfg.compute, tr.cfg.accum)?;
        let pred = unpatchify(&out, mb.n, &d)?.narrow(1, 0, d.in_channels)?;
        drop((p1, p2));
        Ok(pred)
    }

    /// The patch embedding alone: block 0's embedder, which the embed runs once more, is listed
    /// with block 0's linears.
    fn embed_linears(&self) -> Vec<LinearIdx> {
        vec![self.patch]
    }

    /// Block 0's embedder (its second use, for the output side), then the patch embedding.
    /// The order is the budget's: block 0 landed the embedder's gradients, so each is summed
    /// into its buffer (`old + g`, a transient of its size) while the store still holds the
    /// patch embedding's, moved after (the label table first: no sum has freed a sunk
    /// gradient before it; `ditmem_cpu::step`'s `Landing::summed`).
    fn embed_params(&self) -> Vec<usize> {
        let e = &self.blocks[0].emb;
        let mut v = vec![e.table];
        v.extend(params_of(&e.lin));
        v.extend(Trainer::linear_params(&self.patch));
        v
    }

    fn block_params(&self, i: usize) -> Vec<usize> {
        let blk = &self.blocks[i];
        let mut v = emb_params(&blk.emb);
        v.extend(params_of(&blk.lin));
        v
    }
}

impl FamilyLayout for DitdGeom {
    fn layout(&self, p: &ParamIndex<'_>, d: &Dims) -> Result<Arc<dyn ModelLayout>> {
        Ok(Arc::new(DitdLayout::new(p, d.depth, self.clone())?))
    }
}
