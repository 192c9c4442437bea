//! `ditmem-conformance`: the conformance suite, above the engine and the budget.
//!
//! - [`verify`]: the engine's variants (precision, recompute, attention, accumulation) against a
//!   float64 reference: tolerances by dtype, twins, drift, the planted bugs it must catch.
//! - [`agree`]: the agreement grid: each spec measured by the engine and predicted by the
//!   `ditmem-cpu` budget (`ditmem agree`).
//!
//! The engine only trains and measures; what it is held to lives here.

// The engine's modules under the names `verify` and `agree` were written with while they lived in
// the engine (`crate::families::…`, `crate::ops::…`): imported once here, so the files moved
// unchanged.
use ditmem_engine::{
    diffusion, error, families, host, layers, measure, model, mutation, ops, optim, rng, run,
    trainable_count, trainer, Result,
};

pub mod agree;
pub mod verify;

pub use verify::{Reference, Report as VerifyReport, Variant, Verdict, VerifyError, VerifyOptions};
