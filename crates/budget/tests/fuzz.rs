//! Issue 19: property tests of the spec parser and validation, and of `estimate` and `plan` over
//! any spec that passes validation.
//!
//! Case counts are bounded for the suite (see [`cases`]); `DITMEM_FUZZ_CASES=N` raises them for a
//! long run, `DITMEM_FUZZ_REPORT=1` prints the slowest accepted spec's times (never asserted: the
//! tests hold deterministic proxies instead, the number of events and of simulated timelines).

use std::cell::RefCell;
use std::time::{Duration, Instant};

use ditmem_budget::{
    estimate, plan, Allow, DeviceProfile, Limits, Spec, SpecError, DEFAULT_HEADROOM,
    MAX_ACCUMULATION, MAX_DEPTH, MAX_MICROBATCH, MAX_RANKS,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// The suite draws the same cases every run (proptest's deterministic seed): a draw from entropy
/// once picked a spec near the caps whose plan search ran for over 18 minutes, and CI must take
/// the same time and find the same failures on every run. `DITMEM_FUZZ_CASES` (a long run)
/// draws from entropy.
#[path = "../../engine/tests/common/fuzz_runner.rs"]
mod fuzz_runner;
use fuzz_runner::{fuzz_cases as cases, fuzz_runner};

/// proptest's default shrink bound: the runner of this file's properties.
fn runner(n: u32) -> TestRunner {
    fuzz_runner(n, Config::default().max_shrink_iters)
}

fn report() -> bool {
    std::env::var_os("DITMEM_FUZZ_REPORT").is_some()
}

/// Every field a spec document can hold, by section.
const FIELDS: [(&str, &[&str]); 5] = [
    (
        "model",
        &[
            "name",
            "depth",
            "hidden",
            "heads",
            "patch",
            "in_channels",
            "mlp_ratio",
            "num_classes",
            "class_dropout_prob",
            "learn_sigma",
            "freq_embed",
            "attn_dropout",
            "mlp_dropout",
        ],
    ),
    (
        "workload",
        &[
            "height",
            "width",
            "vae_factor",
            "latent_channels",
            "batch",
            "microbatch",
            "accumulation",
            "ranks",
        ],
    ),
    (
        "recipe",
        &[
            "precision",
            "optimizer",
            "attention",
            "recompute",
            "zero_stage",
            "latents",
            "prediction",
        ],
    ),
    ("recipe.ema", &["enabled", "dtype", "decay"]),
    ("cpu", &["threads", "bf16_products", "gemm_l2_bytes"]),
];

/// Values a hostile but honest user types, as TOML text (JSON text is derived from them).
fn hostile_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just("-1".to_string()),
        Just("1".to_string()),
        Just("4294967295".to_string()),
        Just("4294967296".to_string()),
        Just("18446744073709551616".to_string()),
        Just("16777216".to_string()),
        Just("1048577".to_string()),
        Just("nan".to_string()),
        Just("inf".to_string()),
        Just("-inf".to_string()),
        Just("1e400".to_string()),
        Just("0.5".to_string()),
        Just("true".to_string()),
        Just("\"\"".to_string()),
        Just("\"all\"".to_string()),
        Just("\"blocks:\"".to_string()),
        Just("\"blocks:0,99999999999\"".to_string()),
        Just("\"every-0\"".to_string()),
        Just("\"bf16-pure\"".to_string()),
        Just("\"pytorch:cuda:flash\"".to_string()),
        Just("[1, 2]".to_string()),
        Just("{ a = 1 }".to_string()),
        (1usize..6000).prop_map(|n| format!("\"{}\"", "x".repeat(n))),
        any::<i64>().prop_map(|v| v.to_string()),
        any::<u32>().prop_map(|v| v.to_string()),
        any::<f64>().prop_map(|v| format!("{v:?}")),
        "[a-z\\\\\"\\n\\u{0}-\\u{7f}]{0,40}".prop_map(|s| format!("{s:?}")),
    ]
}

/// A valid document (the embedded default or the small spec) as (section, key, value) lines,
/// with some lines replaced by hostile values, some removed, some unknown keys added.
fn document() -> impl Strategy<Value = Vec<(String, String, String)>> {
    let with_cpu = {
        let mut s = Spec::small();
        s.cpu = Some(ditmem_budget::CpuSpec::REFERENCE);
        s
    };
    let base = prop_oneof![
        Just(Spec::default_xl()),
        Just(Spec::small()),
        Just(with_cpu)
    ];
    let edits = prop::collection::vec(
        (0usize..FIELDS.len(), 0usize..13, hostile_value(), 0u8..10),
        0..8,
    );
    (base, edits).prop_map(|(spec, edits)| {
        let v = serde_json::to_value(&spec).unwrap();
        let mut lines: Vec<(String, String, String)> = Vec::new();
        for (section, keys) in FIELDS {
            let obj = section.split('.').fold(&v, |o, k| &o[k]);
            for k in keys {
                let val = &obj[*k];
                if !val.is_null() {
                    lines.push((section.into(), (*k).into(), val.to_string()));
                }
            }
        }
        lines.push(("".into(), "runtime".into(), v["runtime"].to_string()));
        for (si, ki, value, how) in edits {
            let (section, keys) = FIELDS[si];
            let key = keys[ki % keys.len()].to_string();
            match how {
                0 => lines.retain(|(s, k, _)| !(s == section && *k == key)),
                1 => lines.push((section.into(), format!("unknown_{key}"), value)),
                2 => lines.push(("bogus".into(), key, value)),
                _ => {
                    lines.retain(|(s, k, _)| !(s == section && *k == key));
                    lines.push((section.into(), key, value));
                }
            }
        }
        lines
    })
}

fn to_toml(lines: &[(String, String, String)]) -> String {
    let mut out = String::new();
    for (_, k, v) in lines.iter().filter(|l| l.0.is_empty()) {
        out.push_str(&format!("{k} = {v}\n"));
    }
    let mut sections: Vec<&str> = lines
        .iter()
        .map(|l| l.0.as_str())
        .filter(|s| !s.is_empty())
        .collect();
    sections.dedup();
    for sec in sections {
        out.push_str(&format!("[{sec}]\n"));
        for (_, k, v) in lines.iter().filter(|l| l.0 == sec) {
            out.push_str(&format!("{k} = {v}\n"));
        }
    }
    out
}

/// The same lines as JSON (TOML's `nan`, `inf` and inline tables stay as they are: JSON has no
/// such values, so they must come back as parse errors).
fn to_json(lines: &[(String, String, String)]) -> String {
    let mut root = serde_json::Map::new();
    let mut raw: Vec<String> = Vec::new();
    for (s, k, v) in lines {
        let value = serde_json::from_str::<serde_json::Value>(v);
        let mut obj = &mut root;
        for part in s.split('.').filter(|p| !p.is_empty()) {
            obj = obj
                .entry(part.to_string())
                .or_insert_with(|| serde_json::Value::Object(Default::default()))
                .as_object_mut()
                .expect("sections are objects");
        }
        match value {
            Ok(val) => {
                obj.insert(k.clone(), val);
            }
            Err(_) => raw.push(format!("\"{k}\": {v}")),
        }
    }
    let mut text = serde_json::Value::Object(root).to_string();
    if !raw.is_empty() {
        // Splice the values JSON cannot hold into the top level, as a user would type them.
        text.pop();
        text.push_str(&format!(",{}}}", raw.join(",")));
    }
    text
}

fn check_parse(r: Result<Spec, SpecError>) -> Result<(), TestCaseError> {
    match r {
        Ok(spec) => {
            // Accepted: valid, and the budget of it works.
            prop_assert!(spec.validate().is_ok());
            let b = estimate(&spec);
            prop_assert!(b.is_ok(), "{:?}", b.err());
        }
        Err(e) => {
            let msg = e.to_string();
            // Typed and non-empty; an echoed value may hold a control character here, the CLI
            // escapes it into one line (`flags::tidy`, held by the CLI property test).
            prop_assert!(!msg.is_empty());
            let typed = matches!(e, SpecError::Invalid { .. } | SpecError::Parse { .. });
            prop_assert!(typed, "{msg}");
            if let Some(f) = e.field() {
                prop_assert!(msg.starts_with(f), "{msg}");
                prop_assert!(msg.contains("allowed"), "says what is allowed: {msg}");
            }
        }
    }
    Ok(())
}

/// (a) Random TOML and JSON documents over the spec's fields with hostile values: `Ok` or a
/// typed [`SpecError`] of one line, never a panic.
#[test]
fn spec_documents_parse_or_fail_with_a_typed_error() {
    let n = cases(256);
    let mut r = runner(n);
    let stats = RefCell::new((0u32, 0u32));
    r.run(&document(), |lines| {
        let toml_r = Spec::from_toml(&to_toml(&lines));
        let json_r = Spec::from_json(&to_json(&lines));
        if toml_r.is_ok() {
            stats.borrow_mut().0 += 1;
        } else {
            stats.borrow_mut().1 += 1;
        }
        check_parse(toml_r)?;
        check_parse(json_r)?;
        Ok(())
    })
    .unwrap();
    let stats = stats.into_inner();
    if report() {
        eprintln!(
            "spec documents: {n} cases × (TOML, JSON); TOML accepted {}, refused {}",
            stats.0, stats.1
        );
    }
}

/// Sizes near the small end and near the caps.
fn size(small: std::ops::RangeInclusive<u32>, cap: u32) -> impl Strategy<Value = u32> {
    prop_oneof![
        4 => small,
        1 => (cap - cap / 64)..=cap,
    ]
}

/// Specs near the caps: most pass validation, the rest are skipped (counted). The engine
/// runtime's CPU section spans its range too (threads, bf16 path, gemm's slab).
fn spec_near_caps() -> impl Strategy<Value = Spec> {
    let cpu = (
        size(1..=8, ditmem_budget::CpuSpec::MAX_THREADS),
        any::<bool>(),
        prop_oneof![
            Just(ditmem_budget::CpuSpec::GEMM_L2_RANGE.0),
            Just(1u64 << 20),
            Just(ditmem_budget::CpuSpec::GEMM_L2_RANGE.1)
        ],
    )
        .prop_map(|(threads, kernel, l2)| ditmem_budget::CpuSpec {
            threads,
            bf16_products: if kernel {
                ditmem_budget::Bf16Products::Kernel
            } else {
                ditmem_budget::Bf16Products::Widen
            },
            gemm_l2_bytes: l2,
            gemm_isa: ditmem_budget::GemmIsa::Avx512,
            ..ditmem_budget::CpuSpec::REFERENCE
        });
    (spec_near_caps_without_cpu(), cpu).prop_map(|(mut s, cpu)| {
        if s.runtime == ditmem_budget::Runtime::DitmemCpu {
            s.cpu = Some(cpu);
        }
        s
    })
}

fn spec_near_caps_without_cpu() -> impl Strategy<Value = Spec> {
    (
        (
            size(1..=6, MAX_DEPTH),
            prop_oneof![Just(1u32), Just(4), Just(16), Just(64)],
            prop_oneof![Just(8u32), Just(64), Just(128)],
            prop_oneof![Just(1u32), Just(2), Just(8)],
            1u32..=8,
            prop_oneof![4 => 1u32..=4, 1 => Just(64u32)],
        ),
        (
            size(1..=4, MAX_MICROBATCH),
            size(1..=6, MAX_ACCUMULATION),
            size(1..=2, MAX_RANKS),
            0u8..=3,
        ),
        (
            prop::sample::select(vec![
                "fp64",
                "fp32",
                "bf16-mixed",
                "fp16-mixed",
                "bf16-pure",
            ]),
            prop::sample::select(vec!["materialized", "memory-efficient"]),
            prop::sample::select(vec![
                "none",
                "all",
                "attention-only",
                "every-3",
                "blocks:0,2",
            ]),
            any::<bool>(),
            any::<bool>(),
            prop::sample::select(vec!["ditmem-cpu", "pytorch", "pytorch:cuda:flash"]),
        ),
    )
        .prop_map(
            |((depth, heads, head_dim, patch, rows, mlp), (micro, acc, ranks, zero), r)| {
                let (precision, attention, recompute, lora, encode, runtime) = r;
                let mut s = Spec::default_xl();
                s.model.depth = depth;
                s.model.heads = heads;
                s.model.hidden = heads * head_dim;
                s.model.patch = patch;
                s.model.mlp_ratio = mlp;
                s.workload.height = 8 * patch * rows;
                s.workload.width = 8 * patch * (rows + 1);
                s.workload.microbatch = micro;
                s.workload.accumulation = acc;
                s.workload.ranks = ranks;
                s.workload.batch = micro.saturating_mul(acc).saturating_mul(ranks);
                s.recipe.zero_stage = if ranks > 1 { zero } else { 0 };
                s.recipe.precision = precision.parse().unwrap();
                s.recipe.attention = attention.parse().unwrap();
                s.recipe.recompute = recompute.parse().unwrap();
                if lora {
                    s.recipe.lora = Some(ditmem_budget::LoraSpec {
                        dtype: Default::default(),
                        rank: 4.min(s.model.hidden),
                        targets: ditmem_budget::default_lora_targets(),
                        modules: Vec::new(),
                    });
                }
                if encode {
                    s.recipe.latents = ditmem_budget::Latents::Encode;
                }
                s.runtime = runtime.parse().unwrap();
                s
            },
        )
}

/// Events per block of one laid-out microbatch, forward and backward, at most (a recomputed
/// block adds its rebuild, a landing its own moment), and the events outside the blocks.
const EVENTS_PER_BLOCK: usize = 8;
const EVENTS_OUTSIDE_BLOCKS: usize = 16;

/// (b) Any spec that passes validation, near the caps too: `estimate` and `plan` (with a budget
/// and allow lists) never panic, and their work is bounded: the timeline's events grow with the
/// depth only (two microbatches whatever the accumulation), the plan's timelines with the
/// number of combinations and the logarithm of the depth.
#[test]
fn estimate_and_plan_of_any_valid_spec_are_bounded() {
    let n = cases(48);
    let mut r = runner(n);
    let profile = DeviceProfile::cpu_default();
    let slowest_estimate = RefCell::new((Duration::ZERO, String::new()));
    let slowest_plan = RefCell::new((Duration::ZERO, String::new()));
    let counts = RefCell::new((0u32, 0u32));
    let strategy = (
        spec_near_caps(),
        prop::sample::select(vec![1u64 << 20, 24 << 30, 1 << 40, 1 << 60]),
        any::<[bool; 4]>(),
    );
    r.run(&strategy, |(spec, budget, allow)| {
        if spec.validate().is_err() {
            counts.borrow_mut().1 += 1;
            return Ok(());
        }
        counts.borrow_mut().0 += 1;
        let what = format!(
            "depth {} hidden {} {}×{} micro {} acc {} ranks {} {} {}",
            spec.model.depth,
            spec.model.hidden,
            spec.workload.height,
            spec.workload.width,
            spec.workload.microbatch,
            spec.workload.accumulation,
            spec.workload.ranks,
            spec.recipe.precision,
            spec.runtime
        );
        let t0 = Instant::now();
        let b = estimate(&spec);
        let te = t0.elapsed();
        prop_assert!(b.is_ok(), "{what}: {:?}", b.err());
        let b = b.unwrap();
        let depth = spec.model.depth as usize;
        prop_assert!(b.timeline.laid_out <= 2);
        prop_assert!(
            b.timeline.events.len()
                <= 2 * (EVENTS_PER_BLOCK * depth + EVENTS_OUTSIDE_BLOCKS) + EVENTS_OUTSIDE_BLOCKS,
            "{what}: {} events",
            b.timeline.events.len()
        );
        prop_assert!(b.peak_bytes >= b.timeline.events[0].total());
        let limits = Limits {
            budget_bytes: budget,
            headroom: DEFAULT_HEADROOM,
            allow: Allow {
                lora: allow[0],
                eight_bit: allow[1],
                sharding: allow[2],
                bf16_pure: allow[3],
                precision: true,
                quant: allow[0],
            },
        };
        let t0 = Instant::now();
        let p = plan(&spec, &limits, &profile);
        let tp = t0.elapsed();
        prop_assert!(p.is_ok(), "{what}: {:?}", p.err());
        let p = p.unwrap();
        // Precisions × attention × microbatch sizes × latents × (LoRA × optimizer over the
        // planner's four stages: 1 + 2 + 2 + 4) × ZeRO.
        prop_assert!(p.combinations <= 5 * 2 * ditmem_budget::PLAN_MAX_MICROBATCHES * 2 * 9 * 4);
        let log_depth = (u32::BITS - spec.model.depth.leading_zeros()) as usize;
        prop_assert!(
            p.evaluated <= 4 + p.combinations * (5 + 2 * log_depth),
            "{what}: {} timelines for {} combinations",
            p.evaluated,
            p.combinations
        );
        prop_assert!(p.predicted_peak_bytes > 0);
        if te > slowest_estimate.borrow().0 {
            *slowest_estimate.borrow_mut() = (te, what.clone());
        }
        if tp > slowest_plan.borrow().0 {
            *slowest_plan.borrow_mut() =
                (tp, format!("{what}, budget {budget} B, allow {allow:?}"));
        }
        Ok(())
    })
    .unwrap();
    let (counts, slowest_estimate, slowest_plan) = (
        counts.into_inner(),
        slowest_estimate.into_inner(),
        slowest_plan.into_inner(),
    );
    // Most generated specs are valid: the property is not vacuous.
    assert!(
        counts.0 >= counts.1 / 4,
        "accepted {} skipped {}",
        counts.0,
        counts.1
    );
    if report() {
        eprintln!(
            "valid specs: {n} cases, {} accepted, {} skipped; slowest estimate {:.3} s ({}); \
             slowest plan {:.3} s ({})",
            counts.0,
            counts.1,
            slowest_estimate.0.as_secs_f64(),
            slowest_estimate.1,
            slowest_plan.0.as_secs_f64(),
            slowest_plan.1
        );
    }
}
