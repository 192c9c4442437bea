//! The sizes the engine's fused ops allocate by, candle-free, one function each: the row chunks
//! and column blocks of the linear and the fused MLP, the AVX512-BF16 kernel's packed operands.
//! The engine allocates with these very functions (`ditmem_engine::ops::linear::common`,
//! `mlp_linear.rs`, `fused_mlp_dx.rs`, `fused_mlp_widen.rs`, `linear/bf16.rs`) and the scratch
//! formulas of [`super::linear`], [`super::fused_mlp`], [`super::fused_mlp_side`],
//! [`super::joint_linear`] and [`super::attention`] count with them: a chunk size is changed by
//! one edit here.

/// Keys per block of the engine's streaming attention kernels (`ops::ATTN_KEY_BLOCK`).
pub const ATTN_KEY_BLOCK: u64 = 128;
/// Queries per block of the backward of the engine's generic streaming attention kernels
/// (`ops::ATTN_QUERY_BLOCK`): P and dP of a block are this × [`ATTN_KEY_BLOCK`].
pub const ATTN_QUERY_BLOCK: u64 = 64;

/// Accumulation-type elements (forward, backward) of one head's scratch in the engine's generic
/// attention kernels — the fused qkv attention (`ops::AttnGeom::{fwd_scratch, bwd_scratch}`,
/// `s_q = s_kv`) and the separate one (`ops::attention::separate::{sep_fwd_scratch,
/// sep_bwd_scratch}`) allocate by it, the `ditmem-cpu` runtime predicts by it — for `sq`
/// queries over `sk` keys of width `dh`. Forward: q, the head's output (s_q × d_h), k, v
/// (s_kv × d_h) and S (s_q × s_kv); streaming (`streaming`, the memory-efficient mode), a block
/// of [`ATTN_KEY_BLOCK`] scores per query and the row max and sum instead of S. Backward: q, dO,
/// dq (s_q × d_h), k, v, dk, dv (s_kv × d_h), P and dP; streaming, a ([`ATTN_QUERY_BLOCK`] ×
/// [`ATTN_KEY_BLOCK`]) block of each and the row deltas.
pub fn attention_head_elems(sq: u64, sk: u64, dh: u64, streaming: bool) -> (u64, u64) {
    let (fwd, bwd) = (2 * sq * dh + 2 * sk * dh, 3 * sq * dh + 4 * sk * dh);
    if streaming {
        let (qb, kb) = (ATTN_QUERY_BLOCK.min(sq), ATTN_KEY_BLOCK.min(sk));
        (fwd + sq * kb + 2 * sq, bwd + 2 * qb * kb + sq)
    } else {
        (fwd + sq * sk, bwd + 2 * sq * sk)
    }
}

/// Accumulation-type elements (forward, backward) of one head's scratch in the engine's ReLU
/// linear attention (`ops::linear_attention::{lin_fwd_scratch, lin_bwd_scratch}` allocate by
/// it), `s` tokens of width `dh`. Forward: φ(q), φ(k), v, the output (s × d_h each), KV (d_h²),
/// z (d_h), the denominators (s). Backward: φ(q), φ(k), v, dO, the output (then dq), dk, dv
/// (s × d_h each), KV and dKV (d_h² each), z and dz (d_h each), the denominators and their
/// gradients (s each).
pub fn linear_attention_head_elems(s: u64, dh: u64) -> (u64, u64) {
    (
        4 * s * dh + dh * dh + dh + s,
        7 * s * dh + 2 * dh * dh + 2 * dh + 2 * s,
    )
}

/// Accumulation-type elements (forward, backward) of the workspace of the engine's fused SiLU +
/// depthwise 3×3 conv over `c` channels (`ops::dwconv::{dwconv_fwd_scratch,
/// dwconv_bwd_scratch}` allocate by it). Forward: the weights widened to the accumulation type,
/// tap-major (9·C), and the bias (C). Backward: the widened weights (9·C) and the per-channel
/// sums of the weight and bias gradients (10·C).
pub fn dwconv_elems(c: u64) -> (u64, u64) {
    (10 * c, 19 * c)
}

/// Elements (of x's dtype, of the accumulation type) of the backward workspace of the engine's
/// fused per-head RMSNorm + RoPE (`ops::norm_rope`, `ops::joint_norm_rope` allocate by it) on x
/// of `elems` elements and head width `dh`: the un-rotated gradient (x's shape) and one rstd per
/// (row, head) group.
pub fn norm_rope_bwd_elems(elems: u64, dh: u64) -> (u64, u64) {
    (elems, elems / dh.max(1))
}

/// Rows per chunk of the engine's low-precision (bf16/f16) linear (`ops::LINEAR_ROWS`).
pub const LINEAR_ROWS: u64 = 128;
/// Columns of W per packed panel of the engine's bf16 kernel backward's dx product where the rows
/// fit one chunk (`ops::linear::bf16::DX_PANEL_COLS`: two of the kernel's 64-column panels; W
/// is packed whole over several chunks).
pub(crate) const BF16_DX_PANEL_COLS: u64 = 2 * BF16_KERNEL_TILE.1;

/// Rows per product of the engine's f32/f64 weight gradient (`ops::DW_ROWS`): `dW = Σ g_cᵀ·x_c`
/// over chunks of this many rows, so `gemm` packs at most a (256 × out) panel of g per call.
pub const DW_ROWS: u64 = 256;

/// Columns of W per packed panel of the dx product of the engine's bf16 kernel backward
/// (`ops::linear::bf16::dx_panel_cols`, which calls this) for `rows` rows and `inp` columns:
/// panels of [`BF16_DX_PANEL_COLS`] when the rows fit one chunk of [`LINEAR_ROWS`], else W
/// whole.
pub fn bf16_dx_panel_cols(rows: u64, inp: u64) -> u64 {
    if rows <= LINEAR_ROWS {
        BF16_DX_PANEL_COLS.min(inp)
    } else {
        inp
    }
}

/// Widest block of the hidden width the engine's f32/f64 fused MLP backward of fc2 and the GELU
/// handles at a time (`ops::MLP_COLS`): its chunk buffer holds [`DW_ROWS`] rows of one block.
pub const MLP_COLS: u64 = 128;

/// The (first column, columns) blocks of a hidden width `ffn` (`ops::mlp_col_blocks`):
/// ⌈ffn / [`MLP_COLS`]⌉ blocks whose widths differ by at most one, but none of 64 columns or
/// fewer (so ffn 129 is one block).
pub fn mlp_col_blocks(ffn: u64) -> impl Iterator<Item = (u64, u64)> {
    col_blocks_under(ffn, MLP_COLS)
}

/// ⌈ffn / cap⌉ blocks whose widths differ by at most one, none of 64 columns or fewer unless
/// ffn is (`fused_mlp::col_blocks_under`).
pub(crate) fn col_blocks_under(ffn: u64, cap: u64) -> impl Iterator<Item = (u64, u64)> {
    let n = ffn.div_ceil(cap.max(1)).min(ffn / 65).max(1);
    (0..n).map(move |i| (i * ffn / n, (i + 1) * ffn / n - i * ffn / n))
}

/// Rows of dx the engine's f32/f64 fused MLP makes first into a buffer of its own before
/// writing the rest of dx over du (`ops::fused_mlp_dx::DX_FIRST_ROWS`).
pub const DX_FIRST_ROWS: u64 = 64;

/// The (first row, rows) chunks by which the engine's f32/f64 fused MLP writes dx = du·W1 over
/// du (the engine's `ops::fused_mlp_dx` runs this very plan): the first [`DX_FIRST_ROWS`]
/// through a buffer, each later one below du's unread rows (at most r0·(ffn − in)/in rows after
/// r0), the last of 4 rows or more; none (a fresh dx) for in ≤ 64, ffn < 2·in or fewer than 68
/// rows. In above 64 and chunks of 4 rows or more keep every chunk's product on `gemm`'s general
/// path, as the whole product is, so dx has the same bits.
pub fn dx_over_du_chunks(rows: u64, inp: u64, ffn: u64) -> Vec<(u64, u64)> {
    if inp <= 64 || ffn < 2 * inp || rows < DX_FIRST_ROWS + 4 {
        return Vec::new();
    }
    let mut chunks = vec![(0, DX_FIRST_ROWS)];
    let mut r0 = DX_FIRST_ROWS;
    while r0 < rows {
        let cap = r0 * (ffn - inp) / inp;
        let left = rows - r0;
        let n = match left.checked_sub(cap) {
            None | Some(0) => left,
            Some(1..=3) => cap - 4,
            Some(_) => cap,
        };
        chunks.push((r0, n));
        r0 += n;
    }
    chunks
}

/// Narrowest cap on a block of dW's rows per product of that weight gradient (`ops::DW_COLS`):
/// `gemm` packs a (chunk rows × block) panel of g.
pub const DW_COLS: u64 = 128;

/// A block of dW's rows is up to rows·out / (this·[`DW_ROWS`]) wide, never under [`DW_COLS`]
/// (`ops::DW_PANEL_SHARE`): the packed panel stays within 1/16 of g.
pub const DW_PANEL_SHARE: u64 = 16;

/// The (first row, rows) blocks of dW's `out` rows the engine multiplies one by one for a
/// gradient of `rows` rows (`ops::dw_blocks`): as few as keep each under the cap, of equal
/// width rounded up to 16, the last what remains.
pub fn dw_blocks(rows: u64, out: u64) -> impl Iterator<Item = (u64, u64)> {
    let cap = DW_COLS.max(rows.saturating_mul(out) / (DW_PANEL_SHARE * DW_ROWS));
    let n = out.div_ceil(cap).max(1);
    let width = out.div_ceil(n).next_multiple_of(16).max(1);
    (0..out)
        .step_by(width as usize)
        .map(move |o0| (o0, width.min(out - o0)))
}

/// Rows / columns of the engine's AVX512-BF16 micro-kernel tile (`kernels::gemm_bf16::{MR, NR}`): packed
/// operands are padded to whole tiles.
pub(crate) const BF16_KERNEL_TILE: (u64, u64) = (6, 64);

/// Bytes of a packed bf16 A operand (m × k): whole tiles of rows × ⌈k/2⌉ pairs of u16.
pub(crate) fn packed_a_bytes(m: u64, k: u64) -> u64 {
    4 * m.div_ceil(BF16_KERNEL_TILE.0) * BF16_KERNEL_TILE.0 * k.div_ceil(2)
}

/// Bytes of a packed bf16 B operand (k × n): whole tiles of columns × ⌈k/2⌉ pairs of u16.
pub(crate) fn packed_b_bytes(k: u64, n: u64) -> u64 {
    4 * n.div_ceil(BF16_KERNEL_TILE.1) * BF16_KERNEL_TILE.1 * k.div_ceil(2)
}

/// The rows of each chunk of `rows` the engine's chunked linears run through (`LINEAR_ROWS` a
/// chunk, the rest last): the full chunk and the remainder, if any.
pub(crate) fn chunk_rows(rows: u64) -> impl Iterator<Item = u64> {
    let r = LINEAR_ROWS.min(rows);
    [r, rows % r.max(1)].into_iter().filter(|&n| n > 0)
}

/// A block of u's columns in the engine's widened backward of fc2 and the GELU is up to
/// rows·ffn / (this·[`LINEAR_ROWS`]) wide, never under [`MLP_COLS`]
/// (`fused_mlp_widen::WIDEN_BLOCK_SHARE`).
pub const WIDEN_BLOCK_SHARE: u64 = 16;

/// The (first column, columns) blocks of u's `ffn` columns of that backward for `rows` rows
/// (`fused_mlp_widen::widen_col_blocks`): as [`mlp_col_blocks`] with the wider cap.
pub fn widen_col_blocks(rows: u64, ffn: u64) -> impl Iterator<Item = (u64, u64)> {
    let cap = MLP_COLS.max(rows.saturating_mul(ffn) / (WIDEN_BLOCK_SHARE * LINEAR_ROWS));
    col_blocks_under(ffn, cap)
}
