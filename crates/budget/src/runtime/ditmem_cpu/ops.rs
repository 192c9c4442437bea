//! The rules of the engine's fused ops (twin: the engine's `ops/`, and the workspace of its
//! bf16 kernels in `kernels/gemm_bf16.rs` / `ops/attention/bf16.rs`): each op as one node of a [`Graph`] with what
//! it saves and the workspace its forward and backward allocate. The engine's tests and benches
//! hold their measured workspaces against these functions.

use crate::runtime::ditmem_cpu::gemm_pack::{spec_call_heap_bytes, GemmCall};
use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid, STORAGE_META, TENSOR_META};
use crate::runtime::shape::Shape;
use crate::spec::{AttentionMode, CpuSpec, Dtype, Precision};

/// Rows per chunk of the engine's low-precision (bf16/f16) linear (`ops::LINEAR_ROWS`).
pub const LINEAR_ROWS: u64 = 128;
/// Columns of W per packed panel of the engine's bf16 kernel backward's dx product where the rows
/// fit one chunk (`ops::linear::bf16::DX_PANEL_COLS`: two of the kernel's 64-column panels; W
/// is packed whole over several chunks).
pub(crate) const BF16_DX_PANEL_COLS: u64 = 2 * BF16_KERNEL_TILE.1;

/// Rows per product of the engine's f32/f64 weight gradient (`ops::DW_ROWS`): `dW = Σ g_cᵀ·x_c`
/// over chunks of this many rows, so `gemm` packs at most a (256 × out) panel of g per call.
pub const DW_ROWS: u64 = 256;

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
pub fn col_blocks_under(ffn: u64, cap: u64) -> impl Iterator<Item = (u64, u64)> {
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
fn packed_a_bytes(m: u64, k: u64) -> u64 {
    4 * m.div_ceil(BF16_KERNEL_TILE.0) * BF16_KERNEL_TILE.0 * k.div_ceil(2)
}

/// Bytes of a packed bf16 B operand (k × n): whole tiles of columns × ⌈k/2⌉ pairs of u16.
fn packed_b_bytes(k: u64, n: u64) -> u64 {
    4 * n.div_ceil(BF16_KERNEL_TILE.1) * BF16_KERNEL_TILE.1 * k.div_ceil(2)
}

/// The rows of each chunk of `rows` the engine's chunked linears run through (`LINEAR_ROWS` a
/// chunk, the rest last): the full chunk and the remainder, if any.
fn chunk_rows(rows: u64) -> impl Iterator<Item = u64> {
    let r = LINEAR_ROWS.min(rows);
    [r, rows % r.max(1)].into_iter().filter(|&n| n > 0)
}

/// `gemm`'s per-call heap bytes for one product on the spec's CPU: elements of `elem` bytes on
/// `threads` (1: `Parallelism::None`), strides of `[dst, lhs, rhs]` as (row, column).
fn gemm_call_bytes(
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
pub fn fused_linear_scratch(
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
                // dx by panels of W when the rows fit one chunk, else W whole
                // (`linear::bf16::dx_panel_cols`).
                let pc = if rows <= LINEAR_ROWS {
                    BF16_DX_PANEL_COLS.min(inp)
                } else {
                    inp
                };
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
pub fn linear_workspace(
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
pub fn fused_linear(
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
pub fn fused_mlp_scratch(
    (cd, wd): (Dtype, Dtype),
    dims: (u64, u64, u64, u64),
    (tx, wants): (bool, [bool; 4]),
    native: bool,
    master: bool,
) -> (u64, u64) {
    let lin = |dims, t| fused_linear_scratch(cd, dims, t, native, master);
    fused_mlp_phases(
        (lin, |_, _| 0),
        (cd, wd),
        dims,
        (tx, wants),
        (native, master),
    )
}

/// [`fused_mlp_scratch`] with `gemm`'s per-call packing in each phase ([`linear_workspace`] for
/// each of the four products): the node's workspace on the spec's CPU.
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
fn fc2_gelu_blocks(
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
    let y = g.op(
        name,
        Kind::Custom { bwd_scratch: bwd },
        &[x, ws[0], ws[1], ws[2], ws[3]],
        rows * out,
        cd,
    );
    if g.nodes[y].tracks {
        g.nodes[y].extra = rows * ffn * cd.size() + FUSED_MLP_OP_BYTES;
        g.nodes[y].released_by_bwd = rows * ffn * cd.size();
    }
    g.nodes[y].fwd_scratch = fwd;
    y
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

/// f32 and compute-dtype element counts of the workspace of the engine's widened backward of
/// fc2 and the GELU (`fused_mlp_widen::fc2_gelu_widen_workspace`) for `(rows, ds, ffn, out)`:
/// g's chunk of [`LINEAR_ROWS`] rows column-major, W2ᵀ in f32, one f32 block of the side's
/// columns and the widest of u's ([`widen_col_blocks`]); a block of u's in the compute dtype.
pub fn fc2_gelu_widen_workspace((rows, ds, ffn, out): (u64, u64, u64, u64)) -> (u64, u64) {
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
fn widen_phase(
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
pub fn fused_mlp_side_scratch(
    (cd, wd): (Dtype, Dtype),
    dims: (u64, u64, u64, u64, u64),
    (tx, ts, wants): (bool, bool, [bool; 4]),
    native: bool,
    master: bool,
) -> (u64, u64) {
    let lin = |dims, t| fused_linear_scratch(cd, dims, t, native, master);
    fused_mlp_side_phases(
        (lin, |_, _| 0),
        (cd, wd),
        dims,
        (tx, ts, wants),
        (native, master),
    )
}

/// [`fused_mlp_side_scratch`] with `gemm`'s per-call packing in each phase
/// ([`linear_workspace`] for each of its linear calls): the node's workspace on the spec's CPU.
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
    let y = g.op(
        name,
        Kind::Custom { bwd_scratch: bwd },
        &[x, side, ws[0], ws[1], ws[2], ws[3]],
        rows * out,
        cd,
    );
    if g.nodes[y].tracks {
        g.nodes[y].extra = rows * ffn * cd.size() + FUSED_MLP_SIDE_OP_BYTES;
        g.nodes[y].released_by_bwd = rows * ffn * cd.size();
    }
    g.nodes[y].fwd_scratch = fwd;
    y
}

/// Workspace bytes (forward, backward) of the engine's joint linear
/// (`ops::joint_linear_*_scratch`) in compute dtype `cd`, weight gradients in `wd`, for
/// `(ra, rc, inp, out)`, da when `ta`, dc when `tc`, the weight gradients `wants` = (dWa, dba,
/// dWc, dbc). Forward, beyond the output: la's workspace less the output; ya with lc's
/// workspace less the output; ya and yc while joined (the output's size). Backward, beyond the
/// gradients it hands out: a's part of the gradient with la's backward and its gradients; c's
/// part with lc's backward beside every gradient.
pub fn joint_linear_scratch(
    (cd, wd): (Dtype, Dtype),
    dims: (u64, u64, u64, u64),
    (ta, tc, wants): (bool, bool, [bool; 4]),
    native: bool,
    master: bool,
) -> (u64, u64) {
    let lin = |dims, t| fused_linear_scratch(cd, dims, t, native, master);
    joint_linear_phases(lin, (cd, wd), dims, (ta, tc, wants))
}

/// [`joint_linear_scratch`] with `gemm`'s per-call packing in each phase
/// ([`linear_workspace`]): the node's workspace on the spec's CPU.
pub(crate) fn joint_linear_workspace(
    cpu: &CpuSpec,
    (cd, wd): (Dtype, Dtype),
    dims: (u64, u64, u64, u64),
    (ta, tc, wants): (bool, bool, [bool; 4]),
    master: bool,
) -> (u64, u64) {
    let lin = |dims, t| linear_workspace(cpu, cd, dims, t, master);
    joint_linear_phases(lin, (cd, wd), dims, (ta, tc, wants))
}

/// The joint linear's phases over the workspace `lin(dims, tracks)` of each linear call.
fn joint_linear_phases(
    lin: impl Fn((u64, u64, u64), (bool, bool, bool)) -> (u64, u64),
    (cd, wd): (Dtype, Dtype),
    (ra, rc, inp, out): (u64, u64, u64, u64),
    (ta, tc, wants): (bool, bool, [bool; 4]),
) -> (u64, u64) {
    let (e, we) = (cd.size(), wd.size());
    let (ya, y) = (e * ra * out, e * (ra + rc) * out);
    let on = |b: bool, n: u64| if b { we * n } else { 0 };
    let dx = |t: bool, r: u64| if t { e * r * inp } else { 0 };
    let ga = dx(ta, ra) + on(wants[0], out * inp) + on(wants[1], out);
    let gc = dx(tc, rc) + on(wants[2], out * inp) + on(wants[3], out);
    let (fa, ba) = lin((ra, inp, out), (ta, wants[0], wants[1]));
    let (fc, bc) = lin((rc, inp, out), (tc, wants[2], wants[3]));
    let fwd = fa.saturating_sub(y).max((ya + fc).saturating_sub(y)).max(y);
    let pa = e * ra * out + ba + ga;
    let pc = ga + e * rc * out + bc + gc;
    (fwd, pa.max(pc) - ga - gc)
}

/// `ops::joint_linear` of the engine: `[la(a); lc(c)]` per sample as one node on a and c (the
/// weights `ws` = [Wa, ba, Wc, bc] are its other inputs here, sunk or frozen). A fresh
/// (ra + rc, out) output; nothing kept (its boxed op only, as every fused node's). Workspace:
/// [`joint_linear_workspace`]. Its backward returns da and dc only.
pub fn joint_linear(
    g: &mut Graph,
    name: &str,
    [a, c]: [Nid; 2],
    ws: [Nid; 4],
    (ra, rc, inp, out): (u64, u64, u64, u64),
    cpu: &CpuSpec,
) -> Nid {
    let (cd, wd) = (g.dtype(a), g.dtype(ws[0]));
    let wants = ws.map(|i| g.nodes[i].sunk);
    let (ta, tc) = (g.nodes[a].tracks, g.nodes[c].tracks);
    let master = wd == Dtype::F32 && matches!(cd, Dtype::Bf16 | Dtype::F16);
    let (fwd, bwd) =
        joint_linear_workspace(cpu, (cd, wd), (ra, rc, inp, out), (ta, tc, wants), master);
    let y = g.op(
        name,
        Kind::Custom { bwd_scratch: bwd },
        &[a, c, ws[0], ws[1], ws[2], ws[3]],
        (ra + rc) * out,
        cd,
    );
    g.nodes[y].fwd_scratch = fwd;
    y
}

/// `ops::ln_modulate` of the engine: LayerNorm fused with the adaLN modulation, written in the
/// compute dtype. One fresh output; the op keeps (mean, rstd) per row in the accumulation type
/// (f64 under fp64, else f32) beside it. Its inputs are x and the shift/scale chunks themselves.
pub fn ln_modulate(
    g: &mut Graph,
    name: &str,
    x: Nid,
    shift: Nid,
    scale: Nid,
    rows: u64,
    out: Dtype,
) -> Nid {
    let acc = if g.dtype(x) == Dtype::F64 { 8 } else { 4 };
    let e = g.elems(x);
    let y = g.op(
        name,
        Kind::Custom { bwd_scratch: 0 },
        &[x, shift, scale],
        e,
        out,
    );
    g.nodes[y].extra = 2 * rows * acc;
    y
}

/// `ops::gelu_tanh` of the engine: one fresh output, saves nothing beyond its input.
pub fn gelu(g: &mut Graph, name: &str, x: Nid) -> Nid {
    let (e, dt) = (g.elems(x), g.dtype(x));
    g.op(name, Kind::Custom { bwd_scratch: 0 }, &[x], e, dt)
}

/// `ops::gated_residual` of the engine: `x + y·gate` as one fresh node in x's dtype, reading y
/// in the compute dtype; saves nothing beyond its inputs. Its backward hands the output
/// gradient itself on as dx.
pub fn gated_residual(g: &mut Graph, name: &str, x: Nid, y: Nid, gate: Nid) -> Nid {
    let (e, dt) = (g.elems(x), g.dtype(x));
    let o = g.op(name, Kind::Custom { bwd_scratch: 0 }, &[x, y, gate], e, dt);
    g.nodes[o].grad_is_output_grad = Some(0);
    o
}

/// Keys per block of the engine's streaming attention kernel (`ops::ATTN_KEY_BLOCK`).
pub(crate) const FUSED_ATTN_KEY_BLOCK: u64 = 128;

/// Queries per block of the backward of the engine's generic streaming attention kernels
/// (`ops::ATTN_QUERY_BLOCK`): P and dP of a block are this × [`FUSED_ATTN_KEY_BLOCK`].
pub const FUSED_ATTN_QUERY_BLOCK: u64 = 64;

/// Bytes of one thread's scratch (forward, backward) of the engine's streaming bf16 attention on
/// the AVX512-BF16 kernel with key blocks of `kb` (`ops::attention::bf16::streaming_scratch_bytes`).
/// Forward: f32 output accumulator, a block of scores, row max and sum; packed q, a packed block
/// of P, a packed B (a block of kᵀ or v). Backward, by blocks of [`NATIVE_ATTN_BWD_ROWS`]
/// queries: f32 dq, dk, dv, blocks of P and dP, the row deltas; the query block's packed q and
/// dO, a packed A of a block (Pᵀ, dS or dSᵀ), a packed B (a block of kᵀ, vᵀ or k, or the query
/// block's dO or q).
pub fn streaming_attention_scratch(s: u64, dh: u64, kb: u64) -> (u64, u64) {
    let b_fwd = packed_b_bytes(dh, kb).max(packed_b_bytes(kb, dh));
    let qb = NATIVE_ATTN_BWD_ROWS.min(s);
    let a_qd = packed_a_bytes(qb, dh);
    let a_blk = packed_a_bytes(qb, kb).max(packed_a_bytes(kb, qb));
    let b_bwd = b_fwd.max(packed_b_bytes(qb, dh));
    (
        4 * (s * dh + s * kb + 2 * s) + packed_a_bytes(s, dh) + packed_a_bytes(s, kb) + b_fwd,
        4 * (3 * s * dh + 2 * qb * kb + s) + 2 * a_qd + a_blk + b_bwd,
    )
}

/// Query rows per block of the backward of the engine's bf16 attention on the AVX512-BF16
/// kernel (`ops::attention::bf16::NATIVE_BWD_ROWS`): P and dP of a block are this × s.
pub const NATIVE_ATTN_BWD_ROWS: u64 = 128;

/// Bytes of one thread's scratch (forward, backward) of the engine's bf16 attention on the
/// AVX512-BF16 kernel (`ops::attention::bf16::native_scratch_bytes`): f32 buffers (forward the
/// head's output and S; backward dq, dk, dv, and P and dP of a block of
/// [`NATIVE_ATTN_BWD_ROWS`] query rows) and the packed operands of every product (forward: A
/// up to s × max(s, d_h), B d_h × s or s × d_h; backward, of a block of m rows: A m × d_h,
/// m × s or s × m, B d_h × s, s × d_h or m × d_h).
pub fn native_attention_scratch(s: u64, dh: u64) -> (u64, u64) {
    let packed = packed_a_bytes(s, s.max(dh)) + packed_b_bytes(dh, s).max(packed_b_bytes(s, dh));
    let m = NATIVE_ATTN_BWD_ROWS.min(s);
    let packed_bwd = packed_a_bytes(m, dh)
        .max(packed_a_bytes(m, s))
        .max(packed_a_bytes(s, m))
        + packed_b_bytes(dh, s)
            .max(packed_b_bytes(s, dh))
            .max(packed_b_bytes(m, dh));
    (
        4 * (s * dh + s * s) + packed,
        4 * (3 * s * dh + 2 * m * s) + packed_bwd,
    )
}

/// `gemm`'s per-call packing bytes (forward, backward) of one head of the engine's generic
/// attention kernels (`ops/attention/{generic,separate}.rs`, `sq` queries over `sk` keys, head
/// width `dh`, accumulation elements of `elem` bytes, single-threaded calls), the most of any of
/// its products: per key block of `n` keys (all `sk` at once when `kb` is None, else blocks of
/// `kb` and the rest) the scores `S = q·kᵀ` (and `dP = dO·vᵀ`), `O = P·v` (and `dq = dS·k`), and
/// in backward `dv = Pᵀ·dO` (and `dk = dSᵀ·q`), the streaming backward's by blocks of
/// [`FUSED_ATTN_QUERY_BLOCK`] queries. q·kᵀ reads k transposed, so `gemm` pre-packs it on every
/// ISA.
pub(crate) fn attention_head_packing(
    cpu: &CpuSpec,
    (sq, sk, dh): (u64, u64, u64),
    kb: Option<u64>,
    elem: u64,
) -> (u64, u64) {
    let mm = |m: u64, n: u64, k: u64, dst, lhs, rhs| {
        gemm_call_bytes(cpu, (elem, 1), (m, n, k), [dst, lhs, rhs])
    };
    let split = |s: u64, b: u64| {
        if b > 0 && b < s {
            vec![b, s % b]
        } else {
            vec![s]
        }
    };
    let blocks = split(sk, kb.unwrap_or(sk));
    // The streaming backward also blocks the queries (`ops::ATTN_QUERY_BLOCK`).
    let q_blocks = match kb {
        Some(_) => split(sq, FUSED_ATTN_QUERY_BLOCK),
        None => vec![sq],
    };
    let (mut fwd, mut bwd) = (0, 0);
    for n in blocks.into_iter().filter(|&n| n > 0) {
        let scores = mm(sq, n, dh, (n, 1), (dh, 1), (1, dh));
        let out = mm(sq, dh, n, (dh, 1), (n, 1), (dh, 1));
        fwd = fwd.max(scores).max(out);
        for &m in q_blocks.iter().filter(|&&m| m > 0) {
            let scores = mm(m, n, dh, (n, 1), (dh, 1), (1, dh));
            let dq = mm(m, dh, n, (dh, 1), (n, 1), (dh, 1));
            let grad_kv = mm(n, dh, m, (dh, 1), (1, n), (dh, 1));
            bwd = bwd.max(scores).max(dq).max(grad_kv);
        }
    }
    (fwd, bwd)
}

/// `ops::qkv_attention` of the engine: attention read in place from the (b·s, 3D) qkv
/// projection, written as (b·s, D). One fresh output. What it keeps (the node's `extra`): P
/// (b·a·s², compute dtype) when materialized, the log-sum-exp (b·a·s, accumulation type) when
/// memory-efficient, nothing under attention-only recompute. Forward and backward work on one
/// scratch of accumulation-type buffers per thread (at most one thread per head), allocated up
/// front; the backward returns one fresh (b·s, 3D) gradient.
pub fn fused_attention(g: &mut Graph, sh: &Shape, qkv: Nid) -> Nid {
    let (name, extra, fwd, bwd) = attention_workspace(sh);
    let o = g.op(
        name,
        Kind::Custom { bwd_scratch: bwd },
        &[qkv],
        sh.e(),
        sh.cd(),
    );
    g.nodes[o].extra = extra;
    g.nodes[o].fwd_scratch = fwd;
    o
}

/// The fused attention's name, what it keeps (P or the log-sum-exp, bytes) and its forward and
/// backward workspace (all threads' scratch, with `gemm`'s per-call packing), as
/// [`fused_attention`] and [`fused_qkv_attention`] count them.
fn attention_workspace(sh: &Shape) -> (&'static str, u64, u64, u64) {
    let cd = sh.cd();
    let acc = if sh.precision == Precision::Fp64 {
        8
    } else {
        4
    };
    let (s, dh) = (sh.s, sh.d / sh.heads);
    let nh = sh.b * sh.heads;
    let kb = FUSED_ATTN_KEY_BLOCK.min(s);
    let nt = u64::from(sh.cpu.threads).clamp(1, nh.max(1));
    // Elements per head: see `ops::AttnGeom::{fwd_scratch, bwd_scratch}`.
    // bf16 runs on the AVX512-BF16 kernel where the CPU has it (`ops::attention::bf16::applies`), in every
    // mode: its own scratch, in bytes.
    let native = cd == Dtype::Bf16 && sh.cpu.bf16_kernel();
    let (name, extra, fwd, bwd) = if sh.attention == AttentionMode::MemoryEfficient {
        (
            "attention (fused, streaming; keeps lse)",
            nh * s * acc,
            4 * s * dh + s * kb + 2 * s,
            7 * s * dh + 2 * FUSED_ATTN_QUERY_BLOCK.min(s) * kb + s,
        )
    } else if sh.attention_only {
        (
            "attention (fused; P recomputed in backward)",
            0,
            4 * s * dh + s * s,
            7 * s * dh + 2 * s * s,
        )
    } else {
        (
            "attention (fused; keeps P)",
            nh * s * s * cd.size(),
            4 * s * dh + s * s,
            7 * s * dh + 2 * s * s,
        )
    };
    let (fwd_bytes, bwd_bytes) = if native && sh.attention == AttentionMode::MemoryEfficient {
        streaming_attention_scratch(s, dh, kb)
    } else if native {
        native_attention_scratch(s, dh)
    } else {
        let kb = (sh.attention == AttentionMode::MemoryEfficient).then_some(kb);
        let (pf, pb) = attention_head_packing(&sh.cpu, (s, s, dh), kb, acc);
        (fwd * acc + pf, bwd * acc + pb)
    };
    (name, extra, nt * fwd_bytes, nt * bwd_bytes)
}

/// Heap bytes of an `ops::ProjectedAttention` node's op beside the buffers it keeps: candle's
/// `Arc<Box<dyn CustomOp1>>` (32) and the op (the attention's settings and saved state, the
/// projection's weight, bias and sink handles, the mutex over qkv: `size_of`, held equal by the
/// engine's test).
pub const PROJECTED_ATTENTION_OP_BYTES: u64 = 32 + 152;

/// `ops::projected_attention` of the engine: the qkv projection `x·Wᵀ + b` and the fused
/// attention as one node on x (rows, D), written as (rows, D), used where x tracks and the
/// projection has no LoRA. The op keeps qkv (rows, 3D, compute dtype, a bare buffer) beside
/// what the attention keeps; its backward makes dqkv (bare: over qkv's own buffer on the
/// generic kernels, fresh with qkv freed once it is made on the AVX512-BF16 ones; the node's
/// `released_by_bwd` is qkv), makes dx, dW, db from dqkv (the weights sunk or frozen), frees dqkv
/// and returns dx only: dqkv never enters candle's store, where
/// its `zeros_like` + `add` held three qkv-sized buffers at once, and the projection's own
/// node (dqkv handed in, dx made beside it) is gone. Workspace, beyond the output and what is
/// kept: forward, the projection's less what the node's output and kept state already count,
/// or the attention's; backward, beyond the gradients it hands out, dqkv (and on the bf16
/// kernels qkv) with the attention's scratch, or dqkv with the projection's.
pub fn fused_qkv_attention(g: &mut Graph, sh: &Shape, x: Nid, wb: [Nid; 2]) -> Nid {
    let cd = sh.cd();
    let (rows, d) = (sh.b * sh.s, sh.d);
    let (name, attn_extra, attn_fwd, attn_bwd) = attention_workspace(sh);
    let wants = |i: Nid| g.nodes[i].tracks || g.nodes[i].sunk;
    let tracks = (true, wants(wb[0]), wants(wb[1]));
    let master = g.dtype(wb[0]) == Dtype::F32 && matches!(cd, Dtype::Bf16 | Dtype::F16);
    let (lin_fwd, lin_bwd) = linear_workspace(&sh.cpu, cd, (rows, d, 3 * d), tracks, master);
    let qkv = rows * 3 * d * cd.size();
    let meta = TENSOR_META + STORAGE_META;
    let grads = rows * d * cd.size()
        + meta
        + if tracks.1 {
            3 * d * d * g.dtype(wb[0]).size() + meta
        } else {
            0
        }
        + if tracks.2 {
            3 * d * g.dtype(wb[1]).size() + meta
        } else {
            0
        };
    // The node releases the kept qkv as its backward starts (`Node::released_by_bwd`), so it
    // is counted here. On the generic kernels the op writes dqkv over qkv's own buffer: one
    // qkv-sized buffer beside the attention's scratch, then beside the projection's products.
    // On the AVX512-BF16 kernels (which read q, k, v in place) dqkv is fresh: qkv and dqkv
    // beside the attention's scratch, then dqkv alone, qkv freed once it is made.
    let native = cd == Dtype::Bf16 && sh.cpu.bf16_kernel();
    let during = if native { 2 * qkv } else { qkv };
    // The output gradient (rows × D, alive beside the whole backward in `custom_backward`) is
    // freed once dqkv is made: the projection's products no longer read it.
    let bwd = (during + attn_bwd)
        .saturating_sub(grads)
        .max((qkv + lin_bwd).saturating_sub(sh.e() * cd.size()));
    let o = g.op(
        &format!("attn.qkv + {name}"),
        Kind::Custom { bwd_scratch: bwd },
        &[x, wb[0], wb[1]],
        sh.e(),
        cd,
    );
    g.nodes[o].extra = attn_extra + qkv + PROJECTED_ATTENTION_OP_BYTES;
    if g.nodes[o].tracks {
        g.nodes[o].released_by_bwd = qkv;
    }
    let out = g.nodes[o].footprint();
    let kept = attn_extra + PROJECTED_ATTENTION_OP_BYTES;
    g.nodes[o].fwd_scratch = attn_fwd.max(lin_fwd.saturating_sub(out + kept));
    o
}

/// The root the engine backpropagates a block from (`ops::backward_from(out, grad_out)`),
/// appended to a graph: returns the root.
pub fn seed(g: &mut Graph, out: Nid) -> Nid {
    let (e, dt) = (g.elems(out), g.dtype(out));
    let go = g.constant("grad_out", e, dt, false);
    g.op("grad seed", Kind::Seed, &[out, go], 1, dt)
}

/// The root `ops::backward_from_many` of the engine backpropagates several outputs from, appended
/// to a graph: one [`seed`] per output, each cast to f64 (a one-element copy unless f64) and
/// their sum the root; one output is `backward_from`'s single seed. Returns the root (`None`
/// without outputs).
pub fn seeds(g: &mut Graph, outs: &[Nid]) -> Option<Nid> {
    if let [o] = outs {
        return Some(seed(g, *o));
    }
    let mut root: Option<Nid> = None;
    for &o in outs {
        let s = seed(g, o);
        let s = g.cast("seed→f64", s, Dtype::F64);
        root = Some(match root {
            None => s,
            Some(r) => g.op("seed sum", Kind::Add, &[r, s], 1, Dtype::F64),
        });
    }
    root
}

/// The composed root `sum(out · grad_out)` appended to a graph (the composed attention core
/// still backpropagates from it): returns the root.
pub fn surrogate(g: &mut Graph, out: Nid) -> Nid {
    let (e, dt) = (g.elems(out), g.dtype(out));
    let go = g.constant("grad_out", e, dt, false);
    let m = g.op("out·grad_out", Kind::Mul, &[out, go], e, dt);
    g.op("sum", Kind::Sum, &[m], 1, dt)
}

/// Elements per partial sum of the engine's gradient norm (`ops::SQUARES_CHUNK`).
pub const SQUARES_CHUNK: u64 = 1 << 16;

/// Heap bytes of a tracked `ops::RmsNorm` node's op beside its output: candle's
/// `Arc<Box<dyn CustomOp2>>` (32) and the op (its dtype, eps and the mutex over the kept rstd:
/// 56); measured by the engine's `tests/wan.rs`.
pub const RMS_NORM_OP_BYTES: u64 = 88;
/// Heap bytes of a tracked `ops::Rope` node's op: the `Arc<Box<dyn CustomOp1>>` (32) and the op
/// (its two table handles: 16).
pub const ROPE_OP_BYTES: u64 = 48;

/// `ops::rms_norm` of the engine: RMSNorm over the last dimension written in `out`, one fresh
/// output of x's size; the op keeps one rstd per row in the accumulation type (f64 for f64
/// x, else f32) beside it, and a tracked node its boxed op ([`RMS_NORM_OP_BYTES`]). Inputs: x
/// and the weight (whose fresh gradient the backward returns when it tracks).
pub fn rms_norm(g: &mut Graph, name: &str, x: Nid, w: Nid, rows: u64, out: Dtype) -> Nid {
    let acc = if g.dtype(x) == Dtype::F64 { 8 } else { 4 };
    let e = g.elems(x);
    let y = g.op(name, Kind::Custom { bwd_scratch: 0 }, &[x, w], e, out);
    let op = if g.nodes[y].tracks {
        RMS_NORM_OP_BYTES
    } else {
        0
    };
    g.nodes[y].extra = rows * acc + op;
    y
}

/// `ops::rope` of the engine: one fresh output in x's dtype and size; it keeps nothing but its
/// boxed op when tracked ([`ROPE_OP_BYTES`]; the cos/sin tables are constants the caller
/// holds, not inputs of the node), and its backward makes one fresh dx.
pub fn rope(g: &mut Graph, name: &str, x: Nid) -> Nid {
    let (e, dt) = (g.elems(x), g.dtype(x));
    let y = g.op(name, Kind::Custom { bwd_scratch: 0 }, &[x], e, dt);
    if g.nodes[y].tracks {
        g.nodes[y].extra = ROPE_OP_BYTES;
    }
    y
}

/// `ops::tokens::concat` (and `cat_tokens`): one fresh output; the backward one fresh part per
/// tracked input; keeps nothing.
pub fn concat(g: &mut Graph, name: &str, a: Nid, b: Nid) -> Nid {
    let (e, dt) = (g.elems(a) + g.elems(b), g.dtype(a));
    g.op(name, Kind::Custom { bwd_scratch: 0 }, &[a, b], e, dt)
}

/// `ops::tokens::slice` (and `split_tokens`): one fresh output of `elems`; the backward one
/// fresh x-sized gradient (zero outside the part).
pub fn slice(g: &mut Graph, name: &str, x: Nid, elems: u64) -> Nid {
    let dt = g.dtype(x);
    g.op(name, Kind::Custom { bwd_scratch: 0 }, &[x], elems, dt)
}
