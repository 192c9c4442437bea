//! Timing of the full planner search for DiT-XL/2 (a plain `harness = false` bench: N runs,
//! p50/p95/p99 printed with the conditions; nothing is asserted).
//!
//! `cargo bench -p ditmem-budget --bench plan`. Environment: `PLAN_RUNS` (timed runs per case,
//! default 50; one untimed warm-up run precedes them).

use std::time::Instant;

use ditmem_budget::DeviceProfile;
use ditmem_budget::Spec;
use ditmem_budget::{plan, Allow, Limits, DEFAULT_HEADROOM};

/// The CPU's model name for the conditions line. The budget never reads the host, and it cannot
/// depend on the engine (whose `host::cpu_model` the other benches use), so its bench reads
/// `/proc/cpuinfo` itself.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i]
}

fn main() {
    let runs: usize = std::env::var("PLAN_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(50);
    let profile = DeviceProfile::cpu_default();
    println!(
        "conditions: {}, {} build, {} hardware threads available (the search is single-threaded), {} timed runs per case after 1 warm-up, profile {}",
        cpu_model(),
        if cfg!(debug_assertions) { "debug" } else { "release" },
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        runs,
        profile.name,
    );
    println!(
        "{:<44} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "case (plan() incl. alternatives)", "timelines", "p50 ms", "p95 ms", "p99 ms", "max ms"
    );
    let none = Allow::default();
    let all = Allow::all();
    let cases: Vec<(String, u32, u32, u64, Allow)> = vec![
        ("256², batch 32, 24 GiB".into(), 256, 1, 24, none),
        ("512², batch 32, 24 GiB".into(), 512, 1, 24, none),
        ("512², batch 32, 80 GiB".into(), 512, 1, 80, none),
        (
            "512², batch 32, 24 GiB, --allow all, 8 ranks".into(),
            512,
            8,
            24,
            all,
        ),
        (
            "512², batch 32, 4 GiB (infeasible), --allow all".into(),
            512,
            1,
            4,
            all,
        ),
    ];
    for (name, res, ranks, gib, allow) in cases {
        let mut spec = Spec::default_xl();
        spec.workload.height = res;
        spec.workload.width = res;
        spec.workload.ranks = ranks;
        spec.workload.microbatch = spec.workload.batch / ranks;
        let limits = Limits {
            budget_bytes: gib << 30,
            headroom: DEFAULT_HEADROOM,
            allow,
        };
        let warm = match plan(&spec, &limits, &profile) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("{name}: {e}");
                std::process::exit(2);
            }
        };
        let mut ms = Vec::with_capacity(runs);
        for _ in 0..runs {
            let t = Instant::now();
            let p = plan(&spec, &limits, &profile).expect("same input as the warm-up");
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            std::hint::black_box(p);
        }
        ms.sort_by(f64::total_cmp);
        println!(
            "{:<44} {:>10} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
            name,
            warm.evaluated,
            percentile(&ms, 0.5),
            percentile(&ms, 0.95),
            percentile(&ms, 0.99),
            ms[ms.len() - 1],
        );
    }
}
