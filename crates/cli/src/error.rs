//! The binary's errors: each kind maps to an exit code of the README's table, and to the one
//! line the CLI prints (the API returns the same line).

use ditmem_budget::SpecError;

/// Errors the binary reports; each maps to an exit code.
#[derive(Debug)]
pub enum CliError {
    /// Bad input: exit 2.
    Spec(SpecError),
    /// The step would not fit (a guard refused it): exit 3.
    Refused(String),
    /// A needed external tool is missing (the PyTorch peer's Python): exit 5.
    Missing(String),
    /// Ctrl-C stopped a run after this many steps: exit 130.
    Interrupted(u32),
    /// Anything else that went wrong: exit 1.
    Other(anyhow::Error),
}

impl From<SpecError> for CliError {
    fn from(e: SpecError) -> Self {
        CliError::Spec(e)
    }
}

impl From<anyhow::Error> for CliError {
    fn from(e: anyhow::Error) -> Self {
        CliError::Other(e)
    }
}

/// The exit code and the one line (without the `ditmem: ` prefix) the CLI reports for an error.
pub fn error_line(e: &CliError) -> (u8, String) {
    let (code, line) = match e {
        CliError::Spec(e) => (2, format!("invalid input: {e}")),
        CliError::Refused(msg) => (3, format!("refused: {msg}")),
        CliError::Missing(msg) => (5, format!("missing: {msg}")),
        CliError::Interrupted(steps) => (
            130,
            format!("interrupted after {steps} steps; no output written"),
        ),
        CliError::Other(e) => (1, format!("{e:#}")),
    };
    (code, crate::flags::tidy(&line))
}
