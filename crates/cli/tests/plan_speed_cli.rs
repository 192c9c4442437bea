//! The planner made faster gives the same answers: for each query below, `ditmem plan --json`
//! equals what the base commit's binary (95ad019, before the search was sped up) printed — the
//! chosen plan, its peak, breakdown, time, changes, reason, the Pareto front, the alternatives and
//! the base's figures — all but the search's own statistics (`search_ms`, `evaluated`) and the
//! profile's serialisation. The reference is `data/plan_speed/golden.json`, written by
//! `bench/plan_speed/golden.py BINARY` (its query list, `golden_queries.py`, is this one). A
//! deliberate change of the model's figures regenerates it from the new binary, saying why.
//! No timing is asserted (`bench/plan_speed/` measures them).

mod common;

use common::ditmem_env;

// No `--runtime ditmem-cpu` query: that budget follows the host CPU (threads, the gemm's ISA and
// L1/L2 sizes, the bf16 kernel), so a reference written on one machine would fail on another.
const QUERIES: [&str; 7] = [
    "--preset dit-xl-2 --resolution 512 --batch 32 --budget 24GiB --runtime pytorch:cuda",
    "--preset dit-xl-2 --batch 128 --gpu h100-sxm --ema on",
    "--preset dit-b-2 --batch 64 --gpu t4",
    "--preset dit-l-2 --resolution 512 --batch 16 --gpu rtx-4090 --allow 8bit",
    "--preset dit-xl-2 --resolution 512 --batch 64 --ranks 4 --gpu rtx-3090 --allow all",
    "--preset flux.1-dev --gpu rtx-4090 --allow lora,8bit,quant",
    "--preset sd3.5-medium --ranks 8 --gpu h100-sxm --allow all",
];

const DROP: [&str; 3] = ["search_ms", "evaluated", "profile"];

/// Each query's `plan --json` under `env`, less the dropped keys, compared with golden.json;
/// the queries whose figures differ.
fn differing(env: &[(&str, &str)], queries: &[&str]) -> Vec<String> {
    let golden: serde_json::Value =
        serde_json::from_str(include_str!("data/plan_speed/golden.json"))
            .expect("golden.json parses");
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
        let want = &golden[*q];
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
    let differ = differing(&[], &QUERIES);
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
        let differ = differing(&[("DITMEM_PLAN_THREADS", threads)], &QUERIES[..4]);
        assert!(
            differ.is_empty(),
            "with {threads} thread(s) plans differ from the reference:\n{}",
            differ.join("\n")
        );
    }
}
