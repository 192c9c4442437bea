//! [`qkv_attention`]: attention read in place from the (b·s, 3D) output of the qkv projection
//! (no splits or copies), as one custom op ([`QkvAttention`]) keeping P (materialized), nothing
//! (attention-only recompute) or the log-sum-exp (memory-efficient, streaming over key blocks);
//! the softmax is fused and accumulates in f32 (f64 for f64). Budget twin:
//! `ditmem_budget::ditmem_cpu::ops::fused_attention`.
//!
//! - `qkv`: [`qkv_attention`] itself, its node and backward.
//! - [`geom`]: the modes ([`AttnKeep`]), shapes ([`AttnGeom`]) and per-head scratch sizes.
//! - `generic`: the kernels for every dtype through the `gemm` crate, over one qkv tensor.
//! - `head`: one head's forward and backward in the accumulation type (generic and separate).
//! - [`bf16`]: the kernels for bf16 on AVX512-BF16.
//! - [`dropout`]: the dropout mask, composed and per element.
//! - [`reference`](mod@reference): the composed attention ([`attention_materialized`]), the tests' reference.
//! - [`projected`]: the qkv projection folded into the attention's node.
//! - [`separate`]: attention over separate q, k, v (self-attention of three projections, and
//!   cross-attention to text tokens).
//! - [`cross`]: the cross-attention with its k and v projections of the text folded in.

pub mod bf16;
pub mod cross;
pub mod dropout;
mod generic;
pub mod geom;
mod head;
pub mod projected;
mod qkv;
pub mod reference;
pub mod separate;

pub use cross::cross_attention;
pub(crate) use dropout::dropout_mask;
pub use dropout::Dropout;
pub use geom::{AttnGeom, AttnKeep, ATTN_KEY_BLOCK, ATTN_QUERY_BLOCK};
pub(crate) use projected::projected_attention;
pub use qkv::qkv_attention;
pub(crate) use qkv::QkvAttention;
pub use reference::attention_materialized;
