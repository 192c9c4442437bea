//! `ditmem-conformance`: the conformance suite, above the engine and the budget.
//!
//! - [`verify`]: the engine's variants (precision, recompute, attention, accumulation) against a
//!   float64 reference: tolerances by dtype, twins, drift, the planted bugs it must catch.
//! - [`agree`]: the agreement grid: each spec measured by the engine and predicted by the
//!   `ditmem-cpu` budget (`ditmem agree`).
//!
//! - `families`: each family's part of `verify` (its rounding stages, key-bias siblings, score
//!   probe), one file per family, registered in one dispatch function.
//!
//! The engine only trains and measures; what it is held to lives here.

// A `pub` item the crate root does not export would read as API and is not: it must say
// `pub(crate)` (issue 45: public items only where another crate can use them).
#![warn(unreachable_pub)]

// The engine's modules under the names `verify` and `agree` were written with while they lived in
// the engine (`crate::ops::…`, `crate::trainer::…`): imported once here, so the files moved
// unchanged. The engine's families are named `ditmem_engine::families` (`crate::families` is the
// suite's own: each family's part of `verify`).
use ditmem_engine::{
    diffusion, error, host, layers, measure, model, mutation, ops, optim, rng, run,
    trainable_count, trainer, Result,
};

pub mod agree;
mod families;
pub mod verify;

pub use verify::{Reference, Report as VerifyReport, Variant, Verdict, VerifyError, VerifyOptions};
