//! The heap a tracked fused cross-attention node holds beside its output, against the budget's
//! restatement. Alone in its test binary (as `wan_meta.rs`): the counting allocator is the whole
//! process's, and other tests' threads starting beside it would be counted.

use candle_core::{DType, Device, Tensor, Var};
use ditmem_engine::ops::{cross_attention, AttnKeep, MlpLinear};
use ditmem_engine::CountingAlloc;

mod common;

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

/// Tracked, the node holds beyond the untracked one only the attention's log-sum-exp and the
/// boxed op (`CROSS_ATTENTION_OP_BYTES`): k and v (and, normed, k before the norm and the rstd)
/// are freed after the forward and projected again by the backward; untracked it keeps nothing
/// but its output.
#[test]
fn cross_attention_node_holds_what_the_budget_says() {
    use ditmem_budget::ditmem_cpu::cross::CROSS_ATTENTION_OP_BYTES;
    let dev = Device::Cpu;
    let (b, sq, t, c, d, heads) = (2usize, 8usize, 16usize, 24usize, 32usize, 4usize);
    let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &dev).unwrap();
    let q = Var::from_tensor(&z(&[b * sq, d])).unwrap();
    let ctx = Var::from_tensor(&z(&[b * t, c])).unwrap();
    let nw = Var::from_tensor(&Tensor::ones(d, DType::F32, &dev).unwrap()).unwrap();
    // The model's weights: made once, as the trainer's are (the node holds handles on them).
    let (w, bias) = (z(&[d, c]), z(&[d]));
    let lin = || MlpLinear {
        w: w.clone(),
        b: bias.clone(),
        sink: None,
    };
    let n = 32u64;
    let per = |f: &dyn Fn() -> Tensor| common::heap_per_call(&A, n, f);
    let keep = AttnKeep::LogSumExp;
    let (qd, cdt, nwd) = (
        q.as_tensor().detach(),
        ctx.as_tensor().detach(),
        nw.as_tensor().detach(),
    );
    let lse = (b * heads * sq * 4) as u64;
    for norm in [false, true] {
        let tracked = per(&|| {
            let nk = norm.then_some((nw.as_tensor(), 1e-6));
            let kv = (lin(), lin());
            cross_attention(q.as_tensor(), ctx.as_tensor(), kv, nk, None, b, heads, keep).unwrap()
        });
        let untracked = per(&|| {
            let nk = norm.then_some((&nwd, 1e-6));
            cross_attention(&qd, &cdt, (lin(), lin()), nk, None, b, heads, keep).unwrap()
        });
        assert_eq!(
            tracked - untracked,
            lse + CROSS_ATTENTION_OP_BYTES,
            "norm {norm}"
        );
    }
}
