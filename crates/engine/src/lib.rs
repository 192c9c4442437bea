//! `ditmem-engine`: executes a ditmem [`Spec`](ditmem_budget::Spec) as a real DiT training step in
//! candle (CPU) and measures it.
//!
//! - [`model`]: the DiT's parameters (PyTorch names), init, embedders, patchify.
//! - [`block`]: the adaLN-Zero block and final layer.
//! - [`families`]: the diffusers families beside the DiT ([`families::pixart`]: PixArt-α / Σ;
//!   [`families::sana`]: Sana, [`families::wan`]: Wan 2.1).
//! - [`ops`]: fused ops with their own backward, one module per op family: [`ops::linear`](mod@ops::linear)
//!   (+ its gradient sink), [`ops::gelu`], [`ops::ln_modulate`](mod@ops::ln_modulate),
//!   [`ops::gated_residual`](mod@ops::gated_residual), [`ops::rms_norm`](mod@ops::rms_norm),
//!   [`ops::rope`](mod@ops::rope), [`ops::attention`] (the fused qkv
//!   attention, its AVX512-BF16 kernels in [`ops::attention::bf16`] and the composed reference in
//!   [`ops::attention::reference`]), [`ops::backward_from`](mod@ops::backward_from) and
//!   [`ops::sum_squares`](mod@ops::sum_squares).
//! - [`kernels`]: the slice kernels under the ops: [`kernels::gemm_bf16`] (bf16 products with
//!   f32 accumulation on AVX512-BF16, `vdpbf16ps`), [`kernels::vecmath`] (vectorised f32
//!   elementwise maps and row kernels: GELU, softmax, bf16 rounding), the `gemm` crate wrappers
//!   and the one raw-pointer helper the parallel kernels share.
//! - [`diffusion`]: DDPM schedule, targets, deterministic synthetic data, latent directories.
//! - [`trainer`]: the block scheduler (store / recompute, accumulation, loss scaling) and steps.
//! - [`optim`]: AdamW, SGD, EMA, dynamic loss scaling.
//! - [`threads`]: thread-pool settings a binary applies before it starts any thread.
//! - [`host`]: the spec's `cpu` section read from this process (threads, bf16 path, `gemm`'s
//!   slab), the check that a spec describes the process, and the CPU's name.
//! - [`measure`]: the counting allocator and the memory probe.
//! - [`run`](mod@run): warm-up + measured steps → [`Measurement`].
//!
//! Verification (variants against a float64 reference) and the agreement grid (the budget against
//! the measured step) are the conformance suite's, `crates/conformance` (`ditmem-conformance`):
//! this crate only trains and measures.
//!
//! # Block composition (what one block allocates in forward)
//! `cd` = compute dtype, `ad` = accumulation dtype, E = b·s·D, A = b·a·s². Casts happen only when
//! the dtypes differ. The heavy ops are fused custom ops ([`ops`]) that keep only what their
//! backward needs; every tensor below stays alive while the block's output is kept, and is freed
//! when the block's backward is done:
//! Linear weights are never cast: the fused linear reads the f32 master weights under a bf16/f16
//! compute dtype (rounding them as it packs or widens them) and returns their gradients in f32.
//! 1. `silu(c)` (b,D) ad → cd; fused linear (b,6D) cd; → ad (b,6D); six
//!    `narrow` views.
//! 2. LN1 + modulate fused ([`ops::ln_modulate()`]): one (E cd) output; the op keeps (mean, rstd)
//!    per row (2·b·s, f32; f64 under fp64). Its inputs are x and the shift/scale chunks.
//! 3. fused linear ([`ops::linear()`]) (b·s,3D) cd.
//! 4. attention read in place from qkv ([`ops::qkv_attention`]), output (b·s, D) cd. It keeps P
//!    (A cd) when materialized, the log-sum-exp (b·a·s, f32; f64 under fp64) when
//!    memory-efficient, nothing under attention-only recompute; dropout masks are regenerated
//!    from their seed.
//! 5. fused linear (E cd); → ad (E); ·gate (E ad); x1 = x + … (E ad).
//! 6. LN2 + modulate as 2 (on x1); fused linear (4E cd); gelu
//!    ([`ops::gelu_tanh`], 4E cd, saves only its input); [dropout mask (4E cd), g·mask (4E cd)];
//!    fused linear (E cd); → ad (E); ·gate (E ad); x2 = x1 + … (E ad).
//!
//! Trained linear weights enter the block untracked and their gradients leave through a sink
//! ([`ops::GradSink`]) that the trainer empties after the block's backward, instead of through
//! candle's gradient store (which would add each to a fresh `zeros_like`).
//!
//! Beyond the block graph: a stored block's input is a fresh leaf copy (E ad) of the previous
//! output; a recomputed block keeps only its input (which shares storage with the previous block's
//! output).

// A `pub` item the crate root does not export would read as API and is not: it must say
// `pub(crate)` (issue 45: public items only where another crate can use them).
#![warn(unreachable_pub)]

pub mod diffusion;
pub mod error;
pub mod families;
pub mod host;
pub mod kernels;
pub mod layers;
pub mod malloc;
pub mod measure;
pub mod model;
pub mod mutation;
pub mod ops;
pub mod optim;
pub mod rng;
pub mod run;
pub mod shapes;
pub mod threads;
pub mod trainer;

pub use diffusion::{alphas_cumprod, load_latent_dir, Batch, SyntheticData};
pub use error::{EngineError, Result};
pub use measure::{CountingAlloc, MemoryProbe, Phase, PhasePeaks, TimelinePoint};
pub use model::{param_count, param_shapes, trainable_count, Dims};
pub use run::{run, Measurement, PhaseTimes, Progress, RunOptions};
pub use trainer::{TrainOptions, Trainer};
