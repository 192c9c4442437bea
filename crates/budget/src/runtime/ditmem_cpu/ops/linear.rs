//! The engine's fused linear (`ops/linear/`): its workspace formula [`fused_linear_scratch`]
//! (the kernels' own buffers), `gemm`'s per-call packing and the node [`fused_linear`].

use super::sizes::{
    bf16_dx_panel_cols, chunk_rows, dw_blocks, packed_a_bytes, packed_b_bytes, DW_ROWS, LINEAR_ROWS,
};
use crate::runtime::ditmem_cpu::gemm_pack::{spec_call_heap_bytes, GemmCall};
use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid};
use crate::spec::{CpuSpec, Dtype};

/// `gemm`'s per-call heap bytes for one product on the spec's CPU: elements of `elem` bytes on
/// `threads` (1: `Parallelism::None`), strides of `[dst, lhs, rhs]` as (row, column).
pub(crate) fn gemm_call_bytes(
    cpu: &CpuSpec,
    (elem, threads): (u64, u64),
    (m, n, k): (u64, u64, u64),
    [dst, lhs, rhs]: [(u64, u64); 3],
) -> u64 {
    spec_call_heap_bytes(
        cpu,
        &GemmCall {
            m,
            n,
            k,
            dst,
            lhs,
            rhs,
            elem,
            threads,
        },
    )
}

/// `gemm`'s per-call packing bytes (forward, backward's dx pass, backward's dW pass) of the
/// widened linear (`ops/linear/widen.rs`), the most of any of its products in each: all
/// operands column-major, so a product packs its lhs when its rows miss the SIMD lanes (a
/// chunk's rows forward and for dx, the `inp` rows of dWᵀ).
fn widened_linear_packing(
    cpu: &CpuSpec,
    (rows, inp, out): (u64, u64, u64),
    (tx, tw): (bool, bool),
) -> (u64, u64, u64) {
    let threads = u64::from(cpu.threads.max(1));
    let col_major = |m: u64, n: u64, k: u64| {
        gemm_call_bytes(cpu, (4, threads), (m, n, k), [(1, m), (1, m), (1, k)])
    };
    let (mut fwd, mut dx, mut dw) = (0, 0, 0);
    for n in chunk_rows(rows) {
        fwd = fwd.max(col_major(n, out, inp));
        if tx {
            dx = dx.max(col_major(n, inp, out));
        }
        if tw {
            dw = dw.max(col_major(inp, out, n));
        }
    }
    (fwd, dx, dw)
}

/// `gemm`'s per-call packing bytes (forward, backward) of the direct f32/f64 linear
/// (`ops/linear/direct.rs`), as workspace beside the node's output (forward) and beside all its
/// gradients (backward, [`super::backward`]'s custom rule). Forward `y += x·Wᵀ` into the fresh
/// (row-major) y; backward `dW = gᵀ·x` into a fresh dW by chunks of [`DW_ROWS`] rows and blocks
/// of dW's rows ([`dw_blocks`]; the product that packs a panel of g), then db, then `dx = g·W` into a fresh dx beside both: the backward's peak is that of each
/// product's packing over the gradients alive by then, stated here as the part above all of
/// them.
fn direct_linear_packing(
    cpu: &CpuSpec,
    elem: u64,
    (rows, inp, out): (u64, u64, u64),
    (tx, tw, tb): (bool, bool, bool),
) -> (u64, u64) {
    let threads = u64::from(cpu.threads.max(1));
    let mm = |m: u64, n: u64, k: u64, dst, lhs, rhs| {
        gemm_call_bytes(cpu, (elem, threads), (m, n, k), [dst, lhs, rhs])
    };
    let fwd = mm(rows, out, inp, (out, 1), (inp, 1), (1, inp));
    let db_bytes = if tb { out * elem } else { 0 };
    let dx_bytes = if tx { rows * inp * elem } else { 0 };
    let dx = if tx {
        mm(rows, inp, out, (inp, 1), (out, 1), (inp, 1))
    } else {
        0
    };
    // dW by chunks of DW_ROWS rows and blocks of dW's rows (`dw_blocks`): every call packs at
    // most the first chunk's panel of its block.
    let dw = if tw {
        dw_blocks(rows, out)
            .map(|(_, mb)| mm(mb, inp, rows.min(DW_ROWS), (inp, 1), (1, out), (inp, 1)))
            .max()
            .unwrap_or(0)
    } else {
        0
    };
    // The engine makes dW (then db) before dx: dW's packing beside dW alone, dx's beside all
    // three gradients; the workspace is what a phase holds beyond the gradients handed out.
    let bwd = dw.saturating_sub(db_bytes + dx_bytes).max(dx);
    (fwd, bwd)
}

/// Workspace bytes (forward, backward) of the engine's fused linear (`ops::linear_*_scratch`)
/// in compute dtype `cd` for the inputs that track (`(x, w, b)`), on the AVX512-BF16 kernel when
/// `native` (the spec's `cpu.bf16_products`, [`crate::CpuSpec`]), else widened: nothing on
/// f32/f64 (`gemm`'s own per-call packing, [`widened_linear_packing`], comes on top). `master`: W and b are
/// the f32 master weights, read rounded to `cd` (mixed precision without cast copies). Kernel:
/// forward packed Wᵀ, a packed x chunk, an f32 y chunk and an f32 b; backward for dx a packed
/// panel of [`BF16_DX_PANEL_COLS`] columns of W (W whole over several chunks), a packed g chunk
/// and an f32 chunk of the panel, for dW an f32 dW (the gradient itself when `master`), a
/// packed gᵀ chunk and a packed x chunk, for db an f32 db (likewise). Widened (all f32):
/// forward W, b and a chunk of x and y; backward in two passes beside a column-major g chunk
/// (for dx or dW): for dx Wᵀ and a dx chunk, before dW and db exist (their bytes come off
/// that pass's workspace); then for dW an f32 dW (likewise) and a row-major x chunk (the lhs
/// of dWᵀ = xᵀ·g, whose column-major destination is dW row-major), for db an f32 db
/// (likewise).
pub(crate) fn fused_linear_scratch(
    cd: Dtype,
    (rows, inp, out): (u64, u64, u64),
    (tx, tw, tb): (bool, bool, bool),
    native: bool,
    master: bool,
) -> (u64, u64) {
    let r = LINEAR_ROWS.min(rows);
    match cd {
        Dtype::Bf16 if native => {
            let fwd = packed_b_bytes(inp, out) + packed_a_bytes(r, inp) + 4 * (r * out + out);
            let mut bwd = 0;
            if tx {
                let pc = bf16_dx_panel_cols(rows, inp);
                bwd += packed_b_bytes(out, pc) + packed_a_bytes(r, out) + 4 * r * pc;
            }
            let acc = if master { 0 } else { 4 };
            if tw {
                bwd += acc * out * inp + packed_a_bytes(out, r) + packed_b_bytes(r, inp);
            }
            if tb {
                bwd += acc * out;
            }
            (fwd, bwd)
        }
        Dtype::Bf16 | Dtype::F16 => {
            let pass = widened_bwd_passes(cd, (rows, inp, out), (tx, tw, tb), master, (0, 0));
            (4 * (out * inp + out + r * (inp + out)), pass)
        }
        _ => (0, 0),
    }
}

/// The widened bf16/f16 backward's workspace beyond the gradients it hands out, with `gemm`'s
/// per-call packing `pack` = (dx pass, dW pass) on top of each pass (`widen::linear_bwd_widen`):
/// first dx beside the g chunk, Wᵀ and a dx chunk, while dW and db do not exist yet (their bytes
/// come off that pass); then beside the g chunk dW (an f32 accumulator unless `master`, whose
/// accumulator is the gradient), db likewise and an x chunk.
fn widened_bwd_passes(
    cd: Dtype,
    (rows, inp, out): (u64, u64, u64),
    (tx, tw, tb): (bool, bool, bool),
    master: bool,
    (pack_dx, pack_dw): (u64, u64),
) -> u64 {
    let r = LINEAR_ROWS.min(rows);
    let (acc, we) = if master { (0, 4) } else { (1, cd.size()) };
    let gc = if tx || tw { r * out } else { 0 };
    let dx_pass = if tx {
        4 * (gc + out * inp + r * inp) + pack_dx
    } else {
        0
    };
    let later = we * (u64::from(tw) * out * inp + u64::from(tb) * out);
    let mut b = gc;
    if tw {
        b += acc * out * inp + r * inp;
    }
    if tb {
        b += acc * out;
    }
    dx_pass.saturating_sub(later).max(4 * b + pack_dw)
}

/// Workspace bytes (forward, backward) of one of the engine's linears on the spec's CPU: its own
/// buffers ([`fused_linear_scratch`]) and `gemm`'s per-call packing where its products go
/// through `gemm` (widened bf16/f16: [`widened_linear_packing`]; direct f32/f64:
/// [`direct_linear_packing`]); the AVX512-BF16 kernel packs into its own buffers only.
pub(crate) fn linear_workspace(
    cpu: &CpuSpec,
    cd: Dtype,
    (rows, inp, out): (u64, u64, u64),
    tracks: (bool, bool, bool),
    master: bool,
) -> (u64, u64) {
    let native = cpu.bf16_kernel();
    let (fwd, bwd) = fused_linear_scratch(cd, (rows, inp, out), tracks, native, master);
    match cd {
        Dtype::Bf16 if native => (fwd, bwd),
        Dtype::Bf16 | Dtype::F16 => {
            let (pf, pdx, pdw) =
                widened_linear_packing(cpu, (rows, inp, out), (tracks.0, tracks.1));
            let bwd = widened_bwd_passes(cd, (rows, inp, out), tracks, master, (pdx, pdw));
            (fwd + pf, bwd)
        }
        _ => {
            let (pf, pb) = direct_linear_packing(cpu, cd.size(), (rows, inp, out), tracks);
            (fwd + pf, bwd + pb)
        }
    }
}

/// On f32/f64 the engine's direct linear hands `gemm` a row-major destination, and `gemm` then
/// packs its operands into a heap buffer per call (about the size of W: 65,592 B around a 64 →
/// 256 f32 linear, 16,680 B around 64 → 64; see `kernels::gemm::mm_strided`): counted by
/// [`direct_linear_packing`] with the rule [`super::gemm_pack::call_heap_bytes`] (once a known
/// gap, which set the forward-phase peak of a recomputed block at small row counts).
///
/// `ops::linear` of the engine: `x·Wᵀ + b` as one node with a fresh (rows, out) output and
/// nothing saved beyond its inputs; its workspace is [`fused_linear_scratch`]. The gradients it
/// returns are those of the inputs that track. Its widened f32 buffers are laid out so that
/// `gemm` packs only where a chunk's rows miss the SIMD lanes ([`widened_linear_packing`], added
/// to the node's workspace). `cpu`: the spec's CPU (bf16 products on the AVX512-BF16 kernel per
/// `cpu.bf16_products`; `gemm`'s kernels per `cpu.gemm_isa`).
pub(crate) fn fused_linear(
    g: &mut Graph,
    name: &str,
    ins: [Nid; 3],
    (rows, inp, out): (u64, u64, u64),
    cpu: &CpuSpec,
) -> Nid {
    let cd = g.dtype(ins[0]);
    let wants = |i: Nid| g.nodes[i].tracks || g.nodes[i].sunk;
    let tracks = (wants(ins[0]), wants(ins[1]), wants(ins[2]));
    let master = g.dtype(ins[1]) == Dtype::F32 && matches!(cd, Dtype::Bf16 | Dtype::F16);
    let (fwd, bwd) = linear_workspace(cpu, cd, (rows, inp, out), tracks, master);
    let y = g.op(
        name,
        Kind::Custom { bwd_scratch: bwd },
        &ins,
        rows * out,
        cd,
    );
    g.nodes[y].fwd_scratch = fwd;
    y
}
