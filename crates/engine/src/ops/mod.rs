//! Fused operations with their own backward, as candle custom ops.
//!
//! Candle's autograd keeps every node of a composed op alive, and its backward rules build each
//! gradient from tracked forward tensors, so a composed GELU or LayerNorm leaves a chain of
//! token-sized temporaries in the gradient store. The ops here keep only what their backward
//! needs and return fresh, untracked gradients computed by plain loops, so nothing chains:
//!
//! - [`gelu`]: [`gelu_tanh`], GELU with the tanh approximation, saving its input only.
//! - [`ln_modulate`](mod@ln_modulate): LayerNorm + adaLN modulation written in the compute
//!   dtype, keeping the per-row (mean, rstd).
//! - [`linear`](mod@linear): `x·Wᵀ + b` as one node ([`LinearOp`]) on `gemm` (f32/f64), the
//!   AVX512-BF16 kernel or widened chunks; [`linear_sunk`] / [`GradSink`] hand dW, db to the
//!   trainer instead of candle's store (no `zeros_like` + `add` per weight).
//! - [`attention`]: [`qkv_attention`], attention read in place from the qkv projection, keeping
//!   P, nothing or the log-sum-exp; with the composed reference [`attention_materialized`].
//! - [`rms_norm`](mod@rms_norm): RMSNorm over the last dimension with an optional weight,
//!   keeping one rstd per row (q/k norms).
//! - [`rope`](mod@rope): rotary embedding of interleaved pairs by (s, d_h/2) tables, keeping
//!   nothing.
//! - [`gated_residual`](mod@gated_residual): the adaLN-Zero residual `x + y·gate`.
//! - [`backward_from`](mod@backward_from): backpropagation from a segment's output with its
//!   known gradient (no composed `sum(out · grad)` root).
//! - [`sum_squares`](mod@sum_squares): the gradient norm without a squared copy.
//! - `storage`: the CPU storage helpers and dtype dispatch the ops share.
//!
//! Every kernel is a free function over slices (here or in [`crate::kernels`]) called from
//! `cpu_fwd` / `bwd`.
//!
//! Allocation rules the budget mirrors (`ditmem_budget::ditmem_cpu::graph::Kind::Custom`, the twin of each
//! op named in its module): the forward allocates its output, what the op saves, and a workspace
//! freed before it returns; the backward allocates one fresh gradient per input that tracks, in
//! the input's dtype and shape, beside a workspace freed before it returns. The workspace sizes
//! are public functions here ([`AttnGeom::fwd_scratch`], [`linear_bwd_scratch`], …) and are
//! restated in the budget.

pub mod attention;
pub mod backward_from;
pub mod gated_residual;
pub mod gelu;
pub mod linear;
pub mod ln_modulate;
pub mod rms_norm;
pub mod rope;
pub(crate) mod storage;
pub mod sum_squares;

pub use attention::{
    attention_materialized, attn_threads, dropout_mask, qkv_attention, AttnGeom, AttnKeep, Dropout,
    QkvAttention, ATTN_KEY_BLOCK,
};
pub use backward_from::{backward_from, backward_from_many};
pub use gated_residual::{gated_residual, GatedResidual};
pub use gelu::{gelu_tanh, GeluTanh};
pub use linear::{
    linear, linear_bwd_scratch, linear_fwd_scratch, linear_sunk, GradSink, LinearGrads, LinearOp,
    LINEAR_ROWS,
};
pub use ln_modulate::{ln_modulate, LnGeom, LnModulate};
pub use rms_norm::{rms_norm, RmsNorm};
pub use rope::{rope, Rope};
pub use sum_squares::{sum_squares, SQUARES_CHUNK};
