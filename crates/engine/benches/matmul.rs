//! bf16 and f32 matrix products side by side in one run: candle's f32 matmul (the `gemm` crate),
//! candle's bf16 matmul (widened to f32 in candle 0.11), and the engine's AVX512-BF16 kernel
//! (`gemm_bf16`, packing included), at the linear shapes of a DiT-S/2 and a DiT-XL/2 block.
//! Prints GFLOP/s (median and best of the runs) and the bf16-kernel / f32 ratio. Nothing is
//! asserted. A second table: the f32 weight gradient dW = gᵀ·x of DiT-S/2's fc1 made as the
//! engine's linear makes it (chunks of `DW_ROWS` rows, one product per block of dW's rows,
//! `ops::dw_blocks`) beside blocks of 128 rows and one block, in alternating runs.
//!
//! `cargo bench -p ditmem-engine --bench matmul`. Environment: `MM_RUNS` (15), threads from
//! `RAYON_NUM_THREADS` (all cores).

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use ditmem_engine::kernels::gemm_bf16::{self, View};
use ditmem_engine::ops::{dw_blocks, DW_ROWS};
use half::bf16;

fn stats(mut t: Vec<f64>, flop: f64) -> (f64, f64) {
    t.sort_by(f64::total_cmp);
    (flop / t[t.len() / 2] / 1e9, flop / t[0] / 1e9)
}

fn time(runs: usize, mut f: impl FnMut()) -> Vec<f64> {
    f();
    (0..runs)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect()
}

fn main() -> candle_core::Result<()> {
    ditmem_engine::threads::configure_before_threads();
    let runs: usize = std::env::var("MM_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15);
    let dev = Device::Cpu;
    println!(
        "conditions: {} rayon threads, {} build, {runs} runs per cell; AVX512-BF16 kernel {}",
        rayon::current_num_threads(),
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        if gemm_bf16::supported() {
            "on"
        } else {
            "off (cells skipped)"
        }
    );
    println!(
        "{:<34} {:>16} {:>16} {:>16} {:>16} {:>8}",
        "shape (m×k · k×n)",
        "f32 GFLOP/s",
        "bf16 widen",
        "bf16 kernel",
        "kernel, packed",
        "kernel/f32"
    );
    for &(name, m, k, n) in &[
        ("S/2 b2 qkv", 512, 384, 1152),
        ("S/2 b2 fc1", 512, 384, 1536),
        ("S/2 b2 fc2", 512, 1536, 384),
        ("XL/2 b2 fc1", 512, 1152, 4608),
        ("XL/2 b2 fc2", 512, 4608, 1152),
    ] {
        let flop = 2.0 * (m * k * n) as f64;
        let a = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
        let b = Tensor::randn(0f32, 1.0, (k, n), &dev)?;
        let f32c = stats(time(runs, || drop(a.matmul(&b))), flop);
        let (a16, b16) = (a.to_dtype(DType::BF16)?, b.to_dtype(DType::BF16)?);
        let widen = stats(time(runs, || drop(a16.matmul(&b16))), flop);
        let kern = if gemm_bf16::supported() {
            let av = a16.flatten_all()?.to_vec1::<bf16>()?;
            let bv = b16.flatten_all()?.to_vec1::<bf16>()?;
            let mut pa = vec![0u32; gemm_bf16::packed_a_len(m, k)];
            let mut pb = vec![0u16; gemm_bf16::packed_b_len(k, n)];
            let mut c = vec![0f32; m * n];
            let all = stats(
                time(runs, || {
                    gemm_bf16::pack_a(
                        m,
                        k,
                        View {
                            data: &av,
                            rs: k,
                            cs: 1,
                        },
                        &mut pa,
                    );
                    gemm_bf16::pack_b(
                        k,
                        n,
                        View {
                            data: &bv,
                            rs: n,
                            cs: 1,
                        },
                        &mut pb,
                    );
                    c.iter_mut().for_each(|v| *v = 0.0);
                    gemm_bf16::gemm_packed(m, n, k, &pa, &pb, &mut c, n);
                }),
                flop,
            );
            let packed = stats(
                time(runs, || {
                    gemm_bf16::gemm_packed(m, n, k, &pa, &pb, &mut c, n)
                }),
                flop,
            );
            Some((all, packed))
        } else {
            None
        };
        let cell = |s: (f64, f64)| format!("{:.1} ({:.1})", s.0, s.1);
        println!(
            "{:<34} {:>16} {:>16} {:>16} {:>16} {:>8}",
            format!("{name} {m}×{k} · {k}×{n}"),
            cell(f32c),
            cell(widen),
            kern.map(|k| cell(k.0)).unwrap_or_else(|| "-".into()),
            kern.map(|k| cell(k.1)).unwrap_or_else(|| "-".into()),
            kern.map(|k| format!("{:.2}", k.0 .0 / f32c.0))
                .unwrap_or_else(|| "-".into())
        );
    }
    println!("cells: median (best) GFLOP/s of 2·m·k·n FLOPs per call; 'bf16 kernel' includes packing both operands and zeroing C, 'kernel, packed' is the product alone on packed operands; the ratio is 'bf16 kernel' over f32.");
    weight_gradient_blocks(runs);
    Ok(())
}

/// dW (out × inp) = Σ over chunks of `DW_ROWS` rows of g_cᵀ·x_c, one `gemm` call per block of
/// dW's rows, with the blocks `blocks` gives (first row, rows).
fn dw_by_blocks(
    (rows, inp, out): (usize, usize, usize),
    g: &[f32],
    x: &[f32],
    dw: &mut [f32],
    blocks: &[(usize, usize)],
) {
    use ditmem_engine::kernels::gemm::mm_strided_f32;
    let threads = rayon::current_num_threads();
    for r0 in (0..rows).step_by(DW_ROWS) {
        let k = DW_ROWS.min(rows - r0);
        for &(o0, mb) in blocks {
            mm_strided_f32(
                mb,
                inp,
                k,
                (&mut dw[o0 * inp..], inp, 1),
                (&g[r0 * out + o0..], 1, out),
                (&x[r0 * inp..], inp, 1),
                threads,
            );
        }
    }
}

/// The weight-gradient table (see the module docs): per row count, GFLOP/s of the engine's
/// blocks, of blocks of 128 rows of dW and of one block, the runs of the three alternating.
fn weight_gradient_blocks(runs: usize) {
    let (inp, out) = (384, 1536);
    println!(
        "\nf32 weight gradient dW = gᵀ·x, DiT-S/2 fc1 (in {inp}, out {out}), chunks of {DW_ROWS} rows:"
    );
    println!(
        "{:<8} {:>22} {:>16} {:>16}",
        "rows", "engine blocks", "blocks of 128", "one block"
    );
    for rows in [512, 1024, 4096] {
        let g: Vec<f32> = (0..rows * out).map(|i| (i % 97) as f32 * 0.01).collect();
        let x: Vec<f32> = (0..rows * inp).map(|i| (i % 89) as f32 * 0.01).collect();
        let mut dw = vec![0f32; out * inp];
        let engine: Vec<(usize, usize)> = dw_blocks(rows, out).collect();
        let narrow: Vec<(usize, usize)> = (0..out)
            .step_by(128)
            .map(|o| (o, 128.min(out - o)))
            .collect();
        let variants = [engine.clone(), narrow, vec![(0, out)]];
        let mut t: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
        for _ in 0..runs {
            for (v, blocks) in variants.iter().enumerate() {
                let t0 = Instant::now();
                dw_by_blocks((rows, inp, out), &g, &x, &mut dw, blocks);
                t[v].push(t0.elapsed().as_secs_f64());
            }
        }
        let flop = 2.0 * (rows * inp * out) as f64;
        let cell = |v: &Vec<f64>| {
            let s = stats(v.clone(), flop);
            format!("{:.1} ({:.1})", s.0, s.1)
        };
        println!(
            "{:<8} {:>22} {:>16} {:>16}",
            rows,
            format!("{} × {}: {}", engine.len(), engine[0].1, cell(&t[0])),
            cell(&t[1]),
            cell(&t[2])
        );
    }
    println!("cells: median (best) GFLOP/s of 2·rows·in·out FLOPs; 'engine blocks' names the blocks (count × width).");
}
