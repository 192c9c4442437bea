//! The diffusers DiT's block, per-block embedder and output side (see the module docs of
//! [`super`] for the tensor list), on the engine's fused ops. `cd` is the compute dtype of the
//! matmuls and attention, `ad` the accumulation dtype of the residual stream, norms and
//! modulation; every linear is one fused node ([`LinearW`]).

use candle_core::{DType, Device, Tensor};

use crate::error::Result;
use crate::families::adaln::{linear_modulated_out, AdaLnZero, ShiftScale};
use crate::families::pixart::block::attn_keep;
use crate::layers::{
    cast, feed_forward_then_release, gated_then_release, BlockConfig, LinearW, LN_EPS,
};
use crate::ops::attention::separate::attention;
use crate::ops::ln_modulate;

/// `CombinedTimestepLabelEmbeddings.time_proj` = `Timesteps(256, flip_sin_to_cos=True,
/// downscale_freq_shift=1)` (diffusers `models/embeddings.py`, `get_timestep_embedding`): for
/// t the features cat[cos(t·f), sin(t·f)], f_k = e^(−ln(10000)·k/(F/2 − 1)) — the shift of 1
/// sets this table apart from PixArt's and the original DiT's (F/2).
pub fn label_timestep_features(
    t: &[u32],
    freq: usize,
    dtype: DType,
    dev: &Device,
) -> Result<Tensor> {
    let half = freq / 2;
    let denom = half.saturating_sub(1).max(1) as f64;
    let mut v = Vec::with_capacity(t.len() * freq);
    for &ti in t {
        let args: Vec<f64> = (0..half)
            .map(|k| f64::from(ti) * (-(10000f64.ln()) * k as f64 / denom).exp())
            .collect();
        v.extend(args.iter().map(|a| a.cos()));
        v.extend(args.iter().map(|a| a.sin()));
    }
    Ok(Tensor::from_vec(v, (t.len(), freq), dev)?.to_dtype(dtype)?)
}

/// One block's `norm1.emb` (`CombinedTimestepLabelEmbeddings`): the timestep MLP and the label
/// table (its parameter as stored: the trained master, or a frozen copy in the compute dtype).
#[derive(Debug, Clone)]
pub struct EmbWeights {
    pub linear_1: LinearW,
    pub linear_2: LinearW,
    pub table: Tensor,
}

/// `timestep_embedder(features) + class_embedder(labels)`: the features (b, 256) in `cd`, the
/// label rows `ids` (b,) u32 → (b, D) in `ad`. Its locals go when it returns (what the
/// backward reads the graph keeps).
pub fn combined_embedding(tf: &Tensor, ids: &Tensor, w: &EmbWeights, ad: DType) -> Result<Tensor> {
    let h = w.linear_1.forward(tf)?.silu()?;
    let temb = cast(w.linear_2.forward(&h)?, ad)?;
    let yemb = cast(w.table.index_select(ids, 0)?, ad)?;
    Ok((temb + yemb)?)
}

/// The weights of one block.
#[derive(Debug, Clone)]
pub struct DitdBlockWeights {
    pub emb: EmbWeights,
    pub norm1: LinearW,
    pub q: LinearW,
    pub k: LinearW,
    pub v: LinearW,
    pub o: LinearW,
    pub fc1: LinearW,
    pub fc2: LinearW,
}

/// One `BasicTransformerBlock` with `norm_type="ada_norm_zero"`: x (b, s, D) in `ad`, the
/// timestep features (b, 256) in `cd` and the label rows (b,) → x (b, s, D) in `ad`; `eps3`
/// the feed-forward LayerNorm's epsilon ([`super::DitdGeom::norm_eps`]).
/// `AdaLayerNormZero`: its own embedder, `linear(SiLU(emb))` chunked in six (shift, scale,
/// gate of the attention, then of the feed-forward); self-attention over separate q, k, v;
/// no cross-attention; `norm2` + modulate, the GELU-tanh feed-forward. Every intermediate is a
/// local until the block returns (the budget's twin binds the same tensors).
pub fn ditd_block_forward(
    x: &Tensor,
    tf: &Tensor,
    ids: &Tensor,
    w: &DitdBlockWeights,
    cfg: &BlockConfig,
    eps3: f64,
) -> Result<Tensor> {
    let (b, _, h) = x.dims3()?;
    let (cd, ad) = (cfg.compute, cfg.accum);
    let keep = attn_keep(cfg.attn);
    let emb = combined_embedding(tf, ids, &w.emb, ad)?;
    let se = cast(emb.silu()?, cd)?;
    let modv = cast(w.norm1.forward(&se)?, ad)?;
    let m = AdaLnZero::of_rows(modv, h)?;

    // Self-attention.
    let [_h1, q, k, v] = m.attn_inputs(x, [&w.q, &w.k, &w.v], LN_EPS, cd)?;
    let o = attention(&q, &k, &v, b, cfg.heads, keep)?;
    let p = w.o.forward(&o)?;
    let x1 = gated_then_release(x, p, &m.gate_msa)?;

    // Feed-forward.
    let h2 = ln_modulate(&x1, &m.shift_mlp, &m.scale_mlp, eps3, cd)?;
    let f2 = feed_forward_then_release(&h2, &w.fc1, &w.fc2)?;
    gated_then_release(&x1, f2, &m.gate_mlp)
}

/// The output side: `shift, scale = proj_out_1(SiLU(conditioning)).chunk(2)`, `norm_out(x)·(1 +
/// scale) + shift`, `proj_out_2`: x (b, s, D) in `ad`, `se` = SiLU of block 0's embedding
/// (b, D) in `cd` → (b·s, p²·C_out) in `ad`.
pub fn final_forward(
    x: &Tensor,
    se: &Tensor,
    proj_out_1: &LinearW,
    proj_out_2: &LinearW,
    cd: DType,
    ad: DType,
) -> Result<Tensor> {
    let lins = (proj_out_1, proj_out_2);
    linear_modulated_out(x, se, lins, ShiftScale::ShiftFirst, cd, ad)
}
