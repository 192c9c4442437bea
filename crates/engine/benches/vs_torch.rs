//! The ditmem engine against the PyTorch peer (`bench/torch_peer/peer.py`), side by side in one
//! run on the same spec and threads: fp32 and bf16-mixed × no recompute and recompute-all × both
//! attention modes. Prints, per configuration, the step peak (total, and above the resident model
//! state) and the step time p50 of both, as ratios engine/PyTorch, and the achieved GFLOP/s of
//! model FLOPs against this machine's matmul rate in the step's dtype (f32 through candle/gemm;
//! bf16 through the engine's AVX512-BF16 kernel, packing included, where the CPU has it)
//! measured in the same run. Nothing is
//! asserted: timings are printed with their conditions.
//!
//! `cargo bench -p ditmem-engine --bench vs_torch`. Environment: `VS_PRESET` (dit-s-2),
//! `VS_RES` (256), `VS_BATCH` (2), `VS_WARMUP` (1), `VS_STEPS` (5), `VS_ROUNDS` (1: engine then
//! peer once per configuration; more alternate them and report the median of the rounds' p50
//! and the range of the per-round ratios), `VS_THREADS` (all cores;
//! exported as `RAYON_NUM_THREADS` for the engine and `--threads` for the peer), `VS_PYTHON`
//! (bench/torch_peer/.venv/bin/python), `VS_ONLY` (a substring of the configuration names).
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
    })
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn main() {
    ditmem_engine::threads::configure_before_threads();
    let preset: String = env("VS_PRESET", "dit-s-2".to_string());
    let res: u32 = env("VS_RES", 256);
    let batch: u32 = env("VS_BATCH", 2);
    let warmup: u32 = env("VS_WARMUP", 1);
    let steps: u32 = env("VS_STEPS", 5);
    let rounds: u32 = env("VS_ROUNDS", 1).max(1);
    let threads: usize = env(
        "VS_THREADS",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let only: String = env("VS_ONLY", String::new());
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
    base.workload.height = res;
    base.workload.width = res;
    base.workload.batch = batch;
    base.workload.microbatch = batch;
    base.workload.accumulation = 1;
    let d = ditmem_budget::Shape::new(&base);
    let (rate_med, rate) = matmul_rate((d.b * d.s) as usize, d.d as usize, d.mlp as usize)
        .unwrap_or((f64::NAN, f64::NAN));
    let cpu = ditmem_engine::host::cpu_model();
    println!(
        "conditions: {cpu}; {threads} threads (RAYON_NUM_THREADS / torch --threads); OMP_WAIT_POLICY=PASSIVE for the peer; {} build; {} at {res}² ({} tokens), batch {batch}; warm-up {warmup}, {steps} measured steps (p50), {rounds} alternating round(s) per configuration (median of the rounds' p50); AdamW + EMA",
        if cfg!(debug_assertions) { "debug" } else { "release" },
        base.model.name,
        d.s,
    );
    println!(
        "f32 matmul rate (candle/gemm, {}×{} · {}×{}, 25 runs): best {:.1} GFLOP/s, median {:.1}",
        d.b * d.s,
        d.d,
        d.d,
        d.mlp,
        rate / 1e9,
        rate_med / 1e9
    );
    let rate16 = bf16_rate((d.b * d.s) as usize, d.d as usize, d.mlp as usize);
    match rate16 {
        Some((med, best)) => println!(
            "bf16 matmul rate (engine AVX512-BF16 kernel, packing included, same shape, 25 runs): best {:.1} GFLOP/s, median {:.1}",
            best / 1e9,
            med / 1e9
        ),
        None => println!("bf16 matmul rate: no AVX512-BF16 kernel on this CPU (bf16 products widen to f32)"),
    }
    let load = || {
        std::fs::read_to_string("/proc/loadavg")
            .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    };
    println!("load average before: {}", load());
    println!(
        "\n{:<40} {:>10} {:>10} {:>7} {:>10} {:>10} {:>7} {:>8} {:>8} {:>7} {:>9} {:>6}",
        "configuration",
        "peak MiB",
        "torch",
        "ratio",
        "step MiB",
        "torch",
        "ratio",
        "p50 s",
        "torch",
        "ratio",
        "GFLOP/s",
        "of mm"
    );
    let flops = model_flops(&base);
    for p in [Precision::Fp32, Precision::Bf16Mixed] {
        for rc in [Recompute::None, Recompute::All] {
            for a in [AttentionMode::Materialized, AttentionMode::MemoryEfficient] {
                let name = format!("{p} recompute {rc} {}", a.name());
                if !name.contains(&only) {
                    continue;
                }
                let mut s = base.clone();
                s.recipe.precision = p;
                s.recipe.recompute = rc.clone();
                s.recipe.attention = a;
                // Engine and peer alternate `rounds` times on this configuration, so a burst of
                // load from elsewhere on a shared machine lands on both rather than on one.
                let mut e_p50s = Vec::new();
                let mut t_p50s = Vec::new();
                let mut last = None;
                let mut peer_last = None;
                for _ in 0..rounds {
                    let m = match run(
                        &s,
                        &RunOptions {
                            warmup,
                            steps,
                            ..RunOptions::default()
                        },
                        Some(&A),
                        &mut |_| true,
                    ) {
                        Ok(m) => m,
                        Err(e) => {
                            println!("{name:<40} engine failed: {e}");
                            break;
                        }
                    };
                    let mut t = m.step_times_s.clone();
                    t.sort_by(f64::total_cmp);
                    e_p50s.push(t.get(t.len() / 2).copied().unwrap_or(f64::NAN));
                    let peer = run_peer(&s, warmup, steps, threads);
                    if let Ok(pe) = &peer {
                        t_p50s.push(pe.p50);
                    }
                    last = Some(m);
                    peer_last = Some(peer);
                }
                let (Some(m), Some(peer)) = (last, peer_last) else {
                    continue;
                };
                let median = |v: &mut Vec<f64>| {
                    v.sort_by(f64::total_cmp);
                    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
                };
                let ratios: Vec<f64> = e_p50s.iter().zip(&t_p50s).map(|(e, t)| e / t).collect();
                let p50 = median(&mut e_p50s);
                let above = m.peak_bytes.saturating_sub(m.resident_bytes);
                let gf = flops / p50;
                let peer = peer.map(|mut pe| {
                    pe.p50 = median(&mut t_p50s);
                    pe
                });
                let (tp, tr, ta, tar, tt, ttr) = match &peer {
                    Ok(pe) => (
                        format!("{:.1}", mib(pe.peak)),
                        format!("{:.2}", m.peak_bytes as f64 / pe.peak as f64),
                        format!("{:.1}", mib(pe.above)),
                        format!("{:.2}", above as f64 / pe.above.max(1) as f64),
                        format!("{:.3}", pe.p50),
                        format!("{:.2}", p50 / pe.p50),
                    ),
                    Err(_) => Default::default(),
                };
                let mut line = format!(
                    "{:>10.1} {tp:>10} {tr:>7} {:>10.1} {ta:>10} {tar:>7} {:>8.3} {tt:>8} {ttr:>7} {:>9.2} {:>5.0}%",
                    mib(m.peak_bytes),
                    mib(above),
                    p50,
                    gf / 1e9,
                    100.0 * gf
                        / match (p, rate16) {
                            (Precision::Bf16Mixed, Some((_, best))) => best,
                            _ => rate,
                        }
                );
                if ratios.len() > 1 {
                    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
                    let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    line.push_str(&format!("  rounds {lo:.2}–{hi:.2}"));
                }
                if let Err(e) = peer {
                    line.push_str(&format!("  (peer: {e})"));
                }
                println!("{name:<40} {line}");
            }
        }
    }
    println!("load average after: {}", load());
    println!(
        "\nratios are engine / PyTorch (< 1: the engine uses less memory or time). peak = whole heap at the step's peak; step = that peak above the resident model state (weights, optimizer, EMA). GFLOP/s = model FLOPs (3× forward, recompute not counted) / engine p50; 'of mm' = that rate over the best matmul rate in the step's compute dtype (f32, or the bf16 kernel)."
    );
}
