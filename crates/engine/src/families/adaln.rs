//! The adaLN-Zero modulation every block with six modulation rows reads alike (the DiT's,
//! diffusers' DiT's, PixArt's, Sana's, Wan's): shift, scale and gate of the attention, then of
//! the MLP, as six (b, D) `narrow` views of one (b, 6D) tensor (`.chunk(6, dim=1)` in the
//! models' sources). The block still computes that tensor its own way (the DiT from its own
//! linear; PixArt, Sana and Wan as the shared timestep modulation plus the block's
//! `scale_shift_table`, [`AdaLnZero::of_table`]).

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::layers::{cast, cast_then_release, linear_then_release, LinearW, LN_EPS};
use crate::ops::ln_modulate;

/// The six modulation rows of one block, views of one (b, 6D) tensor.
pub(crate) struct AdaLnZero {
    pub(crate) shift_msa: Tensor,
    pub(crate) scale_msa: Tensor,
    pub(crate) gate_msa: Tensor,
    pub(crate) shift_mlp: Tensor,
    pub(crate) scale_mlp: Tensor,
    pub(crate) gate_mlp: Tensor,
    /// The (b, 6D) tensor the views read and the table's (1, 6D) view it was summed with:
    /// held until the block returns, as the block's locals were (the budget's twin binds the
    /// same tensors, and the step's measured peak counts their handles).
    _rows: (Tensor, Option<Tensor>),
}

impl AdaLnZero {
    /// The six (b, D) views of `rows` (b, 6D), `h` = D wide.
    pub(crate) fn of_rows(rows: Tensor, h: usize) -> Result<AdaLnZero> {
        AdaLnZero::split(rows, None, h)
    }

    /// `(scale_shift_table[None] + timestep.reshape(b, 6, D)).chunk(6)` (diffusers'
    /// `ada_norm_single` blocks, Wan's `scale_shift_table + temb`): the (b, 6D) timestep
    /// modulation `t6` plus the block's `table` (6, D) or (1, 6, D) as one (b, 6D) sum.
    pub(crate) fn of_table(t6: &Tensor, table: &Tensor, h: usize) -> Result<AdaLnZero> {
        let table = table.reshape((1, 6 * h))?;
        let rows = t6.broadcast_add(&table)?;
        AdaLnZero::split(rows, Some(table), h)
    }

    /// The self-attention's inputs: `norm1(x)` modulated by the attention's shift and scale
    /// (LayerNorm of epsilon `eps`, in `cd`) and the separate q, k, v projections `qkv` on it:
    /// [h1, q, k, v], each held by the block until it returns.
    pub(crate) fn attn_inputs(
        &self,
        x: &Tensor,
        [wq, wk, wv]: [&LinearW; 3],
        eps: f64,
        cd: DType,
    ) -> Result<[Tensor; 4]> {
        let h1 = ln_modulate(x, &self.shift_msa, &self.scale_msa, eps, cd)?;
        let q = wq.forward(&h1)?;
        let k = wk.forward(&h1)?;
        let v = wv.forward(&h1)?;
        Ok([h1, q, k, v])
    }

    fn split(rows: Tensor, table: Option<Tensor>, h: usize) -> Result<AdaLnZero> {
        let chunk = |i: usize| rows.narrow(1, i * h, h);
        Ok(AdaLnZero {
            shift_msa: chunk(0)?,
            scale_msa: chunk(1)?,
            gate_msa: chunk(2)?,
            shift_mlp: chunk(3)?,
            scale_mlp: chunk(4)?,
            gate_mlp: chunk(5)?,
            _rows: (rows, table),
        })
    }
}

/// Which half of an output side's (b, 2D) modulation is the shift.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ShiftScale {
    /// `shift, scale = emb.chunk(2)` (diffusers' DiT `proj_out_1`).
    ShiftFirst,
    /// `scale, shift = emb.chunk(2)` (`AdaLayerNormContinuous`: SD3's `norm_out`).
    ScaleFirst,
}

/// An output side modulated by a linear of the conditioning: `emb = norm.forward(se)` (b, 2D)
/// in `ad`, `LN(x)·(1 + scale) + shift` (eps 1e-6) in `cd`, `proj_out`, back to `ad`; the
/// projection's input and output released as the fused linear allows. x (b, s, D) in `ad`,
/// `se` (b, D) in `cd` → (b·s, p²·C_out) in `ad`.
pub(crate) fn linear_modulated_out(
    x: &Tensor,
    se: &Tensor,
    (norm, proj_out): (&LinearW, &LinearW),
    order: ShiftScale,
    cd: DType,
    ad: DType,
) -> Result<Tensor> {
    let h = x.dim(2)?;
    let e = cast(norm.forward(se)?, ad)?;
    let (first, second) = (e.narrow(1, 0, h)?, e.narrow(1, h, h)?);
    let (shift, scale) = match order {
        ShiftScale::ShiftFirst => (first, second),
        ShiftScale::ScaleFirst => (second, first),
    };
    let hx = ln_modulate(x, &shift, &scale, LN_EPS, cd)?;
    let y = linear_then_release(proj_out, &hx)?;
    cast_then_release(y, ad)
}
