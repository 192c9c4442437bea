//! The budget's constants for candle's per-tensor bookkeeping, held against the counting
//! allocator: a fresh tensor costs its buffer + `TENSOR_META` + `STORAGE_META` (for a rank-3
//! shape), a view only `TENSOR_META` (for a rank-3 view).

use candle_core::{DType, Device, Tensor};
use ditmem_budget::ditmem_cpu::{STORAGE_META, TENSOR_META};
use ditmem_engine::CountingAlloc;

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

#[test]
fn tensor_bookkeeping_matches_the_budget() {
    let dev = Device::Cpu;
    let n = 256u64;
    let before = A.live();
    let fresh: Vec<Tensor> = (0..n)
        .map(|_| Tensor::zeros((2, 3, 4), DType::F32, &dev).unwrap())
        .collect();
    let per_fresh = (A.live() - before) / n;
    let mid = A.live();
    let views: Vec<Tensor> = fresh
        .iter()
        .map(|t| t.reshape((4, 3, 2)).unwrap())
        .collect();
    let per_view = (A.live() - mid) / n;
    // The Vec of handles itself: 8 bytes per element (n is a power of two: exact capacity).
    assert_eq!(per_fresh, 24 * 4 + TENSOR_META + STORAGE_META + 8);
    assert_eq!(per_view, TENSOR_META + 8);
    drop((fresh, views));
}
