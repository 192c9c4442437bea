//! The rules of the engine's fused ops (twin: the engine's `ops/`, a file here per op file
//! there, and the workspace of its bf16 kernels in `kernels/gemm_bf16.rs` /
//! `ops/attention/bf16.rs`): each op as one node of a [`Graph`] with what it saves and the
//! workspace its forward and backward allocate. The sizes the engine allocates by are in
//! [`sizes`] (one function each, the engine calls them); each op's scratch formula is one
//! function beside its node ([`fused_linear_scratch`], [`fused_mlp_workspace`],
//! [`fused_mlp_side_workspace`], [`joint_linear_workspace`], [`native_attention_scratch`],
//! [`streaming_attention_scratch`]), which the engine does not restate: the agreement grid
//! (`ditmem agree`) holds them to the engine's measured peaks. This file keeps the small nodes.

mod attention;
mod fused_mlp;
mod fused_mlp_side;
mod joint_linear;
mod linear;
pub mod sizes;

pub(crate) use attention::attention_head_packing;
pub(crate) use attention::fused_attention;
pub(crate) use attention::fused_qkv_attention;
pub use attention::PROJECTED_ATTENTION_OP_BYTES;
pub use fused_mlp::{fused_mlp, FUSED_MLP_OP_BYTES};
pub use fused_mlp_side::{fused_mlp_side, FUSED_MLP_SIDE_OP_BYTES};
pub use joint_linear::joint_linear;
pub(crate) use linear::fused_linear;
pub(crate) use linear::linear_workspace;
pub use sizes::{
    attention_head_elems, bf16_dx_panel_cols, dw_blocks, dwconv_elems, dx_over_du_chunks,
    linear_attention_head_elems, mlp_col_blocks, norm_rope_bwd_elems, widen_col_blocks,
    ATTN_KEY_BLOCK, ATTN_QUERY_BLOCK, DW_COLS, DW_PANEL_SHARE, DW_ROWS, DX_FIRST_ROWS, LINEAR_ROWS,
    MLP_COLS, WIDEN_BLOCK_SHARE,
};

use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid};
use crate::spec::Dtype;

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
pub(crate) fn surrogate(g: &mut Graph, out: Nid) -> Nid {
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
