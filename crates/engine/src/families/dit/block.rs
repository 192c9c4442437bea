//! One adaLN-Zero DiT block and the final layer (facebookresearch/DiT `models.py` `DiTBlock`,
//! `FinalLayer`), composed exactly as the budget's op inventory models them (see the crate docs for
//! the tensor list). `cd` is the compute dtype of matmuls and attention, `ad` the accumulation
//! dtype of the residual stream, norms, softmax and modulation. The pieces every family's blocks
//! share (the linear's weights, the feed-forward, the block configuration) are in
//! [`crate::layers`].

use candle_core::{DType, Tensor};

use crate::error::{EngineError, Result};
use crate::families::adaln::AdaLnZero;
use crate::layers::{cast, feed_forward, mlp_linear, AttnImpl, BlockConfig, LinearW, LN_EPS};
use crate::ops::{
    gated_residual, gelu_tanh, ln_modulate, projected_attention, qkv_attention, AttnKeep, Dropout,
};

/// The weights of one block (dtypes: see the module docs).
#[derive(Debug, Clone)]
pub struct BlockWeights {
    pub adaln: LinearW,
    pub qkv: LinearW,
    pub proj: LinearW,
    pub fc1: LinearW,
    pub fc2: LinearW,
}

/// Seeds of the random streams of one block execution (replayed on recompute).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSeeds {
    pub attn: u64,
    pub mlp: u64,
}

/// One DiT block: x (b, s, D) and c (b, D) in `ad` → x (b, s, D) in `ad`.
pub fn block_forward(
    x: &Tensor,
    c: &Tensor,
    w: &BlockWeights,
    cfg: &BlockConfig,
    seeds: BlockSeeds,
) -> Result<Tensor> {
    let (b, _, h) = x.dims3()?;
    let (cd, ad) = (cfg.compute, cfg.accum);
    let (a, dh) = (cfg.heads, cfg.head_dim);
    // adaLN modulation: (b, 6D) → six (b, D) views.
    let silu_c = c.silu()?;
    let modv = cast(w.adaln.forward(&cast(silu_c, cd)?)?, ad)?;
    let m = AdaLnZero::of_rows(modv, h)?;

    // Attention branch.
    let h1 = ln_modulate(x, &m.shift_msa, &m.scale_msa, LN_EPS, cd)?;
    let dropout = (cfg.attn_dropout > 0.0).then_some(Dropout {
        p: cfg.attn_dropout,
        seed: seeds.attn,
    });
    // The fused attention reads q, k, v in place from the (b·s, 3D) projection and writes the
    // (b·s, D) layout the output projection takes: no splits, transposes or copies.
    let keep = match cfg.attn {
        AttnImpl::Materialized => AttnKeep::Probabilities,
        AttnImpl::RecomputeCore => AttnKeep::Nothing,
        AttnImpl::MemoryEfficient => {
            if dropout.is_some() {
                return Err(EngineError::unsupported(
                    "attention dropout with memory-efficient attention",
                    "use materialized attention or attn_dropout = 0",
                ));
            }
            AttnKeep::LogSumExp
        }
    };
    // Where h1 tracks and the projection has no LoRA, the projection runs inside the
    // attention's node (see `ops::ProjectedAttention`): dqkv never enters candle's store.
    let o2 = match mlp_linear(&w.qkv, h1.track_op()) {
        Some(proj) if h1.track_op() => projected_attention(&h1, &proj, b, a, keep, dropout)?,
        _ => qkv_attention(&w.qkv.forward(&h1)?, b, a, keep, dropout)?,
    };
    debug_assert_eq!(a * dh, h);
    // x + proj·gate as one node (see `ops::GatedResidual`): no kept product, no f32 copy of proj.
    let x1 = gated_residual(x, &w.proj.forward(&o2)?, &m.gate_msa)?;

    // MLP branch.
    let h2 = ln_modulate(&x1, &m.shift_mlp, &m.scale_mlp, LN_EPS, cd)?;
    if cfg.mlp_dropout > 0.0 {
        let d = Dropout {
            p: cfg.mlp_dropout,
            seed: seeds.mlp,
        };
        return mlp_dropout_residual(&x1, &h2, w, &m.gate_mlp, cd, d);
    }
    let f2 = feed_forward(&h2, &w.fc1, &w.fc2)?;
    Ok(gated_residual(&x1, &f2, &m.gate_mlp)?)
}

/// The MLP branch with dropout between the GELU and fc2, composed, and its gated residual:
/// x1 + fc2(gelu(fc1(h2))·mask)·gate. Its locals live until the block returns (the budget
/// binds them so).
fn mlp_dropout_residual(
    x1: &Tensor,
    h2: &Tensor,
    w: &BlockWeights,
    gate_mlp: &Tensor,
    cd: DType,
    d: Dropout,
) -> Result<Tensor> {
    let f1 = w.fc1.forward(h2)?;
    let g = gelu_tanh(&f1)?;
    let mask = crate::ops::dropout_mask(g.dims(), d, cd, g.device())?;
    let g = g.mul(&mask)?;
    Ok(gated_residual(x1, &w.fc2.forward(&g)?, gate_mlp)?)
}

/// The final layer's weights (dtypes: see the module docs).
#[derive(Debug, Clone)]
pub struct FinalWeights {
    pub adaln: LinearW,
    pub linear: LinearW,
}

/// Final layer: x (b, s, D), c (b, D) in `ad` → (b·s, p²·C_out) in `ad`.
pub fn final_forward(
    x: &Tensor,
    c: &Tensor,
    w: &FinalWeights,
    cd: DType,
    ad: DType,
) -> Result<Tensor> {
    let (_, _, h) = x.dims3()?;
    let modv = cast(w.adaln.forward(&cast(c.silu()?, cd)?)?, ad)?;
    let (shift, scale) = (modv.narrow(1, 0, h)?, modv.narrow(1, h, h)?);
    let hx = ln_modulate(x, &shift, &scale, LN_EPS, cd)?;
    cast(w.linear.forward(&hx)?, ad)
}
