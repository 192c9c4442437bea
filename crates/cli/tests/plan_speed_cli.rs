//! The planner made faster gives the same answers: for each query below, `ditmem plan --json`
//! equals what the base commit's binary (95ad019, before the search was sped up) printed — the
//! chosen plan, its peak, breakdown, time, changes, reason, the Pareto front, the alternatives and
//! the base's figures — all but the search's own statistics (`search_ms`, `evaluated`) and the
//! profile's serialisation. The reference is `data/plan_speed/golden.json`, written by
//! `bench/plan_speed/golden.py BINARY` (its keys are the queries, listed once in `golden_queries.py`). A
//! deliberate change of the model's figures regenerates it from the new binary, saying why.
//! No timing is asserted (`bench/plan_speed/` measures them).

mod common;

use common::ditmem_env;

/// The reference: each query (as its flags) and the plan's figures. The queries are its keys, so
/// the list lives once, in `bench/plan_speed/golden_queries.py` (no `--runtime ditmem-cpu` query:
/// that budget follows the host CPU — threads, the gemm's ISA and L1/L2 sizes, the bf16 kernel —
/// so a reference written on one machine would fail on another).
fn golden() -> serde_json::Map<String, serde_json::Value> {
    match serde_json::from_str(include_str!("data/plan_speed/golden.json")) {
        Ok(serde_json::Value::Object(map)) => map,
        other => panic!("golden.json is not an object of plans: {other:?}"),
    }
}

/// The queries of the reference, in its (sorted) order; the DiTs on one card come first.
fn queries() -> Vec<String> {
    let q: Vec<String> = golden().keys().cloned().collect();
    assert!(q.len() >= 7, "golden.json holds {} queries", q.len());
    q
}

const DROP: [&str; 3] = ["search_ms", "evaluated", "profile"];

/// Each query's `plan --json` under `env`, less the dropped keys, compared with golden.json;
/// the queries whose figures differ.
fn differing(env: &[(&str, &str)], queries: &[String]) -> Vec<String> {
    let golden = golden();
    let mut differ = Vec::new();
    for q in queries {
        let mut args = vec!["plan", "--json", "--time-limit", "600"];
        args.extend(q.split_whitespace());
        let (code, out, err) = ditmem_env(env, &args);
        let mut got: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{q}: {e}\n{out}\n{err}"));
        let obj = got.as_object_mut().expect("a plan object");
        for k in DROP {
            obj.remove(k);
        }
        obj.insert("exit".into(), code.into());
        let want = &golden[q.as_str()];
        assert!(want.is_object(), "{q}: not in golden.json");
        // Keys added to the plan's JSON after the reference was written (e.g. `launcher`) are
        // not part of the search it pins.
        obj.retain(|k, _| want.get(k).is_some());
        if &got != want {
            let keys: Vec<&String> = want
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, v)| got.get(k.as_str()) != Some(v))
                .map(|(k, _)| k)
                .collect();
            differ.push(format!("{q}: {keys:?}"));
        }
    }
    differ
}

#[test]
fn plans_equal_the_reference_search() {
    let differ = differing(&[], &queries());
    assert!(
        differ.is_empty(),
        "plans differ from the reference:\n{}",
        differ.join("\n")
    );
}

/// Replays one at a time (`DITMEM_PLAN_THREADS=1`) or four side by side give the same plans.
#[test]
fn plans_do_not_depend_on_the_replay_threads() {
    for threads in ["1", "4"] {
        let differ = differing(&[("DITMEM_PLAN_THREADS", threads)], &queries()[..4]);
        assert!(
            differ.is_empty(),
            "with {threads} thread(s) plans differ from the reference:\n{}",
            differ.join("\n")
        );
    }
}

/// The second reference: `estimate --json`'s answer beyond the budget — what has to fit,
/// whether it does, the CUDA report and every lever row — for each query of
/// `data/plan_speed/estimate_golden.json` (written by `bench/plan_speed/golden_estimate.py`
/// from 8dcd2a5's binary, before the lever ranking kept its evaluations; `ESTIMATE_KEYS` and the
/// queries are listed once in `golden_queries.py`); the queries whose answer differs.
fn estimates_differing(env: &[(&str, &str)]) -> Vec<String> {
    let golden: serde_json::Map<String, serde_json::Value> =
        match serde_json::from_str(include_str!("data/plan_speed/estimate_golden.json")) {
            Ok(serde_json::Value::Object(map)) => map,
            other => panic!("estimate_golden.json is not an object of answers: {other:?}"),
        };
    assert!(
        golden.len() >= 8,
        "estimate_golden.json holds {}",
        golden.len()
    );
    let mut differ = Vec::new();
    for (q, want) in &golden {
        let mut args = vec!["estimate", "--json"];
        args.extend(q.split_whitespace());
        let (code, out, err) = ditmem_env(env, &args);
        let got: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{q}: {e}\n{out}\n{err}"));
        let want = want.as_object().expect("an answer object");
        let keys: Vec<&String> = want
            .iter()
            .filter(|(k, v)| match k.as_str() {
                "exit" => *v != &serde_json::Value::from(code),
                k => got.get(k).unwrap_or(&serde_json::Value::Null) != *v,
            })
            .map(|(k, _)| k)
            .collect();
        if !keys.is_empty() {
            differ.push(format!("{q}: {keys:?}"));
        }
    }
    differ
}

/// Lever rows (and what has to fit) equal the reference, with the levers budgeted one at a
/// time and side by side.
#[test]
fn estimates_equal_the_reference_levers() {
    for threads in ["1", "4"] {
        let differ = estimates_differing(&[("DITMEM_PLAN_THREADS", threads)]);
        assert!(
            differ.is_empty(),
            "with {threads} thread(s) estimates differ from the reference:\n{}",
            differ.join("\n")
        );
    }
}
