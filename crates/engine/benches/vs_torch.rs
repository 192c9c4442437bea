//! The ditmem engine against the PyTorch peer (`bench/torch_peer/peer.py`), side by side in one
//! run on the same spec and threads, swept over sizes (issue 20): DiT at 256² with batch 1, 2, 4,
//! 8, 16 and at 512² with batch 1, 4, each in fp32 and bf16-mixed × no recompute and
//! recompute-all × both attention modes. Engine and peer alternate `VS_ROUNDS` times per row, so a
//! burst of load from elsewhere lands on both. Prints, per row, the step peak (total, and above
//! the resident model state) and the step time p50 of both, as ratios engine/PyTorch (the median
//! of the rounds and the range of the per-round ratios), the ratio of CPU seconds per step (every
//! thread; what other load on a shared machine moves least), and the achieved GFLOP/s of model FLOPs
//! against this machine's matmul rate in the step's dtype (f32 through candle/gemm; bf16 through
//! the engine's AVX512-BF16 kernel, packing included, where the CPU has it) measured at that size
//! in the same run; then a summary of every row's median ratios and the worst of them. Nothing is
//! asserted: timings are printed with their conditions (CPU model, caches, threads, load).
//!
//! `cargo bench -p ditmem-engine --bench vs_torch`. Environment (every one optional):
//! - `VS_SIZES`: the sizes, `RESxBATCH` comma-separated (default the sweep
//!   `256x1,256x2,256x4,256x8,256x16,512x1,512x4`); `VS_RES` / `VS_BATCH` without `VS_SIZES`
//!   give one size (default 256 and 2).
//! - `VS_PRECISION` (`fp32,bf16-mixed`), `VS_RECOMPUTE` (`none,all`), `VS_ATTENTION`
//!   (`materialized,memory-efficient`): comma-separated subsets; `VS_ONLY`: a substring of the
//!   row names (e.g. `256x8 fp32`).
//! - `VS_PRESET` (dit-s-2), `VS_EMA` (`off`, issue 20's condition; `on`), `VS_WARMUP` (1),
//!   `VS_STEPS` (5), `VS_ROUNDS` (3), `VS_THREADS` (all cores; exported as `RAYON_NUM_THREADS`
//!   for the engine and `--threads` for the peer), `VS_PYTHON`
//!   (bench/torch_peer/.venv/bin/python).
//!
//! The peer runs with `OMP_WAIT_POLICY=PASSIVE`. Without the peer's virtualenv the PyTorch
//! columns say so and the engine still runs.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use candle_core::{Device, Tensor};
use ditmem_budget::{AttentionMode, ModelSpec, Precision, Recompute, Spec};
use ditmem_engine::{run, CountingAlloc, RunOptions};

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

fn env<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// f32 matmul rate (FLOP/s) through candle at the spec's fc1 shape: (median, best) of 25 runs.
/// The best is the yardstick for the model FLOP rate (it is the least disturbed by other load on
/// the machine).
fn matmul_rate(rows: usize, d: usize, mlp: usize) -> candle_core::Result<(f64, f64)> {
    let dev = Device::Cpu;
    let a = Tensor::randn(0f32, 1.0, (rows, d), &dev)?;
    let b = Tensor::randn(0f32, 1.0, (d, mlp), &dev)?;
    let _ = a.matmul(&b)?;
    let mut t = Vec::new();
    for _ in 0..25 {
        let t0 = Instant::now();
        let _ = a.matmul(&b)?;
        t.push(t0.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    let f = 2.0 * (rows * d * mlp) as f64;
    Ok((f / t[t.len() / 2], f / t[0]))
}

/// bf16 matmul rate (FLOP/s) of the engine's kernel (`gemm_bf16`, both operands packed per call
/// as the fused linear does) at the same shape: (median, best) of 25 runs; `None` without
/// AVX512-BF16.
fn bf16_rate(rows: usize, d: usize, mlp: usize) -> Option<(f64, f64)> {
    use ditmem_engine::kernels::gemm_bf16::{self as k, View};
    if !k::supported() {
        return None;
    }
    let mut r = ditmem_engine::rng::SplitMix64::new(7);
    let mut m = |n: usize| -> Vec<half::bf16> {
        (0..n)
            .map(|_| half::bf16::from_f64(r.uniform() - 0.5))
            .collect()
    };
    let (a, b) = (m(rows * d), m(d * mlp));
    let mut pa = vec![0u32; k::packed_a_len(rows, d)];
    let mut pb = vec![0u16; k::packed_b_len(d, mlp)];
    let mut c = vec![0f32; rows * mlp];
    let mut once = || {
        k::pack_a(
            rows,
            d,
            View {
                data: &a,
                rs: d,
                cs: 1,
            },
            &mut pa,
        );
        k::pack_b(
            d,
            mlp,
            View {
                data: &b,
                rs: mlp,
                cs: 1,
            },
            &mut pb,
        );
        c.iter_mut().for_each(|v| *v = 0.0);
        k::gemm_packed(rows, mlp, d, &pa, &pb, &mut c, mlp);
    };
    once();
    let mut t: Vec<f64> = (0..25)
        .map(|_| {
            let t0 = Instant::now();
            once();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    let f = 2.0 * (rows * d * mlp) as f64;
    Some((f / t[t.len() / 2], f / t[0]))
}

/// Runs `f` (the matmul rate measurements, each engine round) on a pool of `threads` threads
/// that is joined before this returns. candle's f32 products go through the `gemm` crate, which keeps an L2-sized scratch
/// slab per thread for the thread's life; measured on the engine's own pool (or the main thread)
/// those slabs stayed live through the rows and counted in the engine's step peak, a harness
/// allocation the run itself never made (256² b2 bf16-mixed recompute-all: 511.8 MiB here against
/// 509.8 MiB from `ditmem run` on the same spec). Scoped threads end, and free their slabs, before
/// the engine starts.
fn off_the_engines_heap<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_scoped(|worker| worker.run(), |pool| pool.install(f));
    match built {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vs_torch: a pool for the matmul rates: {e}");
            std::process::exit(2);
        }
    }
}

/// Model FLOPs of one optimizer step: forward + backward (2× forward) of every block and the
/// embed/final linears, recompute not counted (the usual model-FLOPs convention).
fn model_flops(spec: &Spec) -> f64 {
    let f = ditmem_budget::block_flops(spec);
    let d = ditmem_budget::Shape::new(spec);
    let rows = (d.b * d.s) as f64;
    let outer = 2.0 * rows * d.d as f64 * (d.c_in * d.patch2 + d.patch2 * d.c_out) as f64;
    let per_mb = 3.0 * (spec.model.depth as f64 * (f.linears + f.attention + f.lora) + outer);
    per_mb * spec.workload.accumulation as f64
}

struct Peer {
    peak: u64,
    above: u64,
    p50: f64,
    /// CPU seconds per step, every thread (p50).
    cpu_p50: f64,
    /// Wall seconds of the forward and of the backward (recomputed forwards included), p50.
    fwd_p50: f64,
    bwd_p50: f64,
    /// The peer's torch version and ATen CPU capability (its conditions).
    about: String,
}

fn run_peer(spec: &Spec, warmup: u32, steps: u32, threads: usize) -> Result<Peer, String> {
    let root = repo_root();
    let py = std::env::var("VS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("bench/torch_peer/.venv/bin/python"));
    if !py.exists() {
        return Err(format!(
            "no peer python at {} (bench/torch_peer/setup.sh)",
            py.display()
        ));
    }
    let f = std::env::temp_dir().join(format!("ditmem-vs-torch-{}.json", std::process::id()));
    let text = serde_json::to_string(spec).map_err(|e| e.to_string())?;
    std::fs::write(&f, text).map_err(|e| e.to_string())?;
    let out = Command::new(py)
        .arg(root.join("bench/torch_peer/peer.py"))
        .args(["--spec", &f.to_string_lossy()])
        .args([
            "--warmup",
            &warmup.to_string(),
            "--steps",
            &steps.to_string(),
        ])
        .args(["--threads", &threads.to_string()])
        .env("OMP_WAIT_POLICY", "PASSIVE")
        .output()
        .map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(&f);
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or("peer failed")
            .to_string());
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    let u = |k: &str| v[k].as_u64().ok_or_else(|| format!("peer JSON lacks {k}"));
    Ok(Peer {
        peak: u("peak_bytes")?,
        above: u("step_peak_above_resident")?,
        p50: v["step_time_s"]["p50"]
            .as_f64()
            .ok_or("peer JSON lacks step_time_s.p50")?,
        cpu_p50: v["step_cpu_time_s"]["p50"].as_f64().unwrap_or(f64::NAN),
        fwd_p50: v["phase_time_s"]["forward"]["p50"]
            .as_f64()
            .unwrap_or(f64::NAN),
        bwd_p50: v["phase_time_s"]["backward"]["p50"]
            .as_f64()
            .unwrap_or(f64::NAN),
        about: {
            let c = &v["conditions"];
            let s = |k: &str| c[k].as_str().unwrap_or("?").to_string();
            format!(
                "torch {}, ATen CPU capability {} (ATEN_CPU_CAPABILITY {}, ONEDNN_MAX_CPU_ISA {})",
                s("torch"),
                s("cpu_capability"),
                s("aten_cpu_capability_env"),
                s("onednn_max_cpu_isa_env")
            )
        },
    })
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// The median of `v` (NaN when empty; the mean of the middle two for an even count).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => f64::NAN,
        // An even count (2 rounds, the sweep's short setting) averages the middle two: the
        // upper one alone made one noisy round the row's figure (512x4 bf16: 0.88 and 1.25 → 1.25).
        _ if n.is_multiple_of(2) => 0.5 * (v[n / 2 - 1] + v[n / 2]),
        _ => v[n / 2],
    }
}

/// (lowest, highest) of `v`.
fn range(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

/// The comma-separated list in `VS_<key>`, or `default` where unset: the subset of a sweep axis
/// to run.
fn list(key: &str, default: &str) -> Vec<String> {
    std::env::var(key)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect()
}

/// The sweep's sizes as (resolution, batch): `VS_SIZES`, else one size from `VS_RES` /
/// `VS_BATCH` where either is set, else issue 20's sweep.
fn sizes() -> Result<Vec<(u32, u32)>, String> {
    let single = std::env::var("VS_RES").is_ok() || std::env::var("VS_BATCH").is_ok();
    let default = if single {
        format!("{}x{}", env("VS_RES", 256u32), env("VS_BATCH", 2u32))
    } else {
        "256x1,256x2,256x4,256x8,256x16,512x1,512x4".to_string()
    };
    list("VS_SIZES", &default)
        .iter()
        .map(|t| {
            let parsed = t
                .split_once('x')
                .and_then(|(r, b)| Some((r.parse().ok()?, b.parse().ok()?)));
            match parsed {
                Some((r, b)) if r > 0 && b > 0 => Ok((r, b)),
                _ => Err(format!(
                    "VS_SIZES: '{t}' is not RESxBATCH with both positive, e.g. 256x8"
                )),
            }
        })
        .collect()
}

/// Parses every entry of `VS_<key>` with `parse`, naming the variable and the allowed values on
/// a bad entry.
fn axis<T>(key: &str, default: &str, allowed: &str, parse: impl Fn(&str) -> Option<T>) -> Vec<T> {
    list(key, default)
        .iter()
        .map(|v| {
            parse(v).unwrap_or_else(|| {
                eprintln!("vs_torch: {key}: '{v}' is not one of {allowed}");
                std::process::exit(2)
            })
        })
        .collect()
}

/// One row's result: the engine's and the peer's figures, the medians over the rounds.
struct Row {
    name: String,
    time_ratio: f64,
    time_range: (f64, f64),
    /// The median over rounds of engine / peer CPU seconds per step (p50 each).
    cpu_ratio: f64,
    peak_ratio: Option<f64>,
}

/// Runs one configuration `rounds` times, engine then peer, and prints its line.
fn measure(
    name: &str,
    s: &Spec,
    (warmup, steps, rounds, threads): (u32, u32, u32, usize),
    (flops, rate): (f64, f64),
) -> Option<Row> {
    let mut e_p50s = Vec::new();
    let mut t_p50s = Vec::new();
    let mut cpu_ratios = Vec::new();
    // Per round: engine / peer wall seconds of the forward and of the backward (p50 each).
    let (mut fwd_ratios, mut bwd_ratios) = (Vec::new(), Vec::new());
    let mut last = None;
    let mut peer_last = None;
    for _ in 0..rounds {
        // On a fresh pool per round, as a process of its own would run it: `gemm`'s per-thread
        // slabs from an earlier row (an fp32 one) would otherwise count in this row's peak
        // (256² b2 bf16-mixed recompute-all after its fp32 row: 510.6 MiB against 508.6).
        let m = match off_the_engines_heap(threads, || {
            run(
                s,
                &RunOptions {
                    warmup,
                    steps,
                    ..RunOptions::default()
                },
                Some(&A),
                &mut |_| true,
            )
        }) {
            Ok(m) => m,
            Err(e) => {
                println!("{name:<44} engine failed: {e}");
                return None;
            }
        };
        e_p50s.push(median(&m.step_times_s));
        let peer = run_peer(s, warmup, steps, threads);
        match &peer {
            Ok(pe) => {
                t_p50s.push(pe.p50);
                cpu_ratios.push(median(&m.step_cpu_s) / pe.cpu_p50);
                let phase = |f: fn(&ditmem_engine::PhaseTimes) -> f64| {
                    median(&m.phase_times_s.iter().map(f).collect::<Vec<_>>())
                };
                fwd_ratios.push(phase(|p| p.forward) / pe.fwd_p50);
                bwd_ratios.push(phase(|p| p.backward) / pe.bwd_p50);
            }
            Err(_) => t_p50s.push(f64::NAN),
        }
        last = Some(m);
        peer_last = Some(peer);
    }
    let (m, peer) = (last?, peer_last?);
    if let Ok(pe) = &peer {
        // The peer's kernels, once per sweep (the same process settings every row).
        static PEER_ABOUT: std::sync::Once = std::sync::Once::new();
        PEER_ABOUT.call_once(|| println!("peer: {}", pe.about));
    }
    let ratios: Vec<f64> = e_p50s
        .iter()
        .zip(&t_p50s)
        .map(|(e, t)| e / t)
        .filter(|r| r.is_finite())
        .collect();
    let p50 = median(&e_p50s);
    let above = m.peak_bytes.saturating_sub(m.resident_bytes);
    let gf = flops / p50;
    cpu_ratios.retain(|r| r.is_finite());
    let cpu_ratio = median(&cpu_ratios);
    let (tp, tr, ta, tar, tt, ttr) = match &peer {
        Ok(pe) => {
            let t50 = median(&t_p50s);
            (
                format!("{:.1}", mib(pe.peak)),
                // Three decimals: the criterion is ≤ 1 and the rows near it differ by 0.1 %.
                format!("{:.3}", m.peak_bytes as f64 / pe.peak as f64),
                format!("{:.1}", mib(pe.above)),
                format!("{:.2}", above as f64 / pe.above.max(1) as f64),
                format!("{t50:.3}"),
                format!("{:.2}", median(&ratios)),
            )
        }
        Err(_) => Default::default(),
    };
    let mut line = format!(
        "{:>10.1} {tp:>10} {tr:>7} {:>10.1} {ta:>10} {tar:>7} {:>8.3} {tt:>8} {ttr:>7} {:>7} {:>9.2} {:>5.0}%",
        mib(m.peak_bytes),
        mib(above),
        p50,
        if cpu_ratio.is_finite() {
            format!("{cpu_ratio:.2}")
        } else {
            String::new()
        },
        gf / 1e9,
        100.0 * gf / rate
    );
    fwd_ratios.retain(|r: &f64| r.is_finite());
    bwd_ratios.retain(|r: &f64| r.is_finite());
    if !fwd_ratios.is_empty() && !bwd_ratios.is_empty() {
        line.push_str(&format!(
            "  fwd {:.2} bwd {:.2}",
            median(&fwd_ratios),
            median(&bwd_ratios)
        ));
    }
    let (lo, hi) = range(&ratios);
    if ratios.len() > 1 {
        line.push_str(&format!("  rounds {lo:.2}–{hi:.2}"));
    }
    if let Err(e) = &peer {
        line.push_str(&format!("  (peer: {e})"));
    }
    println!("{name:<44} {line}");
    Some(Row {
        name: name.to_string(),
        time_ratio: median(&ratios),
        time_range: (lo, hi),
        cpu_ratio,
        peak_ratio: peer
            .as_ref()
            .ok()
            .map(|pe| m.peak_bytes as f64 / pe.peak as f64),
    })
}

fn main() {
    ditmem_engine::threads::configure_before_threads();
    ditmem_engine::malloc::one_arena();
    let preset: String = env("VS_PRESET", "dit-s-2".to_string());
    let warmup: u32 = env("VS_WARMUP", 1);
    let steps: u32 = env("VS_STEPS", 5);
    let rounds: u32 = env("VS_ROUNDS", 3).max(1);
    let ema = env("VS_EMA", "off".to_string()) == "on";
    let threads: usize = env(
        "VS_THREADS",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let only: String = env("VS_ONLY", String::new());
    let sizes = sizes().unwrap_or_else(|e| {
        eprintln!("vs_torch: {e}");
        std::process::exit(2)
    });
    let precisions = axis(
        "VS_PRECISION",
        "fp32,bf16-mixed",
        "fp32, bf16-mixed",
        |v| match v {
            "fp32" => Some(Precision::Fp32),
            "bf16-mixed" => Some(Precision::Bf16Mixed),
            _ => None,
        },
    );
    let recomputes = axis("VS_RECOMPUTE", "none,all", "none, all", |v| match v {
        "none" => Some(Recompute::None),
        "all" => Some(Recompute::All),
        _ => None,
    });
    let attentions = axis(
        "VS_ATTENTION",
        "materialized,memory-efficient",
        "materialized, memory-efficient",
        |v| match v {
            "materialized" => Some(AttentionMode::Materialized),
            "memory-efficient" => Some(AttentionMode::MemoryEfficient),
            _ => None,
        },
    );
    // rayon reads this when its pool starts (the first parallel op below).
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());

    let mut base = Spec::default_xl();
    base.model = match ModelSpec::preset(&preset) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("vs_torch: {e}");
            std::process::exit(2);
        }
    };
    base.workload.accumulation = 1;
    base.recipe.ema.enabled = ema;
    let load = || {
        std::fs::read_to_string("/proc/loadavg")
            .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    };
    println!(
        "conditions: {}; {}; engine kernels: gemm {}, bf16 products {}, vector kernels {}; {threads} threads (RAYON_NUM_THREADS / torch --threads); OMP_WAIT_POLICY=PASSIVE for the peer; {} build; {}; warm-up {warmup}, {steps} measured steps (p50), {rounds} alternating round(s) per row (median of the rounds' p50, range of the per-round ratios); AdamW, EMA {}; engine malloc: {}; load average before: {}",
        ditmem_engine::host::cpu_model(),
        ditmem_engine::host::cache_summary(),
        ditmem_engine::host::gemm_isa().name(),
        ditmem_engine::host::detect().bf16_products.name(),
        ditmem_engine::kernels::vecmath::level(),
        if cfg!(debug_assertions) { "debug" } else { "release" },
        base.model.name,
        if ema { "on" } else { "off" },
        ditmem_engine::malloc::policy().describe(),
        load(),
    );
    let mut rows = Vec::new();
    for &(res, batch) in &sizes {
        let mut sized = base.clone();
        sized.workload.height = res;
        sized.workload.width = res;
        sized.workload.batch = batch;
        sized.workload.microbatch = batch;
        let d = ditmem_budget::Shape::new(&sized);
        let (r, k, n) = ((d.b * d.s) as usize, d.d as usize, d.mlp as usize);
        let (rate, rate16) = off_the_engines_heap(threads, || {
            (
                matmul_rate(r, k, n).map_or(f64::NAN, |(_, best)| best),
                bf16_rate(r, k, n).map(|(_, best)| best),
            )
        });
        println!(
            "\n{res}² batch {batch} ({} tokens): f32 matmul (candle/gemm, {r}×{k} · {k}×{n}, best of 25) {:.1} GFLOP/s; bf16 {}",
            d.s,
            rate / 1e9,
            rate16.map_or("no AVX512-BF16 kernel (widened to f32)".to_string(), |b| format!(
                "(engine kernel, packing included) {:.1} GFLOP/s",
                b / 1e9
            ))
        );
        println!(
            "{:<44} {:>10} {:>10} {:>7} {:>10} {:>10} {:>7} {:>8} {:>8} {:>7} {:>7} {:>9} {:>6}",
            "row",
            "peak MiB",
            "torch",
            "ratio",
            "step MiB",
            "torch",
            "ratio",
            "p50 s",
            "torch",
            "ratio",
            "cpu",
            "GFLOP/s",
            "of mm"
        );
        let flops = model_flops(&sized);
        for &p in &precisions {
            for rc in &recomputes {
                for &a in &attentions {
                    let name = format!("{res}x{batch} {p} recompute {rc} {}", a.name());
                    if !name.contains(&only) {
                        continue;
                    }
                    let mut s = sized.clone();
                    s.recipe.precision = p;
                    s.recipe.recompute = rc.clone();
                    s.recipe.attention = a;
                    let mm = match (p, rate16) {
                        (Precision::Bf16Mixed, Some(best)) => best,
                        _ => rate,
                    };
                    if let Some(row) =
                        measure(&name, &s, (warmup, steps, rounds, threads), (flops, mm))
                    {
                        rows.push(row);
                    }
                }
            }
        }
    }
    println!("load average after: {}", load());
    println!(
        "\nratios are engine / PyTorch (< 1: the engine uses less memory or time). peak = whole heap at the step's peak; step = that peak above the resident model state (weights, optimizer, EMA). cpu = the ratio of CPU seconds per step (every thread, p50; what load from other processes moves least: on a shared machine it stands beside the wall-time ratio, not for it). fwd / bwd = the wall-time ratios of the forward and of the backward (recomputed forwards included), p50 per round, median of the rounds. GFLOP/s = model FLOPs (3× forward, recompute not counted) / engine p50; 'of mm' = that rate over the best matmul rate in the step's compute dtype (f32, or the bf16 kernel) at that size."
    );
    println!("\nsummary ({} rows)", rows.len());
    println!(
        "{:<44} {:>11} {:>13} {:>10} {:>11}",
        "row", "time ratio", "round range", "cpu ratio", "peak ratio"
    );
    for r in &rows {
        println!(
            "{:<44} {:>11.2} {:>6.2}–{:<6.2} {:>10.2} {:>11}",
            r.name,
            r.time_ratio,
            r.time_range.0,
            r.time_range.1,
            r.cpu_ratio,
            r.peak_ratio.map_or("-".to_string(), |v| format!("{v:.3}"))
        );
    }
    let worst = |f: &dyn Fn(&Row) -> Option<f64>| {
        rows.iter()
            .filter_map(|r| f(r).filter(|v| v.is_finite()).map(|v| (v, r.name.as_str())))
            .max_by(|a, b| a.0.total_cmp(&b.0))
    };
    if let Some((v, n)) = worst(&|r| Some(r.time_ratio)) {
        println!("highest median time ratio: {v:.2} ({n})");
    }
    if let Some((v, n)) = worst(&|r| r.peak_ratio) {
        println!("highest peak ratio: {v:.4} ({n})");
    }
}
