//! The three segments of the engine's step as candle graphs — the input side and the final
//! layer + loss as `Trainer::microbatch` builds them (twin: the engine's `trainer.rs`), a block as
//! `block_forward` builds it ([`super::block`]) — and their simulation into [`Sims`]: what each
//! keeps, its forward peaks and its backward replayed through candle's rules.

use crate::runtime::costs::Sims;
use crate::runtime::ditmem_cpu::block::{self, ada_ln, linear, timestep_features};
use crate::runtime::ditmem_cpu::dtypes::grad_dtype;
use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid};
use crate::runtime::ditmem_cpu::ops::ln_modulate;
use crate::runtime::ditmem_cpu::sims;
use crate::runtime::shape::Shape;
use crate::spec::{Dtype, Spec};

/// The embed segment: patch embedding + pos table, timestep MLP, label rows, c = t + y.
/// Returns (graph, x0, c).
pub(crate) fn embed_graph(sh: &Shape) -> (Graph, Nid, Nid) {
    let (cd, ad) = (sh.cd(), sh.ad());
    let p2 = sh.patch2;
    let rows = sh.b * sh.s;
    let n = rows * p2 * sh.c_in;
    let bd = sh.b * sh.d;
    let mut g = Graph::default();
    // Patchified latents in the compute dtype (made without tracking, kept by the matmul).
    // Locals of `Trainer::microbatch` stay alive to its end (they matter when nothing tracks,
    // as under LoRA with a frozen embedder): the patches, timestep features, t1, t_emb, y_emb,
    // c and x0 are bound.
    let xp = g.constant("patches", n, cd, true);
    g.bind(xp);
    let xe = linear(
        &mut g,
        sh,
        "x_embedder.proj",
        xp,
        rows,
        sh.d,
        sh.c_in * p2,
        None,
    );
    let xe = g.cast(&format!("x_embedder→{ad}"), xe, ad);
    let xe = g.view("reshape(b,s,D)", Kind::Reshape, xe, sh.e());
    let pos = g.constant("pos_embed", sh.s * sh.d, ad, false);
    let x0 = g.broadcast_binary("+pos_embed", Kind::Add, xe, pos, false);
    let f = sh.freq;
    let tf = timestep_features(&mut g, sh, f);
    let h = linear(&mut g, sh, "t_embedder.mlp.0", tf, sh.b, sh.d, f, None);
    let h = g.op("t silu", Kind::Silu, &[h], bd, cd);
    g.bind(h);
    let te = linear(&mut g, sh, "t_embedder.mlp.2", h, sh.b, sh.d, sh.d, None);
    let te = g.cast(&format!("t_emb→{ad}"), te, ad);
    g.bind(te);
    let rows_k = sh.label_rows;
    let table_dt = if sh.lora.is_some() {
        cd
    } else {
        sh.precision.param_dtype()
    };
    let table = if sh.lora.is_some() {
        g.constant(
            "y_embedder.embedding_table.weight",
            rows_k * sh.d,
            table_dt,
            false,
        )
    } else {
        g.var(
            "y_embedder.embedding_table.weight",
            rows_k * sh.d,
            table_dt,
            false,
        )
    };
    // The label ids (u32, one per sample; 4 bytes each like an f32).
    let ids = g.constant("label ids", sh.b, Dtype::F32, true);
    g.bind(ids);
    let y = g.op("label rows", Kind::IndexSelect, &[table, ids], bd, table_dt);
    let y = g.cast(&format!("y_emb→{ad}"), y, ad);
    g.bind(y);
    let c = g.op("c = t_emb + y_emb", Kind::Add, &[te, y], bd, ad);
    g.bind(c);
    g.bind(x0);
    (g, x0, c)
}

/// The final layer and the loss on a leaf copy of the last block's output.
/// Returns (graph, leaf, root).
pub(crate) fn final_graph(sh: &Shape) -> (Graph, Nid, Nid) {
    let (cd, ad) = (sh.cd(), sh.ad());
    let ld = grad_dtype(sh.precision);
    let p2 = sh.patch2;
    let rows = sh.b * sh.s;
    let bd = sh.b * sh.d;
    let (mut g, x) = sims::final_leaf(sh);
    let c = g.var("c (shared leaf)", bd, ad, false);
    let md = ada_ln(&mut g, sh, "final_layer.adaLN_modulation.1", c, 2, None);
    let h = ln_modulate(&mut g, "final norm+modulate", x, md[0], md[1], rows, cd);
    let y = linear(
        &mut g,
        sh,
        "final_layer.linear",
        h,
        rows,
        p2 * sh.c_out,
        sh.d,
        None,
    );
    let y = g.cast(&format!("prediction→{ad}"), y, ad);
    let (pred, lat) = sims::unpatchified(
        &mut g,
        sh,
        y,
        sh.c_out,
        ["reshape(b,r,c,p,p,C)", "reshape(b,C,h,w)", "ε channels"],
    );
    let target = g.constant("target", lat, ld, true);
    let diff = g.op("pred − target", Kind::Sub, &[pred, target], lat, ld);
    let sq = g.op("(pred − target)²", Kind::Sqr, &[diff], lat, ld);
    let s = g.op("sum", Kind::Sum, &[sq], 1, ld);
    let loss = g.op("mean (loss)", Kind::Affine, &[s], 1, ld);
    let root = g.op("loss·scale/accumulation", Kind::Affine, &[loss], 1, ld);
    (g, x, root)
}

/// Simulate the engine's three segments for a spec.
pub(crate) fn sims(spec: &Spec) -> Sims {
    if let Some(family) = super::registry::rules(spec) {
        return family.sims(spec);
    }
    let sh = Shape::new(spec);
    let block = sims::block_sim(|_track| {
        let (g, leaf, _c, out) = block::block(&sh);
        (g, leaf, out)
    });
    let (fg, fleaf, froot) = final_graph(&sh);
    let (eg, x0, c) = embed_graph(&sh);
    let embed = sims::embed_sim(
        eg,
        &sims::EmbedOutputs {
            streams: &[x0],
            conds: &[c],
            tables: &[],
            frozen: false,
        },
        sh.ad(),
    );
    let scratch = sims::embed_scratch(&sh, u64::from(spec.model.freq_embed), 0);
    // The DiT's own schedule (`trainer.rs`) holds its streams as they are.
    Sims {
        streams_once: false,
        ..sims::sims(embed, block, sims::final_sim(&fg, fleaf, froot), scratch)
    }
}
