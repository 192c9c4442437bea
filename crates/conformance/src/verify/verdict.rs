//! What a check concludes: pass / warn / fail per variant ([`Verdict`]) and the kinds of fault
//! ([`Fault`]).

use super::tolerance::WARN_FACTOR;
use serde::{Deserialize, Serialize};
use std::fmt;

/// A planted bug, applied to a variant's one-step gradients, so tests can show that the verifier
/// catches real mistakes. Not part of the CLI.
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Fault {
    /// Drop one gradient contribution: the named tensor's gradient becomes zero.
    ZeroGradient(String),
    /// Scale the named tensor's gradient by num/den (e.g. a forgotten loss-scale division).
    ScaleGradient(String, i64, i64),
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::ZeroGradient(n) => write!(f, "fault:zero-grad({n})"),
            Fault::ScaleGradient(n, a, b) => write!(f, "fault:scale-grad({n},{a}/{b})"),
        }
    }
}

impl Fault {
    /// The tensor the fault is planted in.
    pub fn target(&self) -> &str {
        match self {
            Fault::ZeroGradient(n) | Fault::ScaleGradient(n, _, _) => n,
        }
    }

    pub(super) fn apply(&self, name: &str, values: &mut [f64]) {
        if name != self.target() {
            return;
        }
        let factor = match self {
            Fault::ZeroGradient(_) => 0.0,
            Fault::ScaleGradient(_, a, b) => *a as f64 / *b as f64,
        };
        for x in values {
            *x *= factor;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tolerances.

/// The verdict of a variant (ordered: worse is greater).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Warn,
    Fail,
    /// The engine does not execute this combination (e.g. attention dropout with
    /// memory-efficient attention); not counted as a failure.
    Skip,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Warn => "warn",
            Verdict::Fail => "fail",
            Verdict::Skip => "skip",
        }
    }

    /// Judge an error against a tolerance (NaN fails).
    pub fn of(err: f64, tol: f64) -> Verdict {
        if err <= tol {
            Verdict::Pass
        } else if err <= WARN_FACTOR * tol {
            Verdict::Warn
        } else {
            Verdict::Fail
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

// ---------------------------------------------------------------------------------------------
// Settings, reference.
