//! The heap a tracked RMSNorm / RoPE node holds, against the budget's constants. Alone in
//! its test binary (as `tensor_meta.rs`): the counting allocator is the whole process's, and
//! other tests' threads starting beside it would be counted.

use candle_core::{DType, Device, Tensor, Var};
use ditmem_engine::ops::{rms_norm_rows as rms_norm, rope_cos_sin as rope};
use ditmem_engine::CountingAlloc;

mod common;

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

/// What a tracked RMSNorm / RoPE node holds beside its output, held against the budget's
/// constants: the output with candle's bookkeeping, RMSNorm's rstd per row, the boxed op
/// (`RMS_NORM_OP_BYTES`, `ROPE_OP_BYTES`); untracked, only the output.
#[test]
fn rms_norm_and_rope_nodes_hold_what_the_budget_says() {
    use ditmem_budget::ditmem_cpu::ops::{RMS_NORM_OP_BYTES, ROPE_OP_BYTES};
    use ditmem_budget::ditmem_cpu::{STORAGE_META, TENSOR_META};
    let dev = Device::Cpu;
    let (rows, d) = (32u64, 32u64);
    let x = Var::from_tensor(&Tensor::zeros((4, 8, 32), DType::F32, &dev).unwrap()).unwrap();
    let w = Var::from_tensor(&Tensor::ones(32, DType::F32, &dev).unwrap()).unwrap();
    let cos = Tensor::ones((8, 8), DType::F32, &dev).unwrap();
    let sin = Tensor::zeros((8, 8), DType::F32, &dev).unwrap();
    let out = rows * d * 4 + TENSOR_META + STORAGE_META + 8;
    let n = 64u64;
    let per = |f: &dyn Fn() -> Tensor| common::heap_per_call(&A, n, f);
    let tracked = per(&|| rms_norm(x.as_tensor(), Some(w.as_tensor()), 1e-6, DType::F32).unwrap());
    assert_eq!(tracked, out + rows * 4 + RMS_NORM_OP_BYTES);
    let (xd, wd) = (x.as_tensor().detach(), w.as_tensor().detach());
    assert_eq!(
        per(&|| rms_norm(&xd, Some(&wd), 1e-6, DType::F32).unwrap()),
        out
    );
    assert_eq!(
        per(&|| rope(x.as_tensor(), &cos, &sin).unwrap()),
        out + ROPE_OP_BYTES
    );
    assert_eq!(per(&|| rope(&xd, &cos, &sin).unwrap()), out);
}
