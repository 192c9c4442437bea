//! The key rules of a diffusers `config.json` ([`Cfg`], used by each family's reader; the family
//! is picked in `read.rs`): every key that changes a shape is read and range-checked, keys that do not change memory are accepted (the ones whose
//! value changes nothing ditmem counts, at any value; the ones whose value would change the model
//! in a way ditmem does not model, only at their no-op value), and anything else is refused
//! naming the key and what is allowed. Hostile input cannot panic or exhaust memory: the text is
//! capped, serde_json limits nesting, and every number is range-checked before any arithmetic.

use serde_json::{Map, Value};

use crate::error::SpecError;

/// Largest count of blocks in one stack (the published models have at most 60): half the spec's
/// depth cap, so the two stacks of a Flux model stay within it together.
pub(crate) const MAX_LAYERS: u64 = crate::spec::MAX_DEPTH as u64 / 2;
/// Largest hidden size, head count × head size (SD3.5-large: 2432; Wan 14B: 5120): the spec's.
pub(super) const MAX_HIDDEN: u64 = crate::spec::MAX_HIDDEN as u64;
/// Largest head count, head size, channel count or embedding width.
pub(crate) const MAX_DIM: u64 = 65_536;
/// Largest patch size along one axis.
pub(super) const MAX_PATCH: u64 = 64;
/// Largest latent side (`sample_size`) or position-table side (`pos_embed_max_size`).
pub(super) const MAX_SIDE: u64 = 4_096;
/// Largest FFN width (Wan 14B: 13,824).
pub(crate) const MAX_FFN: u64 = 1 << 20;
/// Largest row count of a table (label classes, RoPE positions).
pub(crate) const MAX_ROWS: u64 = 1 << 20;

/// A value for a message: short, with strings quoted.
pub(crate) fn shown(v: Option<&Value>) -> String {
    match v {
        None => "missing".into(),
        Some(v) => cut(&v.to_string()),
    }
}

/// The refusal of a value that is not a boolean (`allowed`: the spellings the key takes).
fn not_boolean(key: &str, v: &Value, allowed: &str) -> SpecError {
    SpecError::invalid(
        key,
        format!(
            "{} is not a boolean; allowed: {allowed}",
            cut(&v.to_string())
        ),
    )
}

pub(crate) fn cut(s: &str) -> String {
    const MAX: usize = 60;
    if s.chars().count() > MAX {
        format!("{}…", s.chars().take(MAX).collect::<String>())
    } else {
        s.to_string()
    }
}

/// The keys of one config, consumed as the family reads them.
pub(crate) struct Cfg {
    pub(crate) map: Map<String, Value>,
    used: Vec<String>,
}

impl Cfg {
    pub(crate) fn new(map: Map<String, Value>) -> Cfg {
        Cfg {
            map,
            used: Vec::new(),
        }
    }

    /// `key`'s value, null as absent (the key marked read).
    fn take(&mut self, key: &str) -> Option<&Value> {
        match self.raw(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    /// `key`'s value as written, null kept; the key marked read (the unread ones are refused).
    fn raw(&mut self, key: &str) -> Option<&Value> {
        if !self.used.iter().any(|k| k == key) {
            self.used.push(key.to_string());
        }
        self.map.get(key)
    }

    /// `out_channels`: an integer, or (null, or absent without a `default`) the input's
    /// channels, as diffusers' `out_channels = out_channels or in_channels`.
    pub(crate) fn out_channels(
        &mut self,
        default: Option<u64>,
        in_channels: u64,
    ) -> Result<u64, SpecError> {
        Ok(self
            .opt_int("out_channels", default, 1, MAX_DIM)?
            .unwrap_or(in_channels))
    }

    /// An integer in `lo..=hi`, or `default` when absent.
    pub(crate) fn int(
        &mut self,
        key: &str,
        default: u64,
        lo: u64,
        hi: u64,
    ) -> Result<u64, SpecError> {
        Ok(self.opt_int(key, Some(default), lo, hi)?.unwrap_or(default))
    }

    /// An integer in `lo..=hi` or null; `default` when the key is absent.
    pub(crate) fn opt_int(
        &mut self,
        key: &str,
        default: Option<u64>,
        lo: u64,
        hi: u64,
    ) -> Result<Option<u64>, SpecError> {
        let present = self.map.contains_key(key);
        match self.raw(key) {
            None => Ok(default),
            Some(Value::Null) if present => Ok(None),
            Some(v) => int_in(key, v, lo, hi).map(Some),
        }
    }

    /// A boolean, or `default` when absent.
    pub(crate) fn bool(&mut self, key: &str, default: bool) -> Result<bool, SpecError> {
        match self.take(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(not_boolean(key, v, "true, false")),
        }
    }

    /// A boolean or null; `default` when absent.
    pub(crate) fn opt_bool(
        &mut self,
        key: &str,
        default: Option<bool>,
    ) -> Result<Option<bool>, SpecError> {
        let present = self.map.contains_key(key);
        match self.raw(key) {
            None if !present => Ok(default),
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(not_boolean(key, v, "true, false, null")),
        }
    }

    /// A string (or null) among `allowed` (null spelled `None`); `default` when absent.
    pub(crate) fn choice(
        &mut self,
        key: &str,
        default: Option<&'static str>,
        allowed: &[Option<&'static str>],
        why: &str,
    ) -> Result<Option<&'static str>, SpecError> {
        let present = self.map.contains_key(key);
        let got: Option<String> = match self.raw(key) {
            None if !present => return Ok(default),
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(v) => {
                return Err(SpecError::invalid(
                    key,
                    format!(
                        "{} is not a string; allowed: {}",
                        cut(&v.to_string()),
                        list(allowed)
                    ),
                ))
            }
        };
        for a in allowed {
            if a.as_deref() == got.as_deref() {
                return Ok(*a);
            }
        }
        let shown = got.map_or("null".to_string(), |s| format!("\"{}\"", cut(&s)));
        Err(SpecError::invalid(
            key,
            format!("{shown} is not modelled{why}; allowed: {}", list(allowed)),
        ))
    }

    /// A finite number in `lo..=hi` (or null when `nullable`); `default` when absent.
    pub(crate) fn number(
        &mut self,
        key: &str,
        default: Option<f64>,
        lo: f64,
        hi: f64,
        nullable: bool,
    ) -> Result<Option<f64>, SpecError> {
        let present = self.map.contains_key(key);
        match self.raw(key) {
            None if !present => Ok(default),
            None | Some(Value::Null) if nullable => Ok(None),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(Some(x)),
                _ => Err(SpecError::invalid(
                    key,
                    format!("{n} is out of range; allowed: a number from {lo} to {hi}"),
                )),
            },
            v => Err(SpecError::invalid(
                key,
                format!(
                    "{} is not a number; allowed: a number from {lo} to {hi}{}",
                    shown(v),
                    if nullable { " or null" } else { "" }
                ),
            )),
        }
    }

    /// Dropout: only 0 (the published checkpoints; masks are not modelled).
    pub(crate) fn zero_dropout(&mut self, key: &str) -> Result<(), SpecError> {
        match self.number(key, Some(0.0), 0.0, 1.0, false)? {
            Some(x) if x != 0.0 => Err(SpecError::invalid(
                key,
                format!(
                    "{x} is not modelled (dropout masks come with the activations); allowed: 0.0"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// A list of integers in `lo..=hi` of at most `max_len` entries.
    pub(crate) fn int_list(
        &mut self,
        key: &str,
        default: &[u64],
        max_len: usize,
        lo: u64,
        hi: u64,
    ) -> Result<Vec<u64>, SpecError> {
        match self.take(key) {
            None => Ok(default.to_vec()),
            Some(Value::Array(a)) if a.len() <= max_len => {
                a.iter().map(|v| int_in(key, v, lo, hi)).collect()
            }
            Some(Value::Array(a)) => Err(SpecError::invalid(
                key,
                format!("has {} entries; allowed: at most {max_len}", a.len()),
            )),
            Some(v) => Err(SpecError::invalid(
                key,
                format!(
                    "{} is not a list; allowed: a list of integers from {lo} to {hi}",
                    cut(&v.to_string())
                ),
            )),
        }
    }

    /// Keys that change nothing ditmem counts, at any value of the right kind.
    pub(crate) fn ignore_numbers(&mut self, keys: &[&str]) -> Result<(), SpecError> {
        for k in keys {
            self.number(k, None, f64::MIN, f64::MAX, true)?;
        }
        Ok(())
    }

    /// After the family has read its keys: every key left is unknown.
    pub(crate) fn finish(&self, class: &str) -> Result<(), SpecError> {
        for key in self.map.keys() {
            // `_diffusers_version`, `_name_or_path`, `_commit_hash`, `_use_default_values`, …:
            // bookkeeping of diffusers' ConfigMixin, never a shape.
            if key.starts_with('_') || self.used.iter().any(|k| k == key) {
                continue;
            }
            let mut allowed: Vec<&str> = self.used.iter().map(String::as_str).collect();
            allowed.retain(|k| *k != "_class_name");
            // A key that shows as nothing (empty, blank, control characters) is named quoted.
            let named = if key.trim().is_empty() || key.chars().any(char::is_control) {
                Value::String(key.clone()).to_string()
            } else {
                key.clone()
            };
            return Err(SpecError::invalid(
                cut(&named),
                format!(
                    "unknown key for {class}; allowed: {} (and diffusers' `_`-prefixed bookkeeping)",
                    allowed.join(", ")
                ),
            ));
        }
        Ok(())
    }
}

fn list(allowed: &[Option<&str>]) -> String {
    allowed
        .iter()
        .map(|a| a.map_or("null".to_string(), |s| format!("\"{s}\"")))
        .collect::<Vec<_>>()
        .join(", ")
}

fn int_in(key: &str, v: &Value, lo: u64, hi: u64) -> Result<u64, SpecError> {
    // 2.0 is an integer to Python's json too only as a float; diffusers would pass a float on.
    match v.as_u64() {
        Some(n) if (lo..=hi).contains(&n) => Ok(n),
        Some(n) => Err(SpecError::invalid(
            key,
            format!("{n} is out of range; allowed: an integer from {lo} to {hi}"),
        )),
        None => Err(SpecError::invalid(
            key,
            format!(
                "{} is not a non-negative integer; allowed: an integer from {lo} to {hi}",
                cut(&v.to_string())
            ),
        )),
    }
}

/// A dims check that is not about one key's own range.
pub(crate) fn mismatch(key: &str, why: String) -> SpecError {
    SpecError::invalid(key, why)
}
