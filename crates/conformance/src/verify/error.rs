//! The errors of a verification ([`VerifyError`]), below the verify modules that return them.

use thiserror::Error;

use crate::error::EngineError;

/// What can go wrong in a verification.
#[derive(Debug, Error)]
pub enum VerifyError {
    /// The engine refused the spec or failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A `--variants` entry could not be read.
    #[error("variant '{text}': {why}")]
    Variant { text: String, why: String },
    /// A stored reference could not be read.
    #[error("reference file: {why}")]
    Reference { why: String },
    /// A stored reference was computed for another spec or other settings.
    #[error(
        "the reference does not match this run: {what} is {stored} in the reference but {current} here"
    )]
    Mismatch {
        what: String,
        stored: String,
        current: String,
    },
    /// A setting is out of range.
    #[error("{what}: {why}")]
    BadInput { what: String, why: String },
}

/// Result of the verify calls.
pub type Result<T> = std::result::Result<T, VerifyError>;

pub(crate) fn bad(what: impl Into<String>, why: impl Into<String>) -> VerifyError {
    VerifyError::BadInput {
        what: what.into(),
        why: why.into(),
    }
}

pub(super) fn reference_error(why: impl Into<String>) -> VerifyError {
    VerifyError::Reference { why: why.into() }
}
