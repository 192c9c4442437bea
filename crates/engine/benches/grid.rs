//! Step time and measured peak for the precision × recompute × attention grid on one small spec,
//! side by side in one run (not a timed test: nothing is asserted).
//!
//! `cargo bench -p ditmem-engine --bench grid` (release profile). Environment: `GRID_STEPS`
//! (measured steps, default 3), `GRID_DEPTH` (default 4), `GRID_RES` (image side, default 256).

use ditmem_budget::{AttentionMode, Precision, Recompute, Spec};
use ditmem_engine::{run, CountingAlloc, RunOptions};

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

fn env(name: &str, default: u32) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn main() {
    ditmem_engine::threads::configure_before_threads();
    ditmem_engine::malloc::one_arena();
    let steps = env("GRID_STEPS", 3);
    let mut base = Spec::default_xl();
    base.model.name = "grid".into();
    base.model.depth = env("GRID_DEPTH", 4);
    base.model.hidden = 128;
    base.model.heads = 4;
    base.model.patch = 2;
    base.model.num_classes = 10;
    let res = env("GRID_RES", 256);
    base.workload.height = res;
    base.workload.width = res;
    base.workload.batch = 2;
    base.workload.microbatch = 2;
    base.recipe.ema.enabled = false;
    if let Err(e) = base.validate() {
        eprintln!("invalid grid spec: {e}");
        std::process::exit(2);
    }
    println!(
        "spec: depth {}, hidden {}, heads {}, patch {}, {}×{} images ({} tokens), batch {}, AdamW; {} measured steps after 1 warm-up; threads {}",
        base.model.depth,
        base.model.hidden,
        base.model.heads,
        base.model.patch,
        res,
        res,
        base.tokens().unwrap_or(0),
        base.workload.batch,
        steps,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    println!(
        "{:<11} {:<15} {:<17} {:>10} {:>12} {:>12} {:>12} {:>12}",
        "precision",
        "recompute",
        "attention",
        "step p50 s",
        "peak MiB",
        "fwd MiB",
        "bwd MiB",
        "optim MiB"
    );
    for precision in [
        Precision::Fp32,
        Precision::Bf16Mixed,
        Precision::Fp16Mixed,
        Precision::Bf16Pure,
        Precision::Fp64,
    ] {
        for recompute in [Recompute::None, Recompute::All, Recompute::AttentionOnly] {
            for attention in [AttentionMode::Materialized, AttentionMode::MemoryEfficient] {
                if recompute == Recompute::AttentionOnly
                    && attention == AttentionMode::MemoryEfficient
                {
                    continue; // memory-efficient attention stores no probabilities anyway
                }
                let mut s = base.clone();
                s.recipe.precision = precision;
                s.recipe.recompute = recompute.clone();
                s.recipe.attention = attention;
                let opts = RunOptions {
                    warmup: 1,
                    steps,
                    ..RunOptions::default()
                };
                match run(&s, &opts, Some(&A), &mut |_| true) {
                    Ok(m) => {
                        let mut t = m.step_times_s.clone();
                        t.sort_by(f64::total_cmp);
                        let p50 = t[t.len() / 2];
                        println!(
                            "{:<11} {:<15} {:<17} {:>10.3} {:>12.2} {:>12.2} {:>12.2} {:>12.2}",
                            precision.name(),
                            recompute.to_string(),
                            attention.name(),
                            p50,
                            mib(m.peak_bytes),
                            mib(m.phase_peak_bytes.forward),
                            mib(m.phase_peak_bytes.backward),
                            mib(m.phase_peak_bytes.optimizer)
                        );
                    }
                    Err(e) => println!(
                        "{:<11} {:<15} {:<17} error: {e}",
                        precision.name(),
                        recompute.to_string(),
                        attention.name()
                    ),
                }
            }
        }
    }
}
