//! The engine's fused MLP with a side input (`ops/fused_mlp_side.rs`): its workspace formula
//! [`fused_mlp_side_workspace`] and the node [`fused_mlp_side`].

use super::fused_mlp::{fc2_gelu_blocks, widen_phase};
use super::linear::{gemm_call_bytes, linear_workspace};
use crate::runtime::ditmem_cpu::graph::{Graph, Nid};
use crate::spec::{CpuSpec, Dtype};

/// Heap bytes of a tracked `ops::FusedMlpSide` node's op beside the u it keeps: candle's
/// `Arc<Box<dyn CustomOp2>>` (32) and the op (four weight handles, two sink handles, the keep
/// flag and the mutex over u: `size_of::<FusedMlpSide>()`, held equal by the engine's test).
pub const FUSED_MLP_SIDE_OP_BYTES: u64 = 32 + 96;

/// Workspace bytes (forward, backward) of the engine's fused MLP with a side input
/// (`ops::fused_mlp_side_*_scratch`) in compute dtype `cd`, weight gradients in `wd`, for
/// `(rows, inp, ffn, ds, out)` (fc2 reads ds + ffn), dx when `tx`, dside when `ts`, the weight
/// gradients `wants` = (dW1, db1, dW2, db2). Forward, beyond y and the kept u: fc1's workspace
/// less y; h = gelu(u) beside c = [side; h] less y; c with fc2's workspace. Backward, beyond
/// the gradients it hands out: on f32/f64 u, dW2, db2 and one chunk buffer
/// ([`fc2_gelu_blocks`]), then u and dside; widened bf16/f16 by chunks too ([`widen_phase`]);
/// on the AVX512-BF16 kernel h beside c; c, dc, fc2's workspace,
/// dW2, db2; dc beside its parts dside and du; then in every dtype du, every gradient and
/// fc1's workspace.
/// With `gemm`'s per-call packing in each phase ([`linear_workspace`] for each of its linear
/// calls): the node's workspace on the spec's CPU.
pub(crate) fn fused_mlp_side_workspace(
    cpu: &CpuSpec,
    (cd, wd): (Dtype, Dtype),
    dims: (u64, u64, u64, u64, u64),
    (tx, ts, wants): (bool, bool, [bool; 4]),
    master: bool,
) -> (u64, u64) {
    let lin = |dims, t| linear_workspace(cpu, cd, dims, t, master);
    let threads = u64::from(cpu.threads.max(1));
    let mm = |mnk, strides| gemm_call_bytes(cpu, (cd.size(), threads), mnk, strides);
    let how = (cpu.bf16_kernel(), master);
    fused_mlp_side_phases((lin, mm), (cd, wd), dims, (tx, ts, wants), how)
}

/// The phases of the fused MLP with a side input over the workspace `lin(dims, tracks)` of
/// each of its linear calls.
fn fused_mlp_side_phases(
    (lin, mm): (
        impl Fn((u64, u64, u64), (bool, bool, bool)) -> (u64, u64),
        impl Fn((u64, u64, u64), [(u64, u64); 3]) -> u64,
    ),
    (cd, wd): (Dtype, Dtype),
    (rows, inp, ffn, ds, out): (u64, u64, u64, u64, u64),
    (tx, ts, wants): (bool, bool, [bool; 4]),
    (native, master): (bool, bool),
) -> (u64, u64) {
    let (e, we) = (cd.size(), wd.size());
    let (h, c, y) = (e * rows * ffn, e * rows * (ds + ffn), e * rows * out);
    let dside = if ts { e * rows * ds } else { 0 };
    let (s1, _) = lin((rows, inp, ffn), (false, false, false));
    let (s2, _) = lin((rows, ds + ffn, out), (false, false, false));
    let (_, b2w) = lin((rows, ds + ffn, out), (false, wants[2], wants[3]));
    let (_, b2x) = lin((rows, ds + ffn, out), (true, false, false));
    let (_, b1) = lin((rows, inp, ffn), (tx, wants[0], wants[1]));
    let on = |b: bool, n: u64| if b { we * n } else { 0 };
    let g2 = on(wants[2], out * (ds + ffn)) + on(wants[3], out);
    let g1 = on(wants[0], ffn * inp) + on(wants[1], ffn) + if tx { e * rows * inp } else { 0 };
    let fwd = s1
        .saturating_sub(y)
        .max((h + c).saturating_sub(y))
        .max(c + s2);
    // u (h's size) counts until the op frees it before fc1's phase; the node releases it as
    // its backward starts (`Node::released_by_bwd`).
    // c = [side; h] (and h beside it while it is made) only for fc2's weight gradients;
    // dropped before dc is made.
    let last = h + dside + g1 + g2 + b1;
    let peak = if matches!(cd, Dtype::F32 | Dtype::F64) {
        // By chunks and column blocks ([`fc2_gelu_blocks`]): neither c nor dc is made; dside
        // straight from g·W2[:, ..ds] once the chunk buffer is freed.
        let (buf, pack) = fc2_gelu_blocks(&mm, e, (rows, ds, ffn, out), wants[2]);
        let pack_side = if ts {
            mm((rows, ds, out), [(ds, 1), (out, 1), (ds + ffn, 1)])
        } else {
            0
        };
        (h + g2 + buf + pack)
            .max(h + g2 + dside + pack_side)
            .max(last)
    } else if cd == Dtype::F16 || !native {
        // By chunks and column blocks, dside made with the first block's dh: neither c nor
        // dc is made ([`widen_phase`]).
        let dims = (rows, ds, ffn, out);
        let want = (wants[2], wants[3], ts);
        widen_phase(&mm, e, dims, want, master, (h + dside, g2)).max(last)
    } else {
        let made = if wants[2] || wants[3] { 1 } else { 0 };
        (made * (2 * h + c))
            .max(made * (h + c + b2w + g2))
            .max(h + c + b2x + g2)
            .max(c + dside + 2 * h + g2)
            .max(last)
    };
    (fwd, peak - g1 - g2 - dside)
}

/// `ops::fused_mlp_side` of the engine: `fc2([side; gelu_tanh(fc1(x))])` as one node on x and
/// side (the weights `ws` = [W1, b1, W2, b2] are its other inputs here, sunk or frozen). A
/// fresh (rows, out) output; tracked, it keeps u = fc1(x) (rows × ffn, compute dtype, held
/// until the graph drops) and its boxed op ([`FUSED_MLP_SIDE_OP_BYTES`]). Workspace:
/// [`fused_mlp_side_workspace`]. Its backward returns dx and dside only.
pub fn fused_mlp_side(
    g: &mut Graph,
    name: &str,
    [x, side]: [Nid; 2],
    ws: [Nid; 4],
    (rows, inp, ffn, ds, out): (u64, u64, u64, u64, u64),
    cpu: &CpuSpec,
) -> Nid {
    let (cd, wd) = (g.dtype(x), g.dtype(ws[0]));
    let wants = ws.map(|i| g.nodes[i].sunk);
    let (tx, ts) = (g.nodes[x].tracks, g.nodes[side].tracks);
    let master = wd == Dtype::F32 && matches!(cd, Dtype::Bf16 | Dtype::F16);
    let (fwd, bwd) = fused_mlp_side_workspace(
        cpu,
        (cd, wd),
        (rows, inp, ffn, ds, out),
        (tx, ts, wants),
        master,
    );
    g.keeping_op(
        name,
        &[x, side, ws[0], ws[1], ws[2], ws[3]],
        (rows * out, cd),
        (fwd, bwd),
        (rows * ffn * cd.size(), FUSED_MLP_SIDE_OP_BYTES),
    )
}
