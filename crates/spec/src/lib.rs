//! `ditmem-spec`: the vocabulary every other crate of ditmem speaks, and nothing else.
//!
//! - [`spec`]: the spec: model, workload, recipe, runtime, the cpu section, the limits
//!   (`LIMITS`, `MAX_*`) and [`Spec::validate`](spec::Spec::validate).
//! - [`sharder`]: the sharding recipe (`Sharder`, `Offload`) and its validation.
//! - [`units`]: byte counts as text (binary units: KiB, MiB, GiB) and back.
//! - [`error`]: [`SpecError`](error::SpecError), one line naming the field and what is allowed.
//!
//! It depends on no other crate of the workspace: the budget (`ditmem-budget`) re-exports it, the
//! engine and the conformance suite read the spec from here.

pub mod error;
pub mod sharder;
pub mod spec;
pub mod units;

pub use error::SpecError;
pub use spec::*;
pub use units::{fmt_bytes, parse_bytes};
