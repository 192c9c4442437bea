//! The predicted peak of `verify` ([`plan_memory`]) against the counting allocator. One test
//! function only: the allocator is global, so nothing else may run in this binary at once.

use ditmem_budget::Spec;
use ditmem_conformance::verify::{
    compute_reference, parse_variants, plan_memory, verify, VerifyOptions,
};
use ditmem_engine::trainer::Trainer;
use ditmem_engine::CountingAlloc;

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

/// The plan's peak holds verify's measured one, and the saving it counts on (AdamW's state
/// freed as the step goes) changes no value. One test: the counting allocator is the process's.
#[test]
fn the_predicted_peak_holds_the_measured_one() {
    let base = Spec::small();
    predicted_peak_holds(&base);
    freeing_the_optimizer_state_changes_no_value(&base);
}

/// `plan_memory`'s peak against the measured peak of verify on `base` (three variants, three
/// drift steps on one and two jobs, and one drift step).
fn predicted_peak_holds(base: &Spec) {
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
    let on_here = ditmem_engine::host::resolve(base);
    let slabs = ditmem_budget::ditmem_cpu::gemm_workspace_bytes(&on_here.cpu());
    assert!(
        ditmem_budget::ditmem_cpu::step_uses_gemm(&on_here),
        "fp32 multiplies through gemm"
    );
    ditmem_engine::kernels::gemm::allocate_slabs();
    // One drift step (the runs of issue 51): no run keeps AdamW's moments past its last update,
    // so the prediction drops them from every phase but the optimizer's, where one tensor's live.
    let one_step = VerifyOptions {
        steps: 1,
        ..VerifyOptions::default()
    };
    for (o, jobs) in [(&o, 1usize), (&o, 2), (&one_step, 1)] {
        let mut plan = plan_memory(base, &variants, o, jobs, true).unwrap();
        // The plan counts gemm's per-thread packing slabs; those already resident (this thread's
        // and the pool's, `allocate_slabs`) are below `before`. A thread that first multiplies
        // inside the run (a variant's worker, as scheduling falls) allocates its 1 MiB slab in the
        // measured window: seen 2026-12-06 as 8,029,476 B measured on a quiet machine against
        // 6,975,740 B under load for the same one-drift-step run. So the measurement is held
        // below the whole plan and above the plan less the resident slabs.
        let whole = plan.peak;
        plan.peak -= slabs;
        let before = A.live();
        A.reset_peak();
        let r = compute_reference(base, o, &mut |_| {}).unwrap();
        let rep = verify(base, &variants, o, &r, jobs, &mut |_| {}).unwrap();
        drop(r);
        let measured = A.peak() - before;
        eprintln!(
            "steps {}, jobs {jobs}: measured {measured} B, predicted {} B ({:+.1} %)",
            o.steps,
            plan.peak,
            100.0 * (plan.peak as f64 / measured as f64 - 1.0)
        );
        assert!(rep.ok());
        // Never above the whole plan, and the plan less resident slabs within 25 % above it.
        assert!(
            whole >= measured,
            "predicted {whole} (with the slabs) < measured {measured}"
        );
        assert!(
            (plan.peak as f64) <= 1.25 * measured as f64,
            "predicted {} > 1.25 × measured {measured}",
            plan.peak
        );
        drop(rep);
    }
}

/// The memory saving changes no value: `compute_gradients` + `apply_gradients` is `step`, and
/// a step that frees AdamW's state as it goes writes the same weights, bit for bit (fp64, as
/// the reference; bf16-mixed, as a variant). Its state is gone afterwards.
fn freeing_the_optimizer_state_changes_no_value(base: &Spec) {
    for precision in [
        ditmem_budget::Precision::Fp64,
        ditmem_budget::Precision::Bf16Mixed,
    ] {
        let mut spec = base.clone();
        spec.recipe.precision = precision;
        let opts = ditmem_engine::trainer::TrainOptions {
            lr: 1e-3,
            ..Default::default()
        };
        let data = ditmem_engine::diffusion::SyntheticData::new(&spec, 1).unwrap();
        let weights = |t: &Trainer| -> Vec<u64> {
            let mut bits = Vec::new();
            for n in t.trained_names() {
                let v: Vec<f64> = t
                    .parameter(&n)
                    .unwrap()
                    .to_dtype(candle_core::DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                bits.extend(v.iter().map(|x| x.to_bits()));
            }
            bits
        };
        let mut a = Trainer::new(&spec, opts.clone()).unwrap();
        a.step(&data.step_batch(0), None).unwrap();
        let after_one = weights(&a);
        a.step(&data.step_batch(1), None).unwrap();
        // A first step that creates each tensor's moments only for its own update.
        let mut c = Trainer::new(&spec, opts.clone()).unwrap();
        c.release_optimizer_state_after_next_step();
        c.compute_gradients(&data.step_batch(0)).unwrap();
        assert!(!c.apply_gradients().unwrap());
        assert_eq!(
            after_one,
            weights(&c),
            "{precision}: the first step differs"
        );
        assert_eq!(c.state_bytes().0, 0, "{precision}: AdamW's state was kept");
        let mut b = Trainer::new(&spec, opts.clone()).unwrap();
        b.compute_gradients(&data.step_batch(0)).unwrap();
        assert!(!b.apply_gradients().unwrap());
        b.release_optimizer_state_after_next_step();
        b.step(&data.step_batch(1), None).unwrap();
        assert_eq!(
            weights(&a),
            weights(&b),
            "{precision}: the weights after two steps differ"
        );
        assert!(a.state_bytes().0 > 0);
        assert_eq!(b.state_bytes().0, 0, "{precision}: AdamW's state was kept");
        assert!(b.apply_gradients().is_err(), "no gradients are left");
    }
}
