//! Calibration of the time model's CPU profile (`DeviceProfile::cpu_default` in
//! `ditmem-budget/src/cost.rs`): candle matmul FLOP/s per dtype at DiT-like shapes, elementwise
//! throughput per dtype, and the fixed cost of one forward+backward pass, side by side in one run
//! with the conditions. Nothing is asserted; the numbers are printed to be copied.
//!
//! `cargo bench -p ditmem-engine --bench calibrate` (release profile). Environment: `CAL_REPS`
//! (timed repetitions per case, default 5; the median is reported).

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;
use ditmem_engine::host::cpu_model;
use ditmem_engine::{run, RunOptions};

fn reps() -> usize {
    std::env::var("CAL_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(5)
}

/// Median seconds of `f` over `n` runs after one warm-up.
fn median<F: FnMut() -> candle_core::Result<()>>(n: usize, mut f: F) -> candle_core::Result<f64> {
    f()?;
    let mut t = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

const DTYPES: [DType; 4] = [DType::F64, DType::F32, DType::BF16, DType::F16];

fn main() -> candle_core::Result<()> {
    ditmem_engine::threads::configure_before_threads();
    ditmem_engine::malloc::one_arena();
    let n = reps();
    let dev = Device::Cpu;
    println!(
        "conditions: {}; {} hardware threads available; RAYON_NUM_THREADS={}; candle 0.11 CPU, {} build; median of {n} runs after 1 warm-up",
        cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset".into()),
        if cfg!(debug_assertions) { "debug" } else { "release" },
    );

    let mm = matmul_rates(n, &dev)?;
    let ew = elementwise_rates(n, &dev)?;
    let overhead = microbatch_overhead(n);

    println!("\nDeviceProfile (paste into cpu_default):");
    println!(
        "matmul_f64: {:.1}e9, matmul_f32: {:.1}e9, matmul_bf16: {:.1}e9, matmul_f16: {:.1}e9,",
        mm[0] / 1e9,
        mm[1] / 1e9,
        mm[2] / 1e9,
        mm[3] / 1e9
    );
    println!(
        "elementwise_f64: {:.2}e9, elementwise_f32: {:.2}e9, elementwise_half: {:.2}e9, microbatch_overhead_s: {:.4},",
        ew[0] / 1e9,
        ew[1] / 1e9,
        ((ew[2] + ew[3]) / 2.0) / 1e9,
        overhead
    );
    Ok(())
}

/// The geometric means of a table of rates, per column exp of the summed logarithms `log_sums`
/// over `count` rows; printed as the table's last row, in G/s with `digits` decimals.
fn print_geometric_means(log_sums: &[f64], count: usize, digits: usize) -> Vec<f64> {
    let means: Vec<f64> = log_sums.iter().map(|s| (s / count as f64).exp()).collect();
    let cells: Vec<String> = means
        .iter()
        .map(|f| format!("{:>9.digits$}", f / 1e9))
        .collect();
    println!("{:<34} {}", "geometric mean", cells.join(" "));
    means
}

/// Matmul FLOP/s per dtype at a DiT block's shapes, printed as a table; their geometric means.
fn matmul_rates(n: usize, dev: &Device) -> candle_core::Result<Vec<f64>> {
    // Matmuls: a block's linears (rows = b·s tokens, D → 3D and D → 4D) and the attention
    // scores (b·heads batched s×dh · dh×s).
    println!("\nmatmul GFLOP/s (2·m·k·n per product)");
    println!(
        "{:<34} {:>9} {:>9} {:>9} {:>9}",
        "shape", "f64", "f32", "bf16", "f16"
    );
    let shapes: [(&str, usize, usize, usize, usize); 4] = [
        ("qkv: 1024×384 · 384×1152", 1, 1024, 384, 1152),
        ("fc1: 1024×384 · 384×1536", 1, 1024, 384, 1536),
        ("fc1: 2048×1152 · 1152×4608", 1, 2048, 1152, 4608),
        ("scores: 24×(256×64 · 64×256)", 24, 256, 64, 256),
    ];
    let mut mm_sum = [0.0f64; 4];
    for (name, batch, m, k, nn) in shapes {
        let mut cells = Vec::new();
        for (i, dt) in DTYPES.iter().enumerate() {
            let (a, b) = if batch == 1 {
                (
                    Tensor::randn(0f32, 1.0, (m, k), dev)?.to_dtype(*dt)?,
                    Tensor::randn(0f32, 1.0, (k, nn), dev)?.to_dtype(*dt)?,
                )
            } else {
                (
                    Tensor::randn(0f32, 1.0, (batch, m, k), dev)?.to_dtype(*dt)?,
                    Tensor::randn(0f32, 1.0, (batch, k, nn), dev)?.to_dtype(*dt)?,
                )
            };
            let s = median(n, || a.matmul(&b).map(|_| ()))?;
            let flops = 2.0 * (batch * m * k * nn) as f64 / s;
            mm_sum[i] += flops.ln();
            cells.push(format!("{:>9.1}", flops / 1e9));
        }
        println!("{name:<34} {}", cells.join(" "));
    }
    Ok(print_geometric_means(&mm_sum, 4, 1))
}

/// Elementwise throughput per dtype, printed as a table; their geometric means.
fn elementwise_rates(n: usize, dev: &Device) -> candle_core::Result<Vec<f64>> {
    // Elementwise: the time model charges two passes per element an op writes, so the rate
    // reported is 2·elements / seconds for each op, and the profile takes the geometric mean.
    println!("\nelementwise model rate, G elements/s (2·n / seconds per op; n = 4 Mi elements)");
    println!(
        "{:<34} {:>9} {:>9} {:>9} {:>9}",
        "op", "f64", "f32", "bf16", "f16"
    );
    let elems = 4 << 20;
    // The casts go to the other float width (f32 → bf16, the rest → f32), as mixed precision does.
    let ops = ["add", "mul", "exp", "gelu", "sum over rows", "cast"];
    let mut ew_sum = [0.0f64; 4];
    let mut cells: Vec<Vec<String>> = vec![Vec::new(); ops.len()];
    for (i, dt) in DTYPES.iter().enumerate() {
        let a = Tensor::randn(0f32, 1.0, (1024, elems / 1024), dev)?.to_dtype(*dt)?;
        let b = Tensor::randn(0f32, 1.0, (1024, elems / 1024), dev)?.to_dtype(*dt)?;
        for (j, op) in ops.iter().enumerate() {
            let s = match *op {
                "add" => median(n, || (&a + &b).map(|_| ()))?,
                "mul" => median(n, || (&a * &b).map(|_| ()))?,
                "exp" => median(n, || a.exp().map(|_| ()))?,
                "gelu" => median(n, || a.gelu().map(|_| ()))?,
                "sum over rows" => median(n, || a.sum_keepdim(1).map(|_| ()))?,
                _ => {
                    let to = if *dt == DType::F32 {
                        DType::BF16
                    } else {
                        DType::F32
                    };
                    median(n, || a.to_dtype(to).map(|_| ()))?
                }
            };
            let rate = 2.0 * elems as f64 / s;
            ew_sum[i] += rate.ln();
            cells[j].push(format!("{:>9.2}", rate / 1e9));
        }
    }
    for (j, op) in ops.iter().enumerate() {
        println!("{op:<34} {}", cells[j].join(" "));
    }
    Ok(print_geometric_means(&ew_sum, ops.len(), 2))
}

/// Seconds one extra forward+backward pass costs (printed with the two steps it comes from).
fn microbatch_overhead(n: usize) -> f64 {
    // Fixed cost of one forward+backward pass: a tiny step split into 1 and 8 microbatches.
    let mut s = Spec::default_xl();
    s.model.name = "overhead".into();
    s.model.depth = 2;
    s.model.hidden = 32;
    s.model.heads = 2;
    s.model.num_classes = 10;
    s.workload.height = 64;
    s.workload.width = 64;
    s.workload.batch = 8;
    s.recipe.precision = ditmem_budget::Precision::Fp32;
    s.recipe.ema.enabled = false;
    let step = |micro: u32| -> f64 {
        let mut t = s.clone();
        t.workload.microbatch = micro;
        t.workload.accumulation = 8 / micro;
        let opts = RunOptions {
            warmup: 2,
            steps: (2 * n) as u32,
            ..RunOptions::default()
        };
        match run(&t, &opts, None, &mut |_| true) {
            Ok(m) => {
                let mut v = m.step_times_s.clone();
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            }
            Err(e) => {
                eprintln!("overhead run failed: {e}");
                f64::NAN
            }
        }
    };
    let (one, eight) = (step(8), step(1));
    let overhead = (eight - one) / 7.0;
    println!(
        "\nmicrobatch overhead: step of 8 images (depth 2, hidden 32, 16 tokens, fp32) in 1 pass {:.2} ms, in 8 passes {:.2} ms → {:.3} ms per extra pass",
        one * 1e3,
        eight * 1e3,
        overhead * 1e3
    );
    overhead
}
