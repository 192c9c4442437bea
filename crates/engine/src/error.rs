//! Typed errors of the engine. Each renders as one line the CLI can print as it is.

use thiserror::Error;

/// Everything that can go wrong while building or running a training step.
#[derive(Debug, Error)]
pub enum EngineError {
    /// The spec is not valid (the budget's validation, reused).
    #[error(transparent)]
    Spec(#[from] ditmem_budget::SpecError),
    /// A tensor operation failed inside candle.
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// The spec asks for something this engine does not execute (yet).
    #[error("{feature} is not supported by the engine: {why}")]
    Unsupported { feature: String, why: String },
    /// An argument handed to the engine does not fit the spec (batch size, names, shapes).
    #[error("{what}: {why}")]
    BadInput { what: String, why: String },
    /// The progress callback asked to stop.
    #[error("run interrupted after {after_steps} steps")]
    Interrupted { after_steps: u32 },
    /// Reading latents from disk failed.
    #[error("cannot read latents from '{path}': {why}")]
    Data { path: String, why: String },
}

impl EngineError {
    pub(crate) fn unsupported(feature: impl Into<String>, why: impl Into<String>) -> Self {
        EngineError::Unsupported {
            feature: feature.into(),
            why: why.into(),
        }
    }

    pub(crate) fn bad_input(what: impl Into<String>, why: impl Into<String>) -> Self {
        EngineError::BadInput {
            what: what.into(),
            why: why.into(),
        }
    }
}

/// Result of engine calls.
pub type Result<T> = std::result::Result<T, EngineError>;
