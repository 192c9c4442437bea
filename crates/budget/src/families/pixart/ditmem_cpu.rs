//! PixArt in the engine as candle nodes (twin: the engine's `families/pixart/block.rs` and
//! `families/pixart/step.rs`): the embed segment (patch embedding, timestep MLP, `adaln_single`,
//! caption projection), the `BasicTransformerBlock` with adaLN-single, self- and cross-attention
//! over separate q, k, v ([`crate::runtime::ditmem_cpu::separate`]), and the output side with the final
//! `scale_shift_table`; then their simulation into [`crate::runtime::costs::Sims`] for the step replay
//! ([`crate::runtime::ditmem_cpu::step`]), which schedules them as the DiT's.

use crate::families::{Dims as FamilyDims, FamilyModel};
use crate::runtime::ditmem_cpu::block::{gated_released, module_linear, timestep_features};
use crate::runtime::ditmem_cpu::family::{caption_tokens, EmbedGraph, FamilyRules, OneBlockKind};
use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid};
use crate::runtime::ditmem_cpu::ops::concat;
use crate::runtime::ditmem_cpu::parts::{
    adaln_single_block, cross_attend, feed_forward_tail, image_loss, patch_stream, plus_pos_embed,
    self_attention, six_modulations, table_final_layer, text_projection, timestep_mlp,
};
use crate::runtime::shape::Shape;
use crate::spec::Spec;

/// Width of diffusers' `Timesteps(256)` sinusoid.
pub(crate) const PIXART_FREQ: u64 = 256;

/// What a PixArt step reads beyond [`Shape`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PixGeo {
    /// Caption tokens T.
    pub t: u64,
    /// Width of the cached text embeddings (caption_channels, or D without a projection).
    pub width: u64,
    /// Whether the caption is projected (`caption_projection`).
    pub projection: bool,
    /// `out_channels` of the config.
    pub c_out: u64,
    /// PixArt-α's additional conditions (`use_additional_conditions`): the resolution and
    /// aspect-ratio embedders in the embed.
    pub sizes: bool,
}

/// PixArt-α's additional conditions as `PixartLayout::embed` adds them to the embedded timestep
/// `emb`: for the resolution (2 values per sample) and the aspect ratio (1), sinusoid features
/// (accumulation dtype, cast to the compute dtype), linear_1, SiLU, linear_2 (D/3 wide) cast to
/// the accumulation dtype; the resolution's rows viewed as (b, 2D/3), the engine's concat and
/// the sum with `emb`. The features and hidden layers are the closure's locals (freed when no
/// backward reads them); the two outputs, their concat and `emb` stay held by the embed. `emb` here
/// is the timestep's; the returned sum is the embedded timestep the blocks' modulation and the
/// final layer read, as diffusers' `AdaLayerNormSingle` returns it.
fn size_embedding(g: &mut Graph, sh: &Shape, emb: Nid) -> Nid {
    let (cd, ad) = (sh.cd(), sh.ad());
    let size = sh.d / 3;
    let mut parts = Vec::new();
    for (e, rows) in [
        ("resolution_embedder", 2 * sh.b),
        ("aspect_ratio_embedder", sh.b),
    ] {
        let p = format!("adaln_single.emb.{e}");
        let f = g.constant(&format!("{e} features"), rows * PIXART_FREQ, ad, true);
        let f = g.cast(&format!("{e} features→{cd}"), f, cd);
        let h = module_linear(g, sh, &format!("{p}.linear_1"), f, rows, size, PIXART_FREQ);
        let h = g.op(&format!("{e} silu"), Kind::Silu, &[h], rows * size, cd);
        let o = module_linear(g, sh, &format!("{p}.linear_2"), h, rows, size, size);
        let mut o = g.cast(&format!("{e}→{ad}"), o, ad);
        if rows > sh.b {
            o = g.view(&format!("{e} reshape(b,·)"), Kind::Reshape, o, rows * size);
        }
        parts.push(g.bind(o));
    }
    let cat = concat(g, "cat[resolution; aspect ratio]", parts[0], parts[1]);
    g.bind(cat);
    g.op("emb + sizes", Kind::Add, &[emb, cat], sh.b * sh.d, ad)
}

impl OneBlockKind for PixGeo {
    fn freq(&self) -> u64 {
        PIXART_FREQ
    }

    /// Text elements of one sample (T·width): the batch holds them in f64.
    fn caption_elems(&self) -> u64 {
        self.t * self.width
    }

    /// The embed segment as `Trainer::pixart_microbatch` builds it. Returns (graph, x0, t6,
    /// embedded timestep, caption).
    fn embed(&self, sh: &Shape) -> EmbedGraph {
        let pg = self;
        let cd = sh.cd();
        let trows = sh.b * pg.t;
        let mut g = Graph::default();
        let xe = patch_stream(&mut g, sh, "pos_embed.proj", "proj.weight.flatten_from(1)");
        let x0 = plus_pos_embed(&mut g, sh, xe);
        let tf = timestep_features(&mut g, sh, PIXART_FREQ);
        let te = "adaln_single.emb.timestep_embedder";
        let (l1, l2) = (format!("{te}.linear_1"), format!("{te}.linear_2"));
        let emb = timestep_mlp(&mut g, sh, (&l1, &l2), tf, PIXART_FREQ, "emb");
        let emb = if pg.sizes {
            size_embedding(&mut g, sh, emb)
        } else {
            emb
        };
        let t6 = six_modulations(&mut g, sh, "adaln_single.linear", emb, "emb");
        let cap = g.constant("caption embeddings", trows * pg.width, cd, true);
        g.bind(cap);
        let y = if pg.projection {
            let dims = (trows, pg.width);
            let act = "caption gelu(tanh) (fused)";
            let [c1, act, y] = text_projection(&mut g, sh, "caption_projection", cap, dims, act);
            // `caption_forward`'s locals live until it returns.
            g.hold_until(&[c1, act], y);
            y
        } else {
            cap
        };
        g.bind(y);
        EmbedGraph::of_stream(g, x0, vec![t6, emb, y])
    }

    /// One PixArt block as `pixart_block_forward` builds it, on a leaf copy of its input, tracked or
    /// not (`track`: what the engine releases); every intermediate is a local of that function
    /// (bound). Returns (graph, input leaf, output).
    fn block(&self, sh: &Shape, track: bool) -> (Graph, Nid, Nid) {
        let pg = self;
        let ad = sh.ad();
        let d = sh.d;
        let (bd, trows) = (sh.b * d, sh.b * pg.t);
        let caption = ("caption (shared leaf)", trows * d);
        let (mut g, x, y, m) = adaln_single_block(sh, caption);

        // Self-attention.
        let x1 = self_attention(&mut g, sh, track, x, (m[0], m[1], m[2]));

        // Cross-attention.
        let p2 = cross_attend(&mut g, sh, (x1, y), pg.t, (sh.heads, d));
        let ones = g.constant("ones (b, D)", bd, ad, true);
        g.bind(ones);
        let x2 = gated_released(
            &mut g,
            track,
            "x1 + out (fused, gate of ones)",
            x1,
            p2,
            ones,
        );
        g.bind(x2);

        // MLP.
        let gates = (m[3], m[4], m[5]);
        let names = ("norm2+modulate", "x2 + out·gate_mlp (fused)");
        let out = feed_forward_tail(&mut g, sh, track, x2, gates, names);
        (g, x, out)
    }

    /// The output side and the loss on a leaf copy of the last block's output.
    /// Returns (graph, leaf, root).
    fn final_layer(&self, sh: &Shape) -> (Graph, Nid, Nid) {
        let emb = ("embedded timestep (shared leaf)", "emb");
        let (mut g, x, h, y) = table_final_layer(sh, emb, true, self.c_out);
        let root = image_loss(&mut g, sh, (h, y), self.c_out);
        (g, x, root)
    }
}

/// The registry's reader ([`crate::families::registry`]): this family's rules for a spec of it
/// (None for any other model).
pub(crate) fn rules(spec: &Spec, fm: &FamilyModel) -> Option<Box<dyn FamilyRules>> {
    let FamilyDims::Pixart(d) = &fm.dims else {
        return None;
    };
    let t = caption_tokens(spec, fm);
    Some(Box::new(PixGeo {
        t,
        width: d.caption_channels.unwrap_or(d.inner()),
        projection: d.caption_channels.is_some(),
        c_out: d.out_channels,
        sizes: d.use_additional_conditions,
    }))
}
