//! Typed errors of the budget crate. Each one renders as a single line that names the field and
//! what is allowed, so the binary can print it as it is.

use thiserror::Error;

/// A spec that cannot be read or is not valid.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SpecError {
    /// A field holds a value outside what is allowed.
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    /// The text is not well-formed TOML or JSON, or names an unknown field.
    #[error("malformed {format} spec{location}: {message}")]
    Parse {
        format: &'static str,
        message: String,
        location: String,
    },
    /// The file could not be read.
    #[error("cannot read spec file '{path}': {message}")]
    Io { path: String, message: String },
}

impl SpecError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> SpecError {
        SpecError::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }

    /// The field this error is about, when it is about one.
    pub fn field(&self) -> Option<&str> {
        match self {
            SpecError::Invalid { field, .. } => Some(field),
            _ => None,
        }
    }
}
