//! `ditmem-spec`: the vocabulary every other crate of ditmem speaks, and nothing else.
//!
//! - [`spec`]: the whole spec ([`Spec`]: model + workload + recipe + runtime + cpu + cuda), read
//!   from TOML or JSON and written back; it re-exports every part below.
//! - `model`: the model ([`ModelSpec`]) and its presets.
//! - `workload`: image size, latent geometry, the batch's split ([`Workload`], [`TokenGrid`]).
//! - `precision`: element types ([`Dtype`]) and the numeric policy ([`Precision`]).
//! - `recipe`: the levers of the step ([`Recipe`]: optimizer, attention, recompute, latents,
//!   EMA, …); `lora`: LoRA's part of it; [`sharder`]: the sharding recipe (`Sharder`,
//!   `Offload`) and its validation.
//! - `runtime`: where the step runs ([`Runtime`], [`CudaSpec`]); `cpu`: the `cpu` section
//!   ([`CpuSpec`]).
//! - `limits`: the caps on sizes (`LIMITS`, `MAX_*`); `validation`:
//!   [`Spec::validate`](spec::Spec::validate).
//! - [`units`]: byte counts as text (binary units: KiB, MiB, GiB) and back.
//! - [`error`]: [`SpecError`](error::SpecError), one line naming the field and what is allowed.
//!
//! The parts' modules are private: every item is named `ditmem_spec::X` (and
//! `ditmem_spec::spec::X`).
//!
//! It depends on no other crate of the workspace: the budget (`ditmem-budget`) re-exports it, the
//! engine and the conformance suite read the spec from here.

// A `pub` item the crate root does not export would read as API and is not: it must say
// `pub(crate)` (issue 45: public items only where another crate can use them).
#![warn(unreachable_pub)]

mod cpu;
pub mod error;
mod limits;
mod lora;
mod model;
mod named;
mod precision;
mod recipe;
mod runtime;
pub mod sharder;
pub mod spec;
pub mod units;
mod validation;
mod workload;

pub use error::SpecError;
pub use spec::*;
pub use units::{fmt_bytes, parse_bytes};
