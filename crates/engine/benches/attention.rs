//! The engine's generic streaming attention (`ops::qkv_attention`, the log-sum-exp kept: the
//! memory-efficient mode of a DiT block) alone: forward and backward wall time per call and
//! their rate in GFLOP/s, at DiT-S/2's head shapes (6 heads of 64) for 256 tokens × 16 and
//! 1,024 tokens × 4 (256² batch 16, 512² batch 4), f32. The backward's rate is the figure to
//! raise for issue 20: at those sizes (DiT-S/2 fp32, no recompute, 2 threads, AMD EPYC family
//! 25 with AVX2 only, 2026-12) it was a quarter (256² b16) to two fifths (512² b4) of a step's
//! backward, at 53–72 GFLOP/s against ~166 for the step's large products (`--bench matmul`).
//! Nothing is asserted.
//!
//! FLOPs counted: forward 2 products (q·kᵀ, P·v), backward 5 (P again, dV, dP, dQ, dK), each
//! 2·s²·d_h per head; the exps and the elementwise work are not counted.
//!
//! `cargo bench -p ditmem-engine --bench attention`. Environment: `ATTN_RUNS` (7), threads from
//! `RAYON_NUM_THREADS` (all cores).

use std::time::Instant;

use candle_core::{Device, Tensor, Var};
use ditmem_engine::ops::{qkv_attention, AttnKeep};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> candle_core::Result<()> {
    ditmem_engine::threads::configure_before_threads();
    let runs: usize = std::env::var("ATTN_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7)
        .max(1);
    let dev = Device::Cpu;
    println!(
        "{:<28} {:>10} {:>9} {:>10} {:>9}",
        "shape", "fwd ms", "GFLOP/s", "bwd ms", "GFLOP/s"
    );
    for (b, s) in [(16usize, 256usize), (4, 1024)] {
        let (heads, dh) = (6usize, 64usize);
        let d = heads * dh;
        let qkv = Var::from_tensor(&(Tensor::randn(0f32, 1.0, (b * s, 3 * d), &dev)? * 0.3)?)?;
        let r = Tensor::randn(0f32, 1.0, (b * s, d), &dev)?;
        let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
        // One untimed call first (thread pools, allocator), then `runs` timed ones.
        for i in 0..=runs {
            let t0 = Instant::now();
            let y = qkv_attention(qkv.as_tensor(), b, heads, AttnKeep::LogSumExp, None)?;
            let tf = t0.elapsed().as_secs_f64();
            let loss = (y * &r)?.sum_all()?;
            let t1 = Instant::now();
            let grads = loss.backward()?;
            let tb = t1.elapsed().as_secs_f64();
            drop(grads);
            if i > 0 {
                fwd.push(tf);
                bwd.push(tb);
            }
        }
        let per = (b * heads) as f64 * 2.0 * (s * s * dh) as f64;
        let (f, bk) = (median(fwd), median(bwd));
        println!(
            "{:<28} {:>10.2} {:>9.1} {:>10.2} {:>9.1}",
            format!("{s} tokens × {b}, {heads}×{dh}"),
            1e3 * f,
            2.0 * per / f / 1e9,
            1e3 * bk,
            5.0 * per / bk / 1e9
        );
    }
    println!(
        "\nmedian of {runs} calls after one untimed; {} threads; the backward includes the loss's (y ⊙ r summed: elementwise).",
        rayon::current_num_threads()
    );
    Ok(())
}
