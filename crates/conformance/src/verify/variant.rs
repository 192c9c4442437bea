//! The variants `verify` runs ([`Variant`]: precision / recompute / attention), the default
//! set and the `--variants` syntax ([`parse_variants`]).

use super::error::{Result, VerifyError};
use super::verdict::Fault;
use ditmem_budget::{AttentionMode, Precision, Recompute, Spec};
use std::fmt;

/// One way of computing the step: precision policy × recompute policy × attention mode.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Variant {
    pub precision: Precision,
    pub recompute: Recompute,
    pub attention: AttentionMode,
    /// A planted bug applied to the one-step gradients (tests of the verifier only).
    #[doc(hidden)]
    pub fault: Option<Fault>,
}

/// Recompute policies of the default variant set.
pub(crate) const DEFAULT_RECOMPUTE: [Recompute; 3] =
    [Recompute::None, Recompute::All, Recompute::AttentionOnly];

/// Attention modes of the default variant set.
pub(crate) const DEFAULT_ATTENTION: [AttentionMode; 2] =
    [AttentionMode::Materialized, AttentionMode::MemoryEfficient];

impl Variant {
    pub fn new(precision: Precision, recompute: Recompute, attention: AttentionMode) -> Variant {
        Variant {
            precision,
            recompute,
            attention,
            fault: None,
        }
    }

    /// The reference: fp64, every block stored, materialized attention.
    pub fn reference() -> Variant {
        Variant::new(
            Precision::Fp64,
            Recompute::None,
            AttentionMode::Materialized,
        )
    }

    /// `precision/recompute/attention` (block lists written with `+`: `blocks:0+2`), with the
    /// planted fault appended when there is one.
    pub fn name(&self) -> String {
        let r = self.recompute.to_string().replace(',', "+");
        let mut n = format!("{}/{}/{}", self.precision, r, self.attention.name());
        if let Some(f) = &self.fault {
            n.push_str(&format!("+{f}"));
        }
        n
    }

    /// `base` with this variant's precision, recompute and attention.
    pub fn apply(&self, base: &Spec) -> Spec {
        let mut s = base.clone();
        s.recipe.precision = self.precision;
        s.recipe.recompute = self.recompute.clone();
        s.recipe.attention = self.attention;
        s
    }

    /// Variants with the same key differ only by recompute and must be bitwise identical: a
    /// recomputed block replays exactly the ops of storing it, and attention-only recompute
    /// rebuilds the same materialized attention graph in its backward.
    pub(super) fn twin_key(&self) -> (Precision, AttentionMode) {
        (self.precision, self.attention)
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// The default variant set: every precision × {none, all, attention-only} × both attention modes.
pub fn default_variants() -> Vec<Variant> {
    let mut v = Vec::new();
    for p in Precision::ALL {
        for r in DEFAULT_RECOMPUTE.iter() {
            for a in DEFAULT_ATTENTION {
                v.push(Variant::new(p, r.clone(), a));
            }
        }
    }
    v
}

/// Parse `precision/recompute/attention` items separated by commas. `*` (or a missing trailing
/// part) stands for every value of the default set; block lists are written `blocks:0+2`.
/// Example: `bf16-mixed/all/materialized,fp32/none/memory-efficient,fp16-mixed/*/*`.
pub fn parse_variants(text: &str) -> Result<Vec<Variant>> {
    let mut out: Vec<Variant> = Vec::new();
    let items: Vec<&str> = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if items.is_empty() {
        return Err(VerifyError::Variant {
            text: text.into(),
            why: "no variant given; allowed: precision/recompute/attention, e.g. bf16-mixed/all/materialized".into(),
        });
    }
    for item in items {
        let verr = |why: String| VerifyError::Variant {
            text: item.into(),
            why,
        };
        let parts: Vec<&str> = item.split('/').map(str::trim).collect();
        if parts.len() > 3 {
            return Err(verr(
                "has more than three parts; allowed: precision/recompute/attention".into(),
            ));
        }
        let part = |i: usize| parts.get(i).copied().unwrap_or("*");
        let precisions: Vec<Precision> = match part(0) {
            "*" | "" => Precision::ALL.to_vec(),
            p => vec![p.parse::<Precision>().map_err(|e| verr(e.to_string()))?],
        };
        let recomputes: Vec<Recompute> = match part(1) {
            "*" | "" => DEFAULT_RECOMPUTE.to_vec(),
            r => vec![r
                .replace('+', ",")
                .parse::<Recompute>()
                .map_err(|e| verr(e.to_string()))?],
        };
        let attentions: Vec<AttentionMode> = match part(2) {
            "*" | "" => DEFAULT_ATTENTION.to_vec(),
            a => vec![a
                .parse::<AttentionMode>()
                .map_err(|e| verr(e.to_string()))?],
        };
        for &p in &precisions {
            for r in &recomputes {
                for &a in &attentions {
                    let v = Variant::new(p, r.clone(), a);
                    if !out.contains(&v) {
                        out.push(v);
                    }
                }
            }
        }
    }
    Ok(out)
}
