//! Fused operations with their own backward, as candle custom ops.
//!
//! Candle's autograd keeps every node of a composed op alive, and its backward rules build each
//! gradient from tracked forward tensors, so a composed GELU or LayerNorm leaves a chain of
//! token-sized temporaries in the gradient store. The ops here keep only what their backward
//! needs and return fresh, untracked gradients computed by plain loops, so nothing chains:
//!
//! - [`gelu`]: [`gelu_tanh`], GELU with the tanh approximation, saving its input only.
//! - [`fused_mlp`](mod@fused_mlp): the feed-forward `fc2(gelu_tanh(fc1(x)))` as one node,
//!   keeping the fc1 output only, its backward one wide buffer and the weight gradients sunk;
//!   [`fused_mlp_bf16`](mod@fused_mlp_bf16) is its fc2 + GELU backward on the AVX512-BF16
//!   kernel, by chunks of rows.
//! - [`fused_mlp_side`](mod@fused_mlp_side): `fc2([side; gelu_tanh(fc1(x))])` as one node
//!   (Flux's single-stream MLP and `proj_out` on the attention beside it), keeping fc1's
//!   output only and handing candle dx and dside alone.
//! - [`joint_linear`](mod@joint_linear): two linears on two token streams written as one
//!   per-sample concatenation (SD3's joint q, k, v), keeping neither projection.
//! - [`ln_modulate`](mod@ln_modulate): LayerNorm + adaLN modulation written in the compute
//!   dtype, keeping the per-row (mean, rstd).
//! - [`linear`](mod@linear): `x·Wᵀ + b` as one node ([`LinearOp`]) on `gemm` (f32/f64), the
//!   AVX512-BF16 kernel or widened chunks; [`linear_sunk`] / [`GradSink`] hand dW, db to the
//!   trainer instead of candle's store (no `zeros_like` + `add` per weight).
//! - [`attention`]: [`qkv_attention`], attention read in place from the qkv projection, keeping
//!   P, nothing or the log-sum-exp; with the composed reference [`attention_materialized`].
//! - [`rms_norm`](mod@rms_norm): the per-head q/k RMSNorm of SD3.5 and Flux (and Sana's
//!   caption norm, one head as wide as the row), keeping nothing for backward.
//! - [`rms_norm_rows`](mod@rms_norm_rows): RMSNorm over the last dimension with an optional
//!   weight and an output dtype, keeping one rstd per row (Wan's q/k norms).
//! - [`rope_cos_sin`](mod@rope_cos_sin): rotary embedding of interleaved pairs by (s, d_h/2)
//!   cos/sin tables (Wan), keeping nothing.
//! - [`gated_residual`](mod@gated_residual): the adaLN-Zero residual `x + y·gate`.
//! - Sana's ops: [`linear_attention`](mod@linear_attention) (ReLU linear attention over
//!   separate q, k, v), [`dwconv`] (SiLU + depthwise 3×3 conv on the token grid), [`glu`] (the
//!   Mix-FFN gate), [`mix_ffn`](mod@mix_ffn) (the whole Mix-FFN as one node, keeping
//!   `conv_inverted`'s output only), [`rms_norm`](mod@rms_norm) (RMSNorm with a weight).
//! - [`backward_from`](mod@backward_from): backpropagation from a segment's output with its
//!   known gradient (no composed `sum(out · grad)` root).
//! - [`sum_squares`](mod@sum_squares): the gradient norm without a squared copy.
//! - [`rms_norm`](mod@rms_norm): Flux's per-head q/k RMSNorm, keeping nothing.
//! - [`rope`](mod@rope): Flux's rotary embedding over shared cos/sin tables.
//! - [`norm_rope`](mod@norm_rope): Flux's q/k RMSNorm and RoPE as one node (the double-stream
//!   block's on the joint [text; image] projection with both streams' weights), keeping nothing.
//! - [`tokens`]: per-sample concatenation and slicing (the joint sequences of SD3 and Flux;
//!   [`cat_tokens`] / [`split_tokens`] on (b·tokens, D) rows).
//! - [`mse_loss`](mod@mse_loss): the diffusion loss as one node keeping pred − target only, its
//!   gradient made in place.
//! - [`release`](mod@release): frees the buffer of a tensor the graph holds but no backward
//!   reads (a branch output under a frozen gate, a frozen linear's input), keeping its node.
//! - `storage`: the CPU storage helpers and dtype dispatch the ops share; `custom_op`: the
//!   two- and three-input ops' interface (`CpuOp`: the forward over an array of CPU storages,
//!   the backward over the tensors) and its adapter to candle's `CustomOp2` / `CustomOp3`.
//!
//! Every kernel is a free function over slices (here or in [`crate::kernels`]) called from
//! an op's `fwd` / `bwd` (`cpu_fwd` / `bwd` for the one-input ops, candle's `CustomOp1`).
//!
//! Allocation rules the budget mirrors (`ditmem_budget::ditmem_cpu::graph::Kind::Custom`, the twin of each
//! op named in its module): the forward allocates its output, what the op saves, and a workspace
//! freed before it returns; the backward allocates one fresh gradient per input that tracks, in
//! the input's dtype and shape, beside a workspace freed before it returns. The chunk and block
//! sizes the linear and the fused MLPs allocate by, and their workspace formulas, are stated
//! once, in the budget (`ditmem_budget::ditmem_cpu::ops`, its `sizes` module: this crate calls
//! them), as are the attention kernels', the linear attention's and the depthwise conv's
//! per-head or per-call element counts (`attention_head_elems`, `linear_attention_head_elems`,
//! `dwconv_elems`, which [`AttnGeom::fwd_scratch`], … call).

pub mod attention;
pub mod backward_from;
pub(crate) mod custom_op;
pub mod dwconv;
pub mod fused_mlp;
pub mod fused_mlp_bf16;
pub mod fused_mlp_dx;
pub mod fused_mlp_side;
pub mod fused_mlp_widen;
pub mod gated_residual;
pub mod gelu;
pub mod glu;
pub mod joint_linear;
pub mod linear;
pub mod linear_attention;
pub mod ln_modulate;
pub mod lora_linear;
pub mod mix_ffn;
mod mlp_linear;
pub mod mse_loss;
pub mod norm_rope;
pub mod release;
pub mod rms_norm;
pub mod rms_norm_rows;
pub mod rope;
pub mod rope_cos_sin;
pub(crate) mod storage;
pub mod sum_squares;
#[cfg(test)]
pub(crate) mod test_values;
pub mod tokens;

pub(crate) use attention::projected_attention;
pub use attention::{
    attention_materialized, cross_attention, qkv_attention, AttnGeom, AttnKeep, Dropout,
    ATTN_KEY_BLOCK,
};

pub(crate) use attention::dropout_mask;
pub use backward_from::backward_from;
pub(crate) use backward_from::backward_from_many;
pub use fused_mlp::{fused_mlp, MlpLinear};
pub use fused_mlp_side::fused_mlp_side;
pub use gated_residual::gated_residual;
pub use gelu::gelu_tanh;
pub use joint_linear::joint_linear;
pub(crate) use linear::linear_into;
pub use linear::{dw_blocks, linear, linear_sunk, GradSink, InputSink, DW_ROWS, LINEAR_ROWS};
pub use ln_modulate::ln_modulate;
pub use lora_linear::lora_linear;
pub use mix_ffn::mix_ffn;
pub use mse_loss::mse_loss;
pub use norm_rope::{joint_norm_rope, norm_rope};
pub use release::release;
pub(crate) use release::release_whole;
pub use rms_norm::{rms_norm, RMS_EPS};
pub use rms_norm_rows::rms_norm_rows;
pub use rope::{rope, Rope, RopeTable};
pub use rope_cos_sin::rope_cos_sin;
pub use sum_squares::{sum_squares, SQUARES_CHUNK};
pub use tokens::{cat_tokens, split_tokens};
