//! One DiT block of the engine as candle nodes (twin: the engine's `block.rs`): `LinearW`
//! (the fused linear plus the LoRA branch), the composed LayerNorm and modulation, adaLN, and
//! `block_forward` itself.

use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid};
use crate::runtime::ditmem_cpu::ops::{
    fused_attention, fused_linear, fused_mlp, fused_qkv_attention, gated_residual, gelu,
    linear_workspace, ln_modulate,
};
use crate::runtime::shape::Shape;
use crate::spec::{Dtype, LoraTarget};

/// `LinearW::forward`: `x·Wᵀ + b` on a 2-D input, plus `(x·Aᵀ)·Bᵀ` with LoRA (the DiT's
/// linears, adapted by `target`).
#[allow(clippy::too_many_arguments)]
pub fn linear(
    g: &mut Graph,
    sh: &Shape,
    name: &str,
    x: Nid,
    rows: u64,
    out: u64,
    inp: u64,
    target: Option<LoraTarget>,
) -> Nid {
    let rank = target.and_then(|t| sh.lora_for(t));
    adapted_linear(g, sh, name, x, (rows, out, inp), rank)
}

/// A diffusers family's linear `name` (relative to its block for a block's linear): the fused
/// linear, plus LoRA's branch when the recipe's modules name it ([`Shape::lora_rank`]).
pub(crate) fn module_linear(
    g: &mut Graph,
    sh: &Shape,
    name: &str,
    x: Nid,
    rows: u64,
    out: u64,
    inp: u64,
) -> Nid {
    adapted_linear(g, sh, name, x, (rows, out, inp), sh.lora_rank(name))
}

/// `LinearW::reads_input` of the linear `name` (or the feed-forward whose fc1 is `name`): a
/// tracked backward reads its input for a trained weight or LoRA's branch; untracked
/// (`track` false: a recomputed block's first forward), nothing reads anything.
pub fn reads_input(sh: &Shape, track: bool, name: &str) -> bool {
    track && (sh.lora.is_none() || sh.lora_rank(name).is_some())
}

/// The engine's `linear_then_release` / `feed_forward_then_release`: `x` released after the
/// linear (or feed-forward) `name` that reads it unless its backward reads it.
pub(crate) fn release_unless_read(g: &mut Graph, sh: &Shape, track: bool, name: &str, x: Nid) {
    if !reads_input(sh, track, name) {
        g.release(x);
    }
}

/// The engine's `gated_then_release`: the gated residual, its branch output `y` released under
/// a frozen (or untracked) gate.
pub(crate) fn gated_released(
    g: &mut Graph,
    track: bool,
    name: &str,
    x: Nid,
    y: Nid,
    gate: Nid,
) -> Nid {
    let o = gated_residual(g, name, x, y, gate);
    if !(track && g.nodes[gate].tracks) {
        g.release(y);
    }
    o
}

/// The output side's `linear_then_release(proj_out, h)` and `cast_then_release(y, ad)` of the
/// engine (SD3's and Flux's `final_forward`): the modulated norm `h` goes under a frozen
/// `proj_out`, its product `y` once cast to `ad` (when the cast copies). Returns the cast.
pub(crate) fn proj_out_released(g: &mut Graph, sh: &Shape, h: Nid, y: Nid, ad: Dtype) -> Nid {
    release_unless_read(g, sh, true, "proj_out", h);
    let yc = g.cast(&format!("prediction→{ad}"), y, ad);
    if yc != y {
        g.release(y);
    }
    yc
}

/// Marks the fused linear `y` (a [`module_linear`] on the shared text context `ctx`: a
/// cross-attention's k or v projection, the linear or its fused LoRA node) as adding its dx into
/// the trainer's running sum of the context's gradient (`LinearW::with_input_sink`,
/// `Node::sunk_input`) when the context tracks.
pub(crate) fn sink_context_grad(g: &mut Graph, y: Nid, ctx: Nid) {
    debug_assert!(matches!(g.nodes[y].kind, Kind::Custom { .. }));
    debug_assert_eq!(g.nodes[y].inputs[0], ctx);
    if g.nodes[ctx].tracks {
        g.nodes[y].sunk_input = Some(0);
    }
}

/// Whether `families::cross::cross_attend` runs the cross-attention (`attn2`) as one fused
/// node ([`super::cross::cross_attention`]): neither of its k and v projections carries LoRA.
pub(crate) fn fused_cross(sh: &Shape) -> bool {
    sh.lora_rank("attn2.to_k").is_none() && sh.lora_rank("attn2.to_v").is_none()
}

/// A linear whose bias, where it has none of its own, is the block's shared zero bias `zero` (a
/// constant: no gradient; Sana's bias-less linears, `LinearW::forward`), else a
/// [`module_linear`].
pub(crate) fn zero_bias_linear(
    g: &mut Graph,
    sh: &Shape,
    (name, x): (&str, Nid),
    dims: (u64, u64, u64),
    zero: Option<Nid>,
) -> Nid {
    biased_linear(g, sh, name, x, dims, sh.lora_rank(name), zero)
}

/// The fused linear of `(rows, out, inp)` with LoRA's branch of `rank` when it has one. Under
/// LoRA the base is a frozen weight in the compute dtype.
fn adapted_linear(
    g: &mut Graph,
    sh: &Shape,
    name: &str,
    x: Nid,
    dims: (u64, u64, u64),
    rank: Option<u64>,
) -> Nid {
    biased_linear(g, sh, name, x, dims, rank, None)
}

/// [`adapted_linear`] with the bias `zero` in place of its own where one is given.
fn biased_linear(
    g: &mut Graph,
    sh: &Shape,
    name: &str,
    x: Nid,
    (rows, out, inp): (u64, u64, u64),
    rank: Option<u64>,
    zero: Option<Nid>,
) -> Nid {
    if let Some(r) = rank {
        return lora_linear(g, sh, name, x, (rows, out, inp), r);
    }
    let [w, bias] = weights_and_bias(g, sh, name, x, (out, inp), zero);
    fused_linear(
        g,
        &format!("{name} x·Wᵀ+b"),
        [x, w, bias],
        (rows, inp, out),
        &sh.cpu,
    )
}

/// A linear's weight and bias as `LinearW` holds them. Under LoRA the base is a frozen weight
/// in the compute dtype; trained, the weights go to a gradient sink when the input `x` tracks
/// (`LinearW::forward`).
pub(crate) fn linear_weights(
    g: &mut Graph,
    sh: &Shape,
    name: &str,
    x: Nid,
    dims: (u64, u64),
) -> [Nid; 2] {
    weights_and_bias(g, sh, name, x, dims, None)
}

/// [`linear_weights`], the bias `zero` (a constant, never sunk) in place of its own where given.
pub(crate) fn weights_and_bias(
    g: &mut Graph,
    sh: &Shape,
    name: &str,
    x: Nid,
    (out, inp): (u64, u64),
    zero: Option<Nid>,
) -> [Nid; 2] {
    let trained = sh.lora.is_none();
    // The fused linear reads f32 master weights directly under bf16/f16 compute (rounding as it
    // packs or widens them), so a linear's weight and bias are never cast copies.
    let wd = sh.weight_dtype();
    let w = g.weight(&format!("{name}.weight"), out * inp, wd, trained, wd);
    let bias = match zero {
        Some(z) => z,
        None => g.weight(&format!("{name}.bias"), out, wd, trained, wd),
    };
    if trained && g.nodes[x].tracks {
        for t in [w, bias] {
            if g.nodes[t].kind == Kind::Var {
                g.nodes[t].tracks = false;
                g.nodes[t].sunk = true;
            }
        }
    }
    [w, bias]
}

/// `block::feed_forward` of the engine: x (rows, inp) → (rows, out) through `ffn`, bound (the
/// engine's callers keep it in a local). Where neither linear carries LoRA (`ranks`), one
/// [`fused_mlp`] node; else fc1, the GELU
/// and fc2 composed, the first two held until fc2 exists (the engine function's locals).
pub fn feed_forward(
    g: &mut Graph,
    sh: &Shape,
    (fc1, fc2): (&str, &str),
    ranks: [Option<u64>; 2],
    x: Nid,
    (rows, inp, ffn, out): (u64, u64, u64, u64),
) -> Nid {
    let y = if ranks.iter().all(Option::is_none) {
        let [w1, b1] = linear_weights(g, sh, fc1, x, (ffn, inp));
        let [w2, b2] = linear_weights(g, sh, fc2, x, (out, ffn));
        fused_mlp(
            g,
            &format!("{fc1} → gelu(tanh) → {fc2} (fused MLP)"),
            x,
            [w1, b1, w2, b2],
            (rows, inp, ffn, out),
            &sh.cpu,
        )
    } else {
        let f1 = adapted_linear(g, sh, fc1, x, (rows, ffn, inp), ranks[0]);
        let act = gelu(g, &format!("{fc1} gelu(tanh) (fused)"), f1);
        let f2 = adapted_linear(g, sh, fc2, act, (rows, out, ffn), ranks[1]);
        g.hold_until(&[f1, act], f2);
        f2
    };
    g.bind(y)
}

/// A diffusers family's feed-forward (`block::feed_forward` of the engine) on its linears
/// `names`, LoRA's ranks as the recipe's modules name them ([`Shape::lora_rank`]).
pub(crate) fn module_feed_forward(
    g: &mut Graph,
    sh: &Shape,
    names: (&str, &str),
    x: Nid,
    dims: (u64, u64, u64, u64),
) -> Nid {
    let ranks = [sh.lora_rank(names.0), sh.lora_rank(names.1)];
    feed_forward(g, sh, names, ranks, x, dims)
}

/// The `i`-th of `k` narrow views of a (b, k·D) tensor `m` (`bd` = b·D elements each), as the
/// trainers split a modulation (unbound: SD3's are temporaries of the engine's call, held only
/// by the op that reads them).
pub(crate) fn chunk(g: &mut Graph, name: &str, m: Nid, i: u64, k: u64, bd: u64) -> Nid {
    g.view(
        &format!("{name} chunk {i}"),
        Kind::Narrow {
            pad_before: i * bd,
            pad_after: (k - 1 - i) * bd,
        },
        m,
        bd,
    )
}

/// All `k` narrow views of a (b, k·D) tensor, each bound (the engine's locals).
pub(crate) fn chunks(g: &mut Graph, name: &str, m: Nid, k: u64, bd: u64) -> Vec<Nid> {
    (0..k)
        .map(|i| {
            let c = chunk(g, name, m, i, k, bd);
            g.bind(c)
        })
        .collect()
}

/// One block's graph begun: a tracked leaf copy of its input (b·s·D in the accumulation dtype).
/// Returns (graph, leaf).
pub(crate) fn block_leaf(sh: &Shape) -> (Graph, Nid) {
    stream_leaf(sh, "x (leaf copy of the block input)")
}

/// A segment's graph begun: a tracked leaf `name` copying the stream it reads (b·s·D in the
/// accumulation dtype). Returns (graph, leaf).
pub(crate) fn stream_leaf(sh: &Shape, name: &str) -> (Graph, Nid) {
    let mut g = Graph::default();
    let x = g.var(name, sh.e(), sh.ad(), true);
    (g, x)
}

/// A block's linear ([`module_linear`]: its base or LoRA form), its output bound (a local of
/// the block's function).
pub(crate) fn bound_linear(
    g: &mut Graph,
    sh: &Shape,
    name: &str,
    x: Nid,
    rows: u64,
    out: u64,
    inp: u64,
) -> Nid {
    let y = module_linear(g, sh, name, x, rows, out, inp);
    g.bind(y)
}

/// The patch embedding as the trainers make it: the patches (b·s rows of C·p² values in the
/// compute dtype, not tracking, bound) through the conv `module` ("pos_embed.proj",
/// "patch_embedding", …), whose weight (D, C, p, p) multiplies as its (D, C·p·p) view
/// (`flatten` names the view) beside its bias, in one `fused_linear`. The patches do not track,
/// so the weight goes in tracked (its gradient through candle's store). Returns the embedded
/// patches (b·s, D) in the compute dtype: the caller casts them where the trainer does.
pub(crate) fn patch_embed(g: &mut Graph, sh: &Shape, module: &str, flatten: &str) -> Nid {
    let rows = sh.b * sh.s;
    let wd = sh.weight_dtype();
    let xp = g.constant("patches", rows * sh.patch2 * sh.c_in, sh.cd(), true);
    g.bind(xp);
    let inp = sh.c_in * sh.patch2;
    let w = base_weight(g, sh, &format!("{module}.weight"), sh.d * inp, wd);
    let wv = g.view(flatten, Kind::Reshape, w, sh.d * inp);
    let bias = base_weight(g, sh, &format!("{module}.bias"), sh.d, wd);
    crate::runtime::ditmem_cpu::ops::fused_linear(
        g,
        &format!("{module} x·Wᵀ+b"),
        [xp, wv, bias],
        (rows, inp, sh.d),
        &sh.cpu,
    )
}

/// The timestep features (b × `freq`, made in the accumulation dtype and cast to the compute
/// dtype, bound: the embed's local).
pub(crate) fn timestep_features(g: &mut Graph, sh: &Shape, freq: u64) -> Nid {
    let (cd, ad) = (sh.cd(), sh.ad());
    let tf = g.constant("timestep features", sh.b * freq, ad, true);
    let tf = g.cast(&format!("t_freq→{cd}"), tf, cd);
    g.bind(tf)
}

/// A base tensor of the model (a table, a norm's weight, a conv's weight) as the trainer reads
/// it, cast to `to`: trained in the parameter dtype, or under LoRA frozen in the compute dtype
/// (`Trainer::new` stores a frozen base so).
pub(crate) fn base_weight(g: &mut Graph, sh: &Shape, name: &str, elems: u64, to: Dtype) -> Nid {
    g.weight(name, elems, sh.weight_dtype(), sh.lora.is_none(), to)
}

/// `ops::lora_linear` of the engine (`LinearW::forward` under LoRA): the frozen base and LoRA's
/// branch `x·Wᵀ + b + (x·Aᵀ)·Bᵀ` as one node on (x, A, B), A (r, in) and B (out, r) the
/// adapters' compute-dtype copies (bound while the linear's weights live), trained in the
/// parameter dtype; the base weights are the op's, not inputs. Nothing kept. Workspace, step by
/// step as the op runs (each product one engine linear, [`linear_workspace`], the branch's with
/// a zero bias): forward the base; x·Aᵀ beside a zero bias of r; x·Aᵀ·Bᵀ beside x·Aᵀ and a zero
/// bias of out (then added into y and freed). Backward, beside dx (when x tracks), dA and dB (the
/// node's gradients): the base's dx; x·Aᵀ again beside a zero bias of r; g·B and dB beside
/// x·Aᵀ; the branch's dx and dA beside g·B.
pub fn lora_linear(
    g: &mut Graph,
    sh: &Shape,
    name: &str,
    x: Nid,
    (rows, out, inp): (u64, u64, u64),
    r: u64,
) -> Nid {
    let (cd, pd) = (sh.cd(), sh.precision.param_dtype());
    let a = g.weight(&format!("{name}.lora_a"), r * inp, pd, true, cd);
    let bm = g.weight(&format!("{name}.lora_b"), out * r, pd, true, cd);
    for t in [a, bm] {
        if g.nodes[t].kind == Kind::ToDtype {
            g.bind(t);
        }
    }
    let cpu = &sh.cpu;
    let e = cd.size();
    let wants = |i: Nid| g.nodes[i].tracks || g.nodes[i].sunk;
    let (tx, ta, tb) = (wants(x), wants(a), wants(bm));
    let (base_f, base_b) = linear_workspace(cpu, cd, (rows, inp, out), (tx, false, false), false);
    let (a_f, a_b) = linear_workspace(cpu, cd, (rows, inp, r), (tx, ta, false), false);
    let (b_f, b_b) = linear_workspace(cpu, cd, (rows, r, out), (tx || ta, tb, false), false);
    let xa = rows * r * e;
    let (zr, zo) = (r * e, out * e);
    let fwd = base_f
        .max(zr + xa + a_f)
        .max(xa + zo + rows * out * e + b_f);
    let gb = if tx || ta { rows * r * e } else { 0 };
    let dxl = if tx { rows * inp * e } else { 0 };
    let base = if tx { base_b } else { 0 };
    let bwd =
        base.max(zr + xa + a_f)
            .max(xa + gb + b_b)
            .max(if gb > 0 { gb + dxl + a_b } else { 0 });
    let y = g.op(
        &format!("{name} x·Wᵀ+b + (x·Aᵀ)·Bᵀ (fused LoRA)"),
        Kind::Custom { bwd_scratch: bwd },
        &[x, a, bm],
        rows * out,
        cd,
    );
    g.nodes[y].fwd_scratch = fwd;
    y
}

/// `layer_norm` of the engine: mean, x − mean, (x − mean)², var, +eps, ^−½, product.
pub fn layer_norm(g: &mut Graph, name: &str, x: Nid, rows: u64) -> Nid {
    let ad = g.dtype(x);
    let mean = g.mean(&format!("{name} mean"), x, rows);
    let xc = g.broadcast_binary(&format!("{name} x−mean"), Kind::Sub, x, mean, false);
    let e = g.elems(x);
    let sq = g.op(&format!("{name} (x−mean)²"), Kind::Sqr, &[xc], e, ad);
    let var = g.mean(&format!("{name} var"), sq, rows);
    let ve = g.op(&format!("{name} var+eps"), Kind::Affine, &[var], rows, ad);
    let rstd = g.op(&format!("{name} ^−½"), Kind::Powf, &[ve], rows, ad);
    g.broadcast_binary(&format!("{name} out"), Kind::Mul, xc, rstd, false)
}

/// `modulate`: x·(1 + scale) + shift, scale and shift (b, D) broadcast over tokens.
pub fn modulate(g: &mut Graph, name: &str, x: Nid, shift: Nid, scale: Nid, bd: u64) -> Nid {
    let ad = g.dtype(x);
    let su = g.view(&format!("{name} scale.unsqueeze"), Kind::Reshape, scale, bd);
    let one = g.op(&format!("{name} 1+scale"), Kind::Affine, &[su], bd, ad);
    let m = g.broadcast_binary(&format!("{name} ·(1+scale)"), Kind::Mul, x, one, false);
    let sh = g.view(&format!("{name} shift.unsqueeze"), Kind::Reshape, shift, bd);
    g.broadcast_binary(&format!("{name} +shift"), Kind::Add, m, sh, false)
}

/// adaLN: `linear(silu(c)→cd)→ad` chunked into `k` narrow views of (b, D).
pub(crate) fn ada_ln(
    g: &mut Graph,
    sh: &Shape,
    name: &str,
    c: Nid,
    k: u64,
    target: Option<LoraTarget>,
) -> Vec<Nid> {
    let (cd, ad) = (sh.cd(), sh.ad());
    let bd = sh.b * sh.d;
    let silu = g.op(&format!("{name} silu(c)"), Kind::Silu, &[c], bd, ad);
    let sc = g.cast(&format!("{name} silu→{cd}"), silu, cd);
    let m = linear(g, sh, name, sc, sh.b, k * sh.d, sh.d, target);
    let m = g.cast(&format!("{name} →{ad}"), m, ad);
    g.bind(m);
    (0..k).map(|i| chunk(g, name, m, i, k, bd)).collect()
}

/// One DiT block as `block_forward` builds it, on a leaf copy of its input.
/// Returns the graph and (input leaf, c, output).
pub fn block(sh: &Shape) -> (Graph, Nid, Nid, Nid) {
    let (cd, ad) = (sh.cd(), sh.ad());
    let d = sh.d;
    let rows = sh.b * sh.s;
    let bd = sh.b * d;
    let (mut g, x) = block_leaf(sh);
    let c = g.var("c (shared leaf)", bd, ad, false);
    let m = ada_ln(
        &mut g,
        sh,
        "adaLN_modulation.1",
        c,
        6,
        Some(LoraTarget::Adaln),
    );

    // Written as (b·s, D) rows: no reshape before the linears.
    let h = ln_modulate(&mut g, "norm1+modulate1", x, m[0], m[1], rows, cd);
    g.bind(h);
    let h2d = h;
    // The projection folds into the attention where its input tracks and it has no LoRA
    // (`block_forward`'s `attention_of`).
    let o2 = if g.nodes[h2d].tracks && sh.lora_for(LoraTarget::Qkv).is_none() {
        let wb = linear_weights(&mut g, sh, "attn.qkv", h2d, (3 * d, d));
        fused_qkv_attention(&mut g, sh, h2d, wb)
    } else {
        let qkv = linear(
            &mut g,
            sh,
            "attn.qkv",
            h2d,
            rows,
            3 * d,
            d,
            Some(LoraTarget::Qkv),
        );
        fused_attention(&mut g, sh, qkv)
    };
    g.bind(o2);
    let p = linear(
        &mut g,
        sh,
        "attn.proj",
        o2,
        rows,
        d,
        d,
        Some(LoraTarget::Proj),
    );
    let x1 = gated_residual(&mut g, "x + proj·gate_msa (fused)", x, p, m[2]);
    g.bind(x1);

    let h2 = ln_modulate(&mut g, "norm2+modulate2", x1, m[3], m[4], rows, cd);
    g.bind(h2);
    let f2 = if sh.mlp_dropout {
        // `block_forward`'s dropout path: composed, its locals bound until the block returns.
        let f1 = linear(
            &mut g,
            sh,
            "mlp.fc1",
            h2,
            rows,
            sh.mlp,
            d,
            Some(LoraTarget::Fc1),
        );
        g.bind(f1);
        let mut act = gelu(&mut g, "gelu(tanh) (fused)", f1);
        g.bind(act);
        if sh.mlp_dropout {
            let mask = g.constant("mlp dropout mask", rows * sh.mlp, cd, true);
            act = g.op("gelu·mask", Kind::Mul, &[act, mask], rows * sh.mlp, cd);
            g.bind(act);
        }
        linear(
            &mut g,
            sh,
            "mlp.fc2",
            act,
            rows,
            d,
            sh.mlp,
            Some(LoraTarget::Fc2),
        )
    } else {
        let ranks = [LoraTarget::Fc1, LoraTarget::Fc2].map(|t| sh.lora_for(t));
        let dims = (rows, d, sh.mlp, d);
        feed_forward(&mut g, sh, ("mlp.fc1", "mlp.fc2"), ranks, h2, dims)
    };
    let out = gated_residual(&mut g, "x1 + fc2·gate_mlp (fused)", x1, f2, m[5]);
    (g, x, c, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::ditmem_cpu::backward::backward_with;
    use crate::runtime::ditmem_cpu::graph::owned_bytes;
    use crate::runtime::ditmem_cpu::ops::surrogate;
    use crate::spec::{AttentionMode, Precision};

    fn shape(p: Precision) -> Shape {
        Shape {
            b: 2,
            s: 16,
            d: 32,
            heads: 4,
            mlp: 128,
            freq: 256,
            label_rows: 1001,
            c_in: 4,
            c_out: 8,
            patch2: 4,
            latent: 2 * 16 * 4 * 4,
            precision: p,
            attention: AttentionMode::Materialized,
            attention_only: false,
            lora: None,
            lora_modules: Vec::new(),
            attn_dropout: false,
            mlp_dropout: false,
            cpu: crate::spec::CpuSpec::REFERENCE,
            frozen_embed: false,
        }
    }

    #[test]
    fn block_keeps_more_in_materialized_mode() {
        let mut sh = shape(Precision::Fp32);
        let (g, ..) = block(&sh);
        let mat = owned_bytes(&g).0;
        sh.attention = AttentionMode::MemoryEfficient;
        let (g2, ..) = block(&sh);
        let eff = owned_bytes(&g2).0;
        assert!(mat > eff);
        let a = 2 * 4 * 16 * 16 * 4;
        // The fused attention keeps P (f32) where the streaming one keeps the log-sum-exp.
        let lse = 2 * 4 * 16 * 4;
        assert_eq!(mat - eff, a - lse);
    }

    #[test]
    fn block_weight_gradients_go_to_sinks_not_the_store() {
        for p in [Precision::Fp32, Precision::Bf16Mixed] {
            let sh = shape(p);
            let (mut g, _leaf, c, out) = block(&sh);
            let weights: Vec<Nid> = (0..g.nodes.len())
                .filter(|&i| {
                    let n = &g.nodes[i];
                    n.kind == Kind::Var
                        && (n.name.ends_with(".weight") || n.name.ends_with(".bias"))
                })
                .collect();
            // Every trained linear weight and bias of a block (5 linears) is sunk.
            assert_eq!(weights.len(), 10);
            assert!(weights
                .iter()
                .all(|&i| g.nodes[i].sunk && !g.nodes[i].tracks));
            let root = surrogate(&mut g, out);
            let bw = backward_with(&g, root, false);
            let expected: u64 = weights.iter().map(|&i| g.nodes[i].bytes()).sum();
            // The shared conditioning leaf c is a variable the graph does not own: its gradient
            // is the only other one counted with the weights'.
            assert_eq!(bw.weight_grads, expected + g.nodes[c].bytes(), "{p:?}");
            // The store (plus sinks) at the end holds the weight grads and the leaves' grads
            // (x and c, the leaf copies) and nothing chained to them.
            assert!(bw.store >= expected + bw.leaf_grads);
        }
    }

    #[test]
    fn mixed_precision_makes_no_weight_casts() {
        // The fused linears read the f32 master weights directly: no bf16 copies in the graph.
        let (g, ..) = block(&shape(Precision::Bf16Mixed));
        let (_, casts) = owned_bytes(&g);
        assert_eq!(casts, 0);
        let (g32, ..) = block(&shape(Precision::Fp32));
        let (_, casts32) = owned_bytes(&g32);
        assert_eq!(casts32, 0);
    }
}
