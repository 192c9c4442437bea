//! The predicted peak of `verify` ([`plan_memory`]) against the counting allocator. One test
//! function only: the allocator is global, so nothing else may run in this binary at once.

use ditmem_budget::Spec;
use ditmem_conformance::verify::{
    compute_reference, parse_variants, plan_memory, verify, VerifyOptions,
};
use ditmem_engine::CountingAlloc;

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

#[test]
fn the_predicted_peak_holds_the_measured_one() {
    let base = Spec::small();
    let o = VerifyOptions {
        steps: 3,
        ..VerifyOptions::default()
    };
    let variants = parse_variants(
        "fp32/none/materialized,bf16-mixed/all/memory-efficient,fp16-mixed/none/materialized",
    )
    .unwrap();
    // gemm's per-thread packing slabs live as long as the pool's threads: a prediction for a
    // fresh process counts them, but after the first run they are resident before `before`. Make
    // them resident from the start and compare what a run adds above them (the prediction less
    // the slabs), the same for every iteration.
    let on_here = ditmem_engine::host::resolve(&base);
    let slabs = ditmem_budget::ditmem_cpu::gemm_workspace_bytes(&on_here.cpu());
    assert!(
        ditmem_budget::ditmem_cpu::step_uses_gemm(&on_here),
        "fp32 multiplies through gemm"
    );
    ditmem_engine::kernels::gemm::allocate_slabs();
    for jobs in [1usize, 2] {
        let mut plan = plan_memory(&base, &variants, &o, jobs, true).unwrap();
        plan.peak -= slabs;
        let before = A.live();
        A.reset_peak();
        let r = compute_reference(&base, &o, &mut |_| {}).unwrap();
        let rep = verify(&base, &variants, &o, &r, jobs, &mut |_| {}).unwrap();
        drop(r);
        let measured = A.peak() - before;
        eprintln!(
            "jobs {jobs}: measured {measured} B, predicted {} B ({:+.1} %)",
            plan.peak,
            100.0 * (plan.peak as f64 / measured as f64 - 1.0)
        );
        assert!(rep.ok());
        // Never below the measurement, and within 25 % above it.
        assert!(
            plan.peak >= measured,
            "predicted {} < measured {measured}",
            plan.peak
        );
        assert!(
            (plan.peak as f64) <= 1.25 * measured as f64,
            "predicted {} > 1.25 × measured {measured}",
            plan.peak
        );
        drop(rep);
    }
}
