//! The scratch PyTorch's CPU kernels allocate beyond their outputs: the flash attention's
//! per-thread buffers and the packed operands of a GEMM.

use super::attn::Attn;
use crate::spec::Dtype;

/// Bytes PyTorch's CPU flash attention (`aten/src/ATen/native/cpu/FlashAttentionKernel.cpp`,
/// torch 2.15) allocates for one call beyond its outputs, (forward, backward), with `threads`
/// intra-op threads and inputs in `dt`. Both kernels block q by `qSplitSize` = 32, 64 or 256
/// rows (q length below 192, below 768, else; at most the q length) and k/v by `kvSplitSize` =
/// min(512, kv length), and allocate per-thread buffers up front with `at::empty({num_thread,
/// size_per_thread})` in the accumulation type (fp32 for bf16/fp16) plus, for a reduced type, a
/// second one in the input dtype (an fp32 input makes it empty):
/// - `cpu_flash_attention` (forward): `qk` qSplit·kvSplit + `qk_max` and `qk_sum` qSplit each +
///   `dst` qSplit·headSize in fp32; `qk_reduced` qSplit·kvSplit in the reduced type (the
///   oneDNN-packed path, fp16 only, pads these and adds packed copies of k and v: not modelled);
/// - `cpu_flash_attention_backward`: `attn` + `grad_attn`, 2·qSplit·kvSplit in fp32, the same
///   again in the reduced type, and inside `at::parallel_for` a `dsum` of qSplit fp32 per thread
///   that runs (min(threads, b·heads) with grain 1).
///
/// Measured (torch 2.15 CPU, 2 threads; `bench/torch_peer/family_trace.py` on the SD3 LoRA bf16
/// spec, q = kv = 218 joint tokens, qSplit 64): 223,232 + 111,616 B in the backward, as here.
pub(crate) fn cpu_flash_scratch(threads: u64, at: Attn, dt: Dtype) -> (u64, u64) {
    if at.sq == 0 || at.skv == 0 {
        return (0, 0);
    }
    let threads = threads.max(1);
    let q_split = match at.sq {
        s if s >= 768 => 256,
        s if s >= 192 => 64,
        _ => 32,
    }
    .min(at.sq);
    let kv_split = at.skv.min(512);
    let acc = Dtype::F32.size();
    let reduced = if matches!(dt, Dtype::Bf16 | Dtype::F16) {
        dt.size()
    } else {
        0
    };
    let block = q_split * kv_split;
    let fwd = threads * (block + 2 * q_split + q_split * at.dh) * acc + threads * block * reduced;
    let workers = threads.min((at.b * at.heads).max(1));
    let bwd = threads * 2 * block * acc + threads * 2 * block * reduced + workers * q_split * acc;
    (fwd, bwd)
}

/// The row block oneDNN's brgemm matmul picks for an (m × k) · (k × n) product on `nthr`
/// threads, with `n_blk` output columns per block (`cpu/x64/matmul/brgemm_matmul_utils.cpp`
/// `compute_blocking_heuristic_avx512`, one batch, no k-parallel split): rows blocks from
/// min(256, m) down to min(32, m) (16 when the column blocks leave threads idle) are scored by
/// `matmul_avx512_blocking_params_t::get_imbalance` — the spread of the m × n blocks over the
/// threads, the rows the last block pads, the k tail — skipping block counts under 3 per
/// thread that do not divide among the threads (`n_chunk_size` column blocks make one work
/// item); the first (largest) best one wins, else the smallest. With the k tail equal for every
/// candidate, it is left out.
fn brgemm_m_blk(nthr: u64, m: u64, n_chunks: u64, n_chunk_size: u64) -> u64 {
    let disbalance = |work: u64, tb: u64| -> f32 {
        let rem = work % tb;
        let scalar = if work < tb {
            tb - rem
        } else {
            (tb - rem).min(rem)
        };
        scalar as f32 / tb as f32
    };
    let max_m_blk = m.min(256);
    let min_m_blk = if nthr > n_chunks {
        m.min(16)
    } else {
        m.min(32)
    };
    let mut best: Option<(f32, u64)> = None;
    for m_blk in (min_m_blk..=max_m_blk).rev() {
        let work = m.div_ceil(m_blk) * n_chunks.div_ceil(n_chunk_size);
        if work < 3 * nthr && !work.is_multiple_of(nthr) {
            continue;
        }
        let pad = (m_blk * m.div_ceil(m_blk)) % m;
        let score = (disbalance(work, nthr) + pad as f32 / m as f32) / 5.0;
        if best.is_none_or(|(b, _)| score < b) {
            best = Some((score, m_blk));
        }
    }
    best.map_or(min_m_blk, |(_, b)| b)
}

/// Bytes of oneDNN's bf16 matmul scratchpad for (m × k) · (k × n) on the CPU with `threads`
/// intra-op threads (torch 2.15 `aten::addmm`/`aten::mm` → oneDNN 3.13.3's
/// `brgemm_matmul_t<avx512_core_bf16>`; `brgemm_matmul_utils.cpp` `init_aux_values`,
/// `init_scratchpad`): per thread an fp32 C block of `M_blk` rows ([`brgemm_m_blk`]) by
/// `N_blk` = min(n, 64) columns, a packed B panel of `K_blk` (min(k, 512), 1024 when k exceeds
/// 1024 and the left operand is not transposed; rounded up to 32) by 64 bf16, and 640 B, plus
/// 384 B; a transposed left operand (the weight gradient `gradᵀ·x`) adds its bf16 copy,
/// m × k × 2 B, and 128 B.
///
/// Measured (`bench/torch_peer/gemm_scratch_probe.py`, torch 2.15 CPU, AVX-512 with
/// AVX512-BF16): exact on 32 forward shapes (m 8–2000, k 4–2048, n 4–256) at 2 threads and 4
/// shapes each at 1 and 4 threads; the transposed ones exact at (n, m, k) = (64, 256, 64) and
/// (256, 256, 256), +4 % / +8 % / −15 % where m exceeds 512 (oneDNN then splits the copy by
/// `M_blk` with a padded leading dimension, and splits n into chunks).
pub(crate) fn cpu_gemm_scratch(threads: u64, m: u64, k: u64, n: u64, a_transposed: bool) -> u64 {
    if m == 0 || k == 0 || n == 0 {
        return 0;
    }
    let nthr = threads.max(1);
    let n_blk = n.min(64);
    // A transposed left operand is copied (`use_buffer_a`), which lets the heuristic group up
    // to 16 column blocks per thread's work item (`max_n_chunks`).
    let n_chunks = n.div_ceil(n_blk);
    let n_chunk_size = if a_transposed { n_chunks.min(16) } else { 1 };
    let m_blk = brgemm_m_blk(nthr, m, n_chunks, n_chunk_size);
    let k_blk = if k > 1024 && !a_transposed {
        1024
    } else {
        k.min(512)
    };
    let k_pad = k_blk.div_ceil(32) * 32;
    let mut s = 384 + nthr * (640 + m_blk * n_blk * 4 + k_pad * 64 * 2);
    if a_transposed {
        s += m * k * 2 + 128;
    }
    s
}
