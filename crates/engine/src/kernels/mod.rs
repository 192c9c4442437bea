//! Compute kernels over plain slices, below the fused ops of [`crate::ops`] (which they never
//! import):
//!
//! - [`gemm`]: the f32/f64 products through the `gemm` crate.
//! - [`gemm_bf16`]: bf16 products with f32 accumulation on AVX512-BF16 (`vdpbf16ps`); used where the
//!   spec's `cpu.bf16_products` says so (see [`crate::host`]); the budget restates its packing
//!   sizes.
//! - `pack_bf16_avx512`: the AVX-512 packing of `gemm_bf16`'s operands (same bits as its
//!   element-wise packing).
//! - [`vecmath`]: vectorised f32 elementwise maps and row kernels (GELU, softmax, bf16 rounding).
//! - `scalar`: the accumulation scalar and storage element traits the kernels are generic over.
//! - `shared_ptr`: the raw pointer parallel tasks write disjoint elements through.
//! - `bf16_layout`: the bf16 tile (`MR`, `NR`, `KC_PAIRS`) and packing source (`Src`) that
//!   `gemm_bf16` and `pack_bf16_avx512` both use.

mod bf16_layout;
pub mod gemm;
pub mod gemm_bf16;
mod pack_bf16_avx512;
pub(crate) mod scalar;
pub(crate) mod shared_ptr;
pub mod vecmath;
