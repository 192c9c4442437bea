//! `plan`'s own flags read: the time limit, `--allow`, `--family`, the pinned launch, the
//! budget.

use crate::flags::show;
use ditmem_budget::launch::Pinned;
use ditmem_budget::parse_bytes;
use ditmem_budget::Allow;
use ditmem_budget::Family;
use ditmem_budget::SpecError;

/// The search's default time limit: the README's promise of an answer within 30 s.
pub(super) const DEFAULT_TIME_LIMIT_S: f64 = 30.0;

/// `--time-limit`: 0.1 to 86,400 seconds.
pub(super) fn time_limit(text: &str) -> Result<f64, String> {
    const ALLOWED: &str = "allowed: seconds from 0.1 to 86400, e.g. 30";
    match text.trim().parse::<f64>() {
        Ok(v) if (0.1..=86_400.0).contains(&v) => Ok(v),
        Ok(_) => Err(format!("{} is out of range; {ALLOWED}", show(text))),
        Err(_) => Err(format!("{} is not a number; {ALLOWED}", show(text))),
    }
}

/// `--allow`: the levers that change what is trained or need more devices.
pub(crate) fn parse_allow(items: &[String]) -> Result<Allow, SpecError> {
    let mut a = Allow::default();
    for item in items.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        match item.to_ascii_lowercase().as_str() {
            "lora" => a.lora = true,
            "8bit" | "8-bit" | "adamw-8bit" => a.eight_bit = true,
            "sharding" | "zero" => a.sharding = true,
            "bf16-pure" => a.bf16_pure = true,
            "precision" => a.precision = true,
            "quant" | "nf4" | "qlora" => a.quant = true,
            "all" => a = Allow::all(),
            "none" => {}
            _ => {
                return Err(SpecError::invalid(
                    "--allow",
                    format!(
                    "{} is not a lever; allowed: lora, 8bit, sharding, bf16-pure, precision, quant, all",
                    show(item)
                ),
                ))
            }
        }
    }
    Ok(a)
}

/// `--emit-family`: a family name as `ditmem params` prints it.
pub(super) fn parse_family(text: &str) -> Result<Family, SpecError> {
    let t = text.trim().to_ascii_lowercase();
    Family::ALL
        .into_iter()
        .find(|f| f.name() == t)
        .ok_or_else(|| {
            SpecError::invalid(
                "--emit-family",
                format!(
                    "{} is not a family; allowed: {}",
                    show(text),
                    Family::ALL.map(|f| f.name()).join(", ")
                ),
            )
        })
}

/// The recipe fields the user set, by a flag or in the `--config` file: the planner keeps them.
pub(crate) fn pinned(spec: &crate::args::SpecArgs) -> Result<Pinned, SpecError> {
    let v = match &spec.config {
        Some(path) => Some(crate::input::spec_value(path)?),
        None => None,
    };
    let has = |path: &[&str]| {
        let mut x = match &v {
            Some(x) => x,
            None => return false,
        };
        for k in path {
            match x.get(k) {
                Some(y) => x = y,
                None => return false,
            }
        }
        true
    };
    Ok(Pinned {
        latents: spec.latents.is_some() || has(&["recipe", "latents"]),
        recompute: spec.recompute.is_some() || has(&["recipe", "recompute"]),
        attention: spec.attention.is_some() || has(&["recipe", "attention"]),
        microbatch: spec.microbatch.is_some()
            || spec.accumulation.is_some()
            || has(&["workload", "microbatch"])
            || has(&["workload", "accumulation"]),
        zero_stage: spec.zero.is_some() || has(&["recipe", "zero_stage"]),
        text_encoders: spec.text_encoders.is_some() || has(&["recipe", "text_encoders"]),
        lora_modules: spec.lora_targets.is_some() || has(&["recipe", "lora", "modules"]),
        ema: spec.ema.is_some() || has(&["recipe", "ema", "enabled"]),
        text_tokens: spec.text_tokens.is_some() || has(&["workload", "text_tokens"]),
    })
}

/// Whether the user asked for a precision: `--precision`, or `recipe.precision` in the
/// `--config` file.
pub(super) fn precision_requested(spec: &crate::args::SpecArgs) -> Result<bool, SpecError> {
    if spec.precision.is_some() {
        return Ok(true);
    }
    let Some(path) = &spec.config else {
        return Ok(false);
    };
    let v = crate::input::spec_value(path)?;
    Ok(v.get("recipe").and_then(|r| r.get("precision")).is_some())
}

pub(super) fn parse_budget(text: &str) -> Result<u64, SpecError> {
    const ALLOWED: &str =
        "allowed: a positive size below 16 EiB such as 24GiB, 40G, 81920MiB or a byte count";
    match parse_bytes(text) {
        // parse_bytes saturates at u64::MAX (2⁶⁴ − 1 itself is no f64): a size of 16 EiB or
        // more is refused, not capped.
        Some(u64::MAX) => Err(SpecError::invalid(
            "--budget",
            format!("{} is 16 EiB or more; {ALLOWED}", show(text)),
        )),
        Some(b) if b > 0 => Ok(b),
        _ => Err(SpecError::invalid(
            "--budget",
            format!("{} is not a memory size; {ALLOWED}", show(text)),
        )),
    }
}
