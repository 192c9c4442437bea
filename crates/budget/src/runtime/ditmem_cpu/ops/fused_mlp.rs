//! The engine's fused MLP (`ops/fused_mlp.rs` with `fused_mlp_bf16.rs`, `fused_mlp_widen.rs`,
//! `fused_mlp_dx.rs`): its workspace formula [`fused_mlp_workspace`] and the node [`fused_mlp`].

use super::linear::{gemm_call_bytes, linear_workspace};
use super::sizes::{
    chunk_rows, dw_blocks, dx_over_du_chunks, mlp_col_blocks, packed_a_bytes, packed_b_bytes,
    widen_col_blocks, DW_ROWS, DX_FIRST_ROWS, LINEAR_ROWS,
};
use crate::runtime::ditmem_cpu::graph::{Graph, Nid};
use crate::spec::{CpuSpec, Dtype};

/// Heap bytes of a tracked `ops::FusedMlp` node's op beside the u it keeps: candle's
/// `Arc<Box<dyn CustomOp1>>` (32) and the op itself (four weight handles, two sink handles, the
/// keep flag and the mutex over u: `size_of::<FusedMlp>()`, held equal by the engine's test).
pub const FUSED_MLP_OP_BYTES: u64 = 32 + 96;

/// Workspace bytes (forward, backward) of the engine's fused MLP (`ops::fused_mlp_*_scratch`)
/// in compute dtype `cd` with weight gradients in `wd`, for `(rows, inp, ffn, out)`, dx when
/// `tx`, and the weight gradients `wants` = (dW1, db1, dW2, db2). Each phase is one of
/// [`fused_linear_scratch`]'s. Forward, beyond y and the kept u: the larger of fc1's workspace
/// less y, and h = gelu(u) with fc2's workspace. Backward, beyond the gradients it hands out:
/// the peak of its phases ([`fused_mlp_phases`], by row chunks) less the gradients.
/// With `gemm`'s per-call packing in each phase ([`linear_workspace`] for each of the four
/// products): the node's workspace on the spec's CPU.
pub(crate) fn fused_mlp_workspace(
    cpu: &CpuSpec,
    (cd, wd): (Dtype, Dtype),
    dims: (u64, u64, u64, u64),
    (tx, wants): (bool, [bool; 4]),
    master: bool,
) -> (u64, u64) {
    let lin = |dims, t| linear_workspace(cpu, cd, dims, t, master);
    let threads = u64::from(cpu.threads.max(1));
    let mm = |mnk, strides| gemm_call_bytes(cpu, (cd.size(), threads), mnk, strides);
    fused_mlp_phases(
        (lin, mm),
        (cd, wd),
        dims,
        (tx, wants),
        (cpu.bf16_kernel(), master),
    )
}

/// The fused MLP's phases over the workspace `lin(dims, tracks)` of each of its linears and,
/// on f32/f64, `gemm`'s per-call packing `mm((m, n, k), [dst, lhs, rhs] strides)` of the
/// products fc2's backward makes itself. The backward's last phase is alike in every dtype:
/// du, every gradient and fc1's workspace, except that on f32/f64 with dx tracked dx is written
/// over du by the chunks of [`dx_over_du_chunks`] (after dW1 and db1; beside du then only the
/// first chunk's buffer and a chunk product's packing). Before it, on f32/f64 (the engine's
/// `fc2_gelu_bwd_direct`): u, dW2 and db2 beside one chunk buffer of min(rows, [`DW_ROWS`])
/// rows × the widest column block ([`mlp_col_blocks`]), with the packing of a block's dW2
/// product (per block of dW's rows, [`dw_blocks`], when dW2 is made) or of its dh product;
/// widened (bf16/f16 without the AVX512-BF16 kernel, `native` false; the engine's
/// `fc2_gelu_bwd_widen`) by row chunks too ([`widen_phase`]); on the kernel (the engine's
/// `fc2_gelu_bwd_bf16`) by chunks of [`LINEAR_ROWS`] rows: u, dW2, db2 and fc2's whole linear
/// workspace with a dh chunk and an h chunk, du written over u.
fn fused_mlp_phases(
    (lin, mm): (
        impl Fn((u64, u64, u64), (bool, bool, bool)) -> (u64, u64),
        impl Fn((u64, u64, u64), [(u64, u64); 3]) -> u64,
    ),
    (cd, wd): (Dtype, Dtype),
    (rows, inp, ffn, out): (u64, u64, u64, u64),
    (tx, wants): (bool, [bool; 4]),
    (native, master): (bool, bool),
) -> (u64, u64) {
    let (e, we) = (cd.size(), wd.size());
    let (h, y) = (e * rows * ffn, e * rows * out);
    let (s1, _) = lin((rows, inp, ffn), (false, false, false));
    let (s2, _) = lin((rows, ffn, out), (true, false, false));
    let (_, sd) = lin((rows, inp, ffn), (tx, wants[0], wants[1]));
    let on = |b: bool, n: u64| if b { we * n } else { 0 };
    let g2 = on(wants[2], out * ffn) + on(wants[3], out);
    let g1 = on(wants[0], ffn * inp) + on(wants[1], ffn) + if tx { e * rows * inp } else { 0 };
    let fwd = s1.saturating_sub(y).max(h + s2);
    // u (as big as dh) counts until the op frees it; the node releases it as its backward
    // starts (`Node::released_by_bwd`). The output gradient (y's size, alive beside the whole
    // backward in `custom_backward`) is freed before fc1's backward, which no longer reads it:
    // the last phase is that much lower (the engine's `FusedMlp::bwd`, `ops::release`).
    let last = (h + g1 + g2 + sd).saturating_sub(y);
    let over = dx_over_du_chunks(rows, inp, ffn);
    let last = if tx && matches!(cd, Dtype::F32 | Dtype::F64) && !over.is_empty() {
        // dx written over du (the engine's `fused_mlp_dx`): dW1 and db1 first (fc1's
        // backward without dx: its dW packing), then dx by chunks, the first into a buffer of
        // its own, the rest in place; du's buffer becomes dx, so dx's bytes are not beside it.
        let (_, sw) = lin((rows, inp, ffn), (false, wants[0], wants[1]));
        let pack = |n: u64| mm((n, inp, ffn), [(inp, 1), (ffn, 1), (inp, 1)]);
        let first = e * DX_FIRST_ROWS * inp + pack(DX_FIRST_ROWS);
        let rest = over[1..].iter().map(|&(_, n)| pack(n)).max().unwrap_or(0);
        (h + g1 + g2 - e * rows * inp + sw.max(first).max(rest)).saturating_sub(y)
    } else {
        last
    };
    let peak = if matches!(cd, Dtype::F32 | Dtype::F64) {
        let (buf, pack) = fc2_gelu_blocks(&mm, e, (rows, 0, ffn, out), wants[2]);
        (h + g2 + buf + pack).max(last)
    } else if cd == Dtype::F16 || !native {
        let dims = (rows, 0, ffn, out);
        widen_phase(&mm, e, dims, (wants[2], wants[3], false), master, (h, g2)).max(last)
    } else {
        // By chunks of [`LINEAR_ROWS`] rows (`fused_mlp_bf16::fc2_gelu_bwd_bf16`): fc2's dx
        // product with W2 packed whole (not the linear's panels: every chunk reads all of it), a
        // packed g chunk and an f32 dh chunk, and fc2's dW/db workspace at once, with a bf16 dh
        // chunk and, for dW2, a bf16 h chunk.
        let r = LINEAR_ROWS.min(rows);
        let dx = packed_b_bytes(out, ffn) + packed_a_bytes(r, out) + 4 * r * ffn;
        let (_, sb) = lin((rows, ffn, out), (false, wants[2], wants[3]));
        let sb = sb + dx;
        let chunk = e * r * ffn;
        let chunks = sb + chunk + if wants[2] { chunk } else { 0 };
        (h + chunks + g2).max(last)
    };
    (fwd, peak.saturating_sub(g1 + g2))
}

/// The engine's f32/f64 backward of fc2 and the GELU by chunks of [`DW_ROWS`] rows and blocks
/// of u's columns ([`mlp_col_blocks`]; `fused_mlp::fc2_gelu_bwd_direct`, fc2 reading
/// `[side; gelu(u)]` with `ds` side columns, 0 for the plain MLP): its chunk buffer's bytes
/// (elements of `e` bytes) and the most `gemm` packs in one of its products `mm` — dW2's side
/// columns and each block's columns (per block of dW's rows, [`dw_blocks`], when `dw2`), and
/// each block's dh.
pub(super) fn fc2_gelu_blocks(
    mm: &impl Fn((u64, u64, u64), [(u64, u64); 3]) -> u64,
    e: u64,
    (rows, ds, ffn, out): (u64, u64, u64, u64),
    dw2: bool,
) -> (u64, u64) {
    let n2 = ds + ffn;
    let wmax = mlp_col_blocks(ffn).map(|b| b.1).max().unwrap_or(0);
    let mut pack = 0;
    for k in [rows.min(DW_ROWS), rows % DW_ROWS]
        .into_iter()
        .filter(|&k| k > 0)
    {
        if dw2 && ds > 0 {
            for (_, mb) in dw_blocks(rows, out) {
                pack = pack.max(mm((mb, ds, k), [(n2, 1), (1, out), (ds, 1)]));
            }
        }
        for (_, w) in mlp_col_blocks(ffn) {
            if dw2 {
                for (_, mb) in dw_blocks(rows, out) {
                    pack = pack.max(mm((mb, w, k), [(n2, 1), (1, out), (w, 1)]));
                }
            }
            pack = pack.max(mm((k, w, out), [(w, 1), (out, 1), (n2, 1)]));
        }
    }
    (e * rows.min(DW_ROWS) * wmax, pack)
}

/// `ops::fused_mlp` of the engine: `fc2(gelu_tanh(fc1(x)))` as one node on x (the weights
/// `ws` = [W1, b1, W2, b2] are its other inputs here, sunk or frozen, so their gradients are
/// counted). A fresh (rows, out) output; tracked, it keeps u = fc1(x) (rows × ffn, compute
/// dtype; turned into du in place by its backward (into h on the AVX512-BF16 kernel), and freed
/// there, which the node's `released_by_bwd` replays) and its boxed
/// op ([`FUSED_MLP_OP_BYTES`]). Workspace: [`fused_mlp_workspace`]. Its backward returns dx only
/// (no wide gradient enters candle's store).
pub fn fused_mlp(
    g: &mut Graph,
    name: &str,
    x: Nid,
    ws: [Nid; 4],
    (rows, inp, ffn, out): (u64, u64, u64, u64),
    cpu: &CpuSpec,
) -> Nid {
    let (cd, wd) = (g.dtype(x), g.dtype(ws[0]));
    let wants = ws.map(|i| g.nodes[i].sunk);
    let tx = g.nodes[x].tracks;
    let master = wd == Dtype::F32 && matches!(cd, Dtype::Bf16 | Dtype::F16);
    let (fwd, bwd) = fused_mlp_workspace(cpu, (cd, wd), (rows, inp, ffn, out), (tx, wants), master);
    g.keeping_op(
        name,
        &[x, ws[0], ws[1], ws[2], ws[3]],
        (rows * out, cd),
        (fwd, bwd),
        (rows * ffn * cd.size(), FUSED_MLP_OP_BYTES),
    )
}
/// f32 and compute-dtype element counts of the workspace of the engine's widened backward of
/// fc2 and the GELU (`fused_mlp_widen::fc2_gelu_widen_workspace`) for `(rows, ds, ffn, out)`:
/// g's chunk of [`LINEAR_ROWS`] rows column-major, W2ᵀ in f32, one f32 block of the side's
/// columns and the widest of u's ([`widen_col_blocks`]); a block of u's in the compute dtype.
pub(crate) fn fc2_gelu_widen_workspace((rows, ds, ffn, out): (u64, u64, u64, u64)) -> (u64, u64) {
    let r = LINEAR_ROWS.min(rows);
    let wmax = widen_col_blocks(rows, ffn).map(|b| b.1).max().unwrap_or(0);
    (r * out + (ds + ffn) * out + r * (ds + wmax), r * wmax)
}

/// The worst moment of the engine's widened backward of fc2 and the GELU (bf16/f16 without the
/// AVX512-BF16 kernel, `fused_mlp_widen::fc2_gelu_bwd_widen`) for `(rows, ds, ffn, out)` with
/// (dW2, db2, dside) as `want` asks: beside `held` (u, and dside for the side MLP), the f32
/// accumulators (the gradients `g2` themselves for f32 master weights), the workspace
/// ([`fc2_gelu_widen_workspace`]) and the most `gemm` packs in one of its products `mm`; for
/// bf16/f16 weights then the accumulators beside their narrowed copies `g2`. Elements of `e`
/// bytes. Products per chunk: dW2's side columns, each block's dW2 columns and dh (the first
/// with dside's columns when dside is made).
pub(super) fn widen_phase(
    mm: &impl Fn((u64, u64, u64), [(u64, u64); 3]) -> u64,
    e: u64,
    (rows, ds, ffn, out): (u64, u64, u64, u64),
    (w2, b2, side): (bool, bool, bool),
    master: bool,
    (held, g2): (u64, u64),
) -> u64 {
    let n2 = ds + ffn;
    let (f32s, es) = fc2_gelu_widen_workspace((rows, ds, ffn, out));
    let ws = 4 * f32s + e * es;
    let mut pack = 0;
    for k in chunk_rows(rows) {
        if w2 && ds > 0 {
            pack = pack.max(mm((ds, out, k), [(1, n2), (1, ds), (1, k)]));
        }
        for (j0, w) in widen_col_blocks(rows, ffn) {
            if w2 {
                pack = pack.max(mm((w, out, k), [(1, n2), (1, w), (1, k)]));
            }
            let cw = if side && ds > 0 && j0 == 0 { ds + w } else { w };
            pack = pack.max(mm((k, cw, out), [(1, k), (1, k), (1, out)]));
        }
    }
    if master {
        held + g2 + ws + pack
    } else {
        let on = |b: bool, n: u64| if b { 4 * n } else { 0 };
        let acc = on(w2, out * n2) + on(b2, out);
        (held + acc + ws + pack).max(held + acc + g2)
    }
}
