//! `ditmem-budget`: the analytic side of ditmem. Pure Rust, no tensor library.
//!
//! One [`spec::Spec`] (model + workload + recipe + runtime) describes a training step. This crate
//! counts every byte of that step: the parameters per module, what each op of each block saves for
//! backward and the workspace it allocates (the op inventory, per runtime), and a simulated timeline
//! of forward → backward → optimizer whose maximum is the peak.

pub mod candle;
pub mod candle_step;
pub mod cost;
pub mod error;
pub mod export;
pub mod spec;

pub use error::SpecError;
pub use spec::*;
pub mod estimate;
pub mod graph;
pub mod params;
pub mod plan;
pub mod runtime;
pub mod runtime_pytorch;
pub mod timeline;
pub mod units;

pub use estimate::{estimate, Budget};
