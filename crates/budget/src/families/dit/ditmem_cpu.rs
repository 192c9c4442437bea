//! diffusers' DiT (`DiTTransformer2DModel`) in the engine as candle nodes (twin: the engine's
//! `families/dit_diffusers/block.rs` and `families/dit_diffusers/step.rs`): the embed segment (patch
//! embedding, the timestep features and label rows every block reads, block 0's embedder once
//! more for the output side), the `BasicTransformerBlock` with `ada_norm_zero` (its own
//! `CombinedTimestepLabelEmbeddings`, `norm1.linear`, self-attention over separate q, k, v
//! ([`separate_attention`]), the GELU-tanh feed-forward) and the output side (`proj_out_1`,
//! `norm_out` + modulate, `proj_out_2`); then their simulation into [`crate::runtime::costs::Sims`] for the step
//! replay ([`crate::runtime::ditmem_cpu::step`]), which schedules them as every family's.
//!
//! Block 0's embedder parameters are read by block 0 and by the embed: block 0 lands their
//! gradients, the embed's backward adds its own into those buffers ([`summed_by_embed`]).

use crate::families::{Dims as FamilyDims, FamilyModel};
use crate::params::ParamTensor;
use crate::runtime::ditmem_cpu::block::{
    base_weight, block_leaf, chunks, module_linear, timestep_features,
};
use crate::runtime::ditmem_cpu::family::{EmbedGraph, FamilyRules, OneBlockKind};
use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid};
use crate::runtime::ditmem_cpu::ops::ln_modulate;
use crate::runtime::ditmem_cpu::parts::{
    feed_forward_tail, image_loss, modulation_linear, patch_stream, plus_pos_embed, self_attention,
};
use crate::runtime::ditmem_cpu::sims;
use crate::runtime::shape::Shape;
use crate::spec::{Dtype, Spec};

/// Width of `CombinedTimestepLabelEmbeddings.time_proj` (`Timesteps(256)`).
pub(crate) const DITD_FREQ: u64 = 256;

/// What a diffusers DiT step reads beyond [`Shape`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DitdGeo {
    /// `out_channels` of the config (8 with the learned variance).
    pub c_out: u64,
    /// Rows of every label table: the classes and the null class.
    pub labels: u64,
}

/// Whether the embed's backward adds `t`'s gradient into a buffer block 0 landed: block 0's
/// embedder (`transformer_blocks.0.norm1.emb.*`) of a diffusers DiT, whose second use (the
/// output side's conditioning) the engine runs in the embed segment.
fn summed_by_embed(t: &ParamTensor) -> bool {
    t.block == Some(0) && t.name.starts_with("transformer_blocks.0.norm1.emb.")
}

/// `combined_embedding` of the engine (`CombinedTimestepLabelEmbeddings` of the block at
/// `prefix`, relative names): `linear_1` on the features `tf` (b, 256) in `cd`, SiLU,
/// `linear_2` cast to `ad`; the label rows of the table as stored, cast to `ad`; their sum
/// (b, D) in `ad`. The helper's locals (the SiLU, the two casts) live until the sum exists.
fn combined_embedding(g: &mut Graph, sh: &Shape, dg: &DitdGeo, tf: Nid, ids: Nid) -> Nid {
    let (cd, ad) = (sh.cd(), sh.ad());
    let bd = sh.b * sh.d;
    let te = "norm1.emb.timestep_embedder";
    let h = module_linear(g, sh, &format!("{te}.linear_1"), tf, sh.b, sh.d, DITD_FREQ);
    let h = g.op("timestep silu", Kind::Silu, &[h], bd, cd);
    let t = module_linear(g, sh, &format!("{te}.linear_2"), h, sh.b, sh.d, sh.d);
    let t = g.cast(&format!("t_emb→{ad}"), t, ad);
    let wd = sh.weight_dtype();
    let table = base_weight(
        g,
        sh,
        "norm1.emb.class_embedder.embedding_table.weight",
        dg.labels * sh.d,
        wd,
    );
    let y = g.op("label rows", Kind::IndexSelect, &[table, ids], bd, wd);
    let y = g.cast(&format!("y_emb→{ad}"), y, ad);
    let emb = g.op("t_emb + y_emb", Kind::Add, &[t, y], bd, ad);
    g.hold_until(&[h, t, y], emb);
    emb
}

impl OneBlockKind for DitdGeo {
    fn freq(&self) -> u64 {
        DITD_FREQ
    }

    /// No text: the class label is a table row.
    fn caption_elems(&self) -> u64 {
        0
    }

    fn summed_by_embed(&self, t: &ParamTensor) -> bool {
        summed_by_embed(t)
    }

    /// The embed segment as `DitdLayout::embed` builds it. Returns (graph, x0, SiLU(emb₀) in the
    /// compute dtype, timestep features, label ids).
    fn embed(&self, sh: &Shape) -> EmbedGraph {
        let dg = self;
        let (cd, ad) = (sh.cd(), sh.ad());
        let bd = sh.b * sh.d;
        let mut g = Graph::default();
        let xe = patch_stream(&mut g, sh, "pos_embed.proj", "proj.weight.flatten_from(1)");
        let x0 = plus_pos_embed(&mut g, sh, xe);
        let tf = timestep_features(&mut g, sh, DITD_FREQ);
        // The label ids (u32, one per sample; 4 bytes each like an f32).
        let ids = g.constant("label ids", sh.b, Dtype::F32, true);
        g.bind(ids);
        let emb0 = combined_embedding(&mut g, sh, dg, tf, ids);
        let se = g.op("silu(emb₀)", Kind::Silu, &[emb0], bd, ad);
        let se = g.cast(&format!("silu(emb₀)→{cd}"), se, cd);
        g.bind(se);
        EmbedGraph {
            tables: vec![tf, ids],
            ..EmbedGraph::of_stream(g, x0, vec![se])
        }
    }

    /// One block as `ditd_block_forward` builds it, on a leaf copy of its input, tracked or not
    /// (`track`: what the engine releases); every intermediate is a local of that function (bound).
    /// Returns the graph, the input leaf and the output.
    fn block(&self, sh: &Shape, track: bool) -> (Graph, Nid, Nid) {
        let dg = self;
        let (cd, ad) = (sh.cd(), sh.ad());
        let d = sh.d;
        let bd = sh.b * d;
        let (mut g, x) = block_leaf(sh);
        // The fixed tables the embed made (no leaf copies).
        let tf = g.constant("timestep features (fixed)", sh.b * DITD_FREQ, cd, false);
        let ids = g.constant("label ids (fixed)", sh.b, Dtype::F32, false);
        let emb = combined_embedding(&mut g, sh, dg, tf, ids);
        g.bind(emb);
        let se = g.op("silu(emb)", Kind::Silu, &[emb], bd, ad);
        let se = g.cast(&format!("silu(emb)→{cd}"), se, cd);
        g.bind(se);
        let m6 = modulation_linear(&mut g, sh, "norm1.linear", se, 6);
        g.bind(m6);
        let m = chunks(&mut g, "modulation", m6, 6, bd);

        // Self-attention.
        let x1 = self_attention(&mut g, sh, track, x, (m[0], m[1], m[2]));

        // Feed-forward.
        let gates = (m[3], m[4], m[5]);
        let names = ("norm3+modulate", "x1 + out·gate_mlp (fused)");
        let out = feed_forward_tail(&mut g, sh, track, x1, gates, names);
        (g, x, out)
    }

    /// The output side and the loss on a leaf copy of the last block's output.
    /// Returns (graph, leaf, root).
    fn final_layer(&self, sh: &Shape) -> (Graph, Nid, Nid) {
        let dg = self;
        let cd = sh.cd();
        let rows = sh.b * sh.s;
        let bd = sh.b * sh.d;
        let (mut g, x) = sims::final_leaf(sh);
        let se = sh.cond_leaf(&mut g, "SiLU(emb₀) (shared leaf)", bd, cd);
        let m = modulation_linear(&mut g, sh, "proj_out_1", se, 2);
        g.bind(m);
        let md = chunks(&mut g, "proj_out_1", m, 2, bd);
        let h = ln_modulate(&mut g, "norm_out+modulate", x, md[0], md[1], rows, cd);
        g.bind(h);
        let y = module_linear(
            &mut g,
            sh,
            "proj_out_2",
            h,
            rows,
            sh.patch2 * dg.c_out,
            sh.d,
        );
        let root = image_loss(&mut g, sh, (h, y), dg.c_out);
        (g, x, root)
    }
}

/// The registry's reader ([`crate::families::registry`]): this family's rules for a spec of it
/// (None for any other model).
pub(crate) fn rules(_spec: &Spec, fm: &FamilyModel) -> Option<Box<dyn FamilyRules>> {
    let FamilyDims::DitDiffusers(d) = &fm.dims else {
        return None;
    };
    Some(Box::new(DitdGeo {
        c_out: d.out_channels,
        labels: d.num_embeds_ada_norm + 1,
    }))
}
