//! The sharding rules (`sharding.rs`, `runtime/pytorch/sharding.rs`) held to the values they
//! imply.

use super::*;
use crate::denoiser::param_table;
use crate::estimate::estimate;
use crate::events::Phase;
use crate::precision_rules::optimizer_state_bytes;
use crate::spec::Recompute;
use crate::timeline::static_bytes;

/// DiT-XL/2 (the original) at 256² on the CUDA runtime over `ranks`, batch 4 per rank.
fn xl(ranks: u32) -> Spec {
    let mut s = Spec::default_xl();
    s.runtime = "pytorch:cuda".parse().unwrap();
    s.workload.ranks = ranks;
    s.workload.microbatch = 4;
    s.workload.accumulation = 1;
    s.workload.batch = 4 * ranks;
    s.recipe.ema.enabled = false;
    s
}

fn with(mut s: Spec, z: u8, sharder: Sharder, offload: Offload) -> Spec {
    s.recipe.zero_stage = z;
    s.recipe.sharder = sharder;
    s.recipe.offload = offload;
    s.validate().unwrap();
    s
}

fn trained(s: &Spec) -> u64 {
    param_table(s)
        .iter()
        .filter(|t| t.role == ParamRole::Trained)
        .map(|t| t.numel())
        .sum()
}

#[test]
fn zero2_on_8_ranks_keeps_an_eighth_of_the_optimizer_state_rounded_to_the_alignment() {
    let s = with(xl(8), 2, Sharder::Deepspeed, Offload::None);
    let p = trained(&s);
    let st = static_bytes(&s, &param_table(&s));
    // The flat group padded to 2 × 8 elements, split in 8.
    let part = p.div_ceil(16) * 16 / 8;
    assert_eq!(ds12_partition_elems(p, 8), part);
    assert!(part * 8 >= p && part * 8 - p < 16);
    assert_eq!(st.optimizer_state, 8 * part, "AdamW m and v in fp32");
    assert_eq!(st.master_weights, 4 * part);
    // The bf16 module stays whole; the gradients keep the bf16 partition.
    assert_eq!(st.gradients, 2 * part);
    // Unsharded: the whole state.
    let one = static_bytes(&xl(1), &param_table(&xl(1)));
    assert_eq!(
        one.optimizer_state,
        optimizer_state_bytes(p, Optimizer::AdamW, s.recipe.precision)
    );
}

#[test]
fn zero2_differs_from_zero1_by_the_full_gradients() {
    let z1 = estimate(&with(xl(8), 1, Sharder::Deepspeed, Offload::None)).unwrap();
    let z2 = estimate(&with(xl(8), 2, Sharder::Deepspeed, Offload::None)).unwrap();
    let p = trained(&xl(8));
    // At the end of the backward, ZeRO-1 holds every bf16 gradient, ZeRO-2 its partition.
    let end = |b: &crate::estimate::Budget| {
        b.timeline
            .events
            .iter()
            .rfind(|e| e.phase == Phase::Backward)
            .unwrap()
            .live
            .gradients
    };
    let part = ds12_partition_elems(p, 8);
    let ipg = DS12_IPG_BUFFERS * DS_REDUCE_BUCKET_ELEMS * 2;
    assert_eq!(end(&z1), 2 * p + ipg);
    assert_eq!(end(&z2), 2 * part + ipg);
}

#[test]
fn zero3_peak_drops_by_the_sharded_parameters() {
    let z2 = estimate(&with(xl(8), 2, Sharder::Deepspeed, Offload::None)).unwrap();
    let z3 = estimate(&with(xl(8), 3, Sharder::Deepspeed, Offload::None)).unwrap();
    let s = xl(8);
    let table = param_table(&s);
    let st2 = &z2.static_bytes;
    let st3 = &z3.static_bytes;
    // The bf16 module (2 B per parameter) becomes per-tensor shards plus the small parameters
    // kept whole.
    let shards: u64 = table
        .iter()
        .filter(|t| !t.buffer)
        .map(|t| 2 * t.numel().div_ceil(8))
        .sum();
    let whole: u64 = table
        .iter()
        .filter(|t| !t.buffer && ds3_persistent(t))
        .map(|t| 2 * t.numel())
        .sum();
    let buffers: u64 = table
        .iter()
        .filter(|t| t.buffer)
        .map(|t| crate::params::stored_bytes(t, s.recipe.precision, false, s.recipe.base_quant))
        .sum();
    assert_eq!(st3.weights, shards + whole + buffers);
    assert!(st2.weights - st3.weights > 2 * trained(&s) * 3 / 4);
    // The peak drops, though less than the weights: a block is gathered (and prefetched).
    assert!(z3.peak_bytes < z2.peak_bytes);
    let gathered = z3.breakdown.weight_casts;
    assert!(
        gathered > 0,
        "a block's parameters are gathered at the peak"
    );
}

#[test]
fn offload_moves_the_optimizer_state_to_the_host() {
    for (z, sharder, off) in [
        (2, Sharder::Deepspeed, Offload::Optimizer),
        (3, Sharder::Deepspeed, Offload::Optimizer),
        (3, Sharder::Deepspeed, Offload::OptimizerAndParams),
        (3, Sharder::Fsdp, Offload::OptimizerAndParams),
    ] {
        let on = with(xl(8), z, sharder, Offload::None);
        let off_s = with(xl(8), z, sharder, off);
        let a = static_bytes(&on, &param_table(&on));
        let b = static_bytes(&off_s, &param_table(&off_s));
        let what = format!("{z} {sharder} {off}");
        assert_eq!(b.optimizer_state, 0, "{what}");
        assert_eq!(b.master_weights, 0, "{what}");
        assert_eq!(a.host_bytes, 0, "{what}");
        // The host holds at least the state and the fp32 partition that left the device.
        assert!(
            b.host_bytes >= a.optimizer_state + a.master_weights,
            "{what}"
        );
        let (pa, pb) = (estimate(&on).unwrap(), estimate(&off_s).unwrap());
        assert!(pb.peak_bytes < pa.peak_bytes, "{what}");
    }
    // Parameters offload takes the 16-bit shards off the device too.
    let opt = with(xl(8), 3, Sharder::Deepspeed, Offload::Optimizer);
    let all = with(xl(8), 3, Sharder::Deepspeed, Offload::OptimizerAndParams);
    assert!(
        static_bytes(&all, &param_table(&all)).weights
            < static_bytes(&opt, &param_table(&opt)).weights
    );
}

#[test]
fn ddp_buckets_add_one_gradient_copy_unless_gradient_as_bucket_view() {
    let one = xl(1);
    let p = trained(&one);
    let ddp = xl(8);
    let mut view = xl(8);
    view.recipe.gradient_as_bucket_view = true;
    let [g1, gd, gv] = [&one, &ddp, &view].map(|s| static_bytes(s, &param_table(s)).gradients);
    // fp32 gradients under autocast; the buckets hold as many bytes again.
    assert_eq!(g1, 4 * p);
    assert_eq!(gd, 2 * 4 * p);
    assert_eq!(gv, 4 * p);
    // The buckets exist from construction: at the step's start already.
    let e = estimate(&ddp).unwrap();
    assert_eq!(e.timeline.events[0].live.gradients, 4 * p);
    assert_eq!(
        e.peak_bytes,
        estimate(&one).unwrap().peak_bytes + 4 * p,
        "one more copy of the gradients at the peak"
    );
}

#[test]
fn ddp_buckets_are_1_mib_first_then_25_mib_in_reverse_order() {
    let mib = 1u64 << 20;
    let grads = vec![10 * mib, 10 * mib, 10 * mib, 3 * mib / 4, mib / 2];
    // Reverse: 0.5 + 0.75 ≥ 1 MiB closes the first; then 10 + 10 + 10 ≥ 25 closes the second.
    assert_eq!(ddp_buckets(&grads), vec![5 * mib / 4, 30 * mib]);
    assert_eq!(ddp_buckets(&[mib / 4]), vec![mib / 4]);
    assert_eq!(
        ddp_buckets(&grads).iter().sum::<u64>(),
        30 * mib + 5 * mib / 4
    );
}

#[test]
fn prefetch_windows() {
    let g = [10, 10, 10, 10, 10];
    assert_eq!(Prefetch::None.window(&g, 1), 2..2);
    assert_eq!(Prefetch::NextBlock.window(&g, 1), 2..3);
    assert_eq!(Prefetch::NextBlock.window(&g, 4), 5..5);
    // Blocks while fewer than 25 bytes are prefetched: 10, 20, then 30 ≥ 25 stops.
    assert_eq!(Prefetch::Bytes(25).window(&g, 0), 1..4);
}

#[test]
fn fsdp2_without_resharding_keeps_every_block_gathered_until_its_backward() {
    let re = estimate(&with(xl(8), 3, Sharder::Fsdp, Offload::None)).unwrap();
    let keep = estimate(&with(xl(8), 2, Sharder::Fsdp, Offload::None)).unwrap();
    let loss = |b: &crate::estimate::Budget| {
        b.timeline
            .events
            .iter()
            .find(|e| e.label == "loss")
            .unwrap()
            .live
            .weight_casts
    };
    let s3 = with(xl(8), 3, Sharder::Fsdp, Offload::None);
    let rs3 = rank_states(&s3, &param_table(&s3), crate::spec::Dtype::F32).unwrap();
    let all: u64 = rs3.gathered_blocks.iter().sum();
    assert_eq!(loss(&keep), all + rs3.gathered_outside);
    assert_eq!(loss(&re), rs3.gathered_outside);
    assert!(keep.peak_bytes > re.peak_bytes);
}

#[test]
fn a_low_precision_module_has_no_autocast_copies_and_bf16_gradients() {
    let s = with(xl(8), 2, Sharder::Deepspeed, Offload::None);
    let b = estimate(&s).unwrap();
    assert!(b.timeline.events.iter().all(|e| e.live.weight_casts == 0));
    // DDP keeps autocast (fp32 parameters): its forward holds copies.
    let d = estimate(&xl(8)).unwrap();
    assert!(d.timeline.events.iter().any(|e| e.live.weight_casts > 0));
}

#[test]
fn comm_volume_follows_the_collectives() {
    let s = xl(8);
    let p = trained(&s) as f64;
    let v = comm_volume(&s, p, 0.0);
    // DDP: all-reduce of fp32 gradients, 2 (N − 1)/N of them.
    assert_eq!(v.link_bytes, 2.0 * 7.0 / 8.0 * 4.0 * p);
    let z3 = with(xl(8), 3, Sharder::Deepspeed, Offload::None);
    let v3 = comm_volume(&z3, p, 0.0);
    // bf16 gradients reduce-scattered, parameters gathered for forward and backward.
    assert_eq!(v3.link_bytes, 7.0 / 8.0 * (2.0 * p + 2.0 * 2.0 * p));
    let mut ck = z3.clone();
    ck.recipe.recompute = Recompute::All;
    assert!(comm_volume(&ck, p, 1.0).link_bytes > v3.link_bytes);
    assert_eq!(comm_volume(&xl(1), p, 0.0).link_bytes, 0.0);
    let off = with(xl(8), 2, Sharder::Deepspeed, Offload::Optimizer);
    assert!(comm_volume(&off, p, 0.0).host_bytes > 0.0);
}

#[test]
fn impossible_combinations_name_the_field() {
    let cases: [(u8, Sharder, Offload, bool, &str); 5] = [
        (
            0,
            Sharder::Deepspeed,
            Offload::Optimizer,
            false,
            "recipe.offload",
        ),
        (
            2,
            Sharder::Deepspeed,
            Offload::OptimizerAndParams,
            false,
            "recipe.offload",
        ),
        (1, Sharder::Fsdp, Offload::None, false, "recipe.sharder"),
        (
            3,
            Sharder::Fsdp,
            Offload::Optimizer,
            false,
            "recipe.offload",
        ),
        (
            2,
            Sharder::Deepspeed,
            Offload::None,
            true,
            "recipe.gradient_as_bucket_view",
        ),
    ];
    for (z, sharder, offload, view, field) in cases {
        let mut s = xl(8);
        s.recipe.zero_stage = z;
        s.recipe.sharder = sharder;
        s.recipe.offload = offload;
        s.recipe.gradient_as_bucket_view = view;
        let e = s.validate().unwrap_err();
        assert_eq!(e.field(), Some(field), "{z} {sharder} {offload}");
        assert!(e.to_string().contains("allowed"), "{e}");
    }
    assert!(stage_exists(&xl(8), 3));
    let mut f = xl(8);
    f.recipe.sharder = Sharder::Fsdp;
    assert!(!stage_exists(&f, 1));
}

#[test]
fn a_spec_with_sharding_fields_round_trips_and_omits_the_defaults() {
    let s = with(xl(8), 3, Sharder::Fsdp, Offload::OptimizerAndParams);
    let j = serde_json::to_string(&s).unwrap();
    assert!(j.contains("\"sharder\":\"fsdp\"") && j.contains("\"offload\":\"optimizer+params\""));
    let back: Spec = serde_json::from_str(&j).unwrap();
    assert_eq!(back.recipe, s.recipe);
    let plain = serde_json::to_string(&xl(8)).unwrap();
    assert!(!plain.contains("sharder") && !plain.contains("offload"));
}

/// A diffusers preset over 8 ranks at ZeRO-3.
fn family(name: &str) -> Spec {
    let text = crate::families::preset_config(name).unwrap();
    let map = serde_json::from_str(text).unwrap();
    let mut s = crate::denoiser::with_family(xl(8), name, map).unwrap();
    s.workload.height = 256;
    s.workload.width = 256;
    s.recipe.zero_stage = 3;
    s
}

/// The gathers are the blocks as diffusers holds them (counted with diffusers 0.42.1 on the meta
/// device: `sum(p.numel() for p in block.parameters())`), numbered across Flux's two stacks as
/// the replay numbers them.
#[test]
fn gathers_are_the_diffusers_blocks() {
    // FSDP2 gathers every parameter of a block.
    let mut f = family("flux.1-dev");
    f.recipe.sharder = Sharder::Fsdp;
    let rs = rank_states(&f, &param_table(&f), crate::spec::Dtype::F32).unwrap();
    assert_eq!(rs.gathered_blocks.len(), 19 + 38);
    assert_eq!(
        rs.gathered_blocks[0],
        2 * 339_831_296,
        "a double-stream block in bf16"
    );
    assert_eq!(
        rs.gathered_blocks[19],
        2 * 141_591_808,
        "a single-stream block in bf16"
    );
    // DeepSpeed stage 3 gathers all but the parameters of at most 1e5 elements (kept whole).
    let d = family("dit-xl-2-256");
    let table = param_table(&d);
    let rs = rank_states(&d, &table, crate::spec::Dtype::F32).unwrap();
    assert_eq!(rs.gathered_blocks.len(), 28);
    let small: u64 = table
        .iter()
        .filter(|t| t.block == Some(5) && ds3_persistent(t))
        .map(|t| 2 * t.numel())
        .sum();
    assert!(small > 0);
    assert!(rs
        .gathered_blocks
        .iter()
        .all(|&b| b + small == 2 * 26_682_624));
    // DeepSpeed's prefetch bucket (5e7 elements) reaches one DiT block past the current one
    // and then some: blocks are prefetched while fewer than 1e8 bytes are.
    let w = rs.prefetch.window(&rs.gathered_blocks, 0);
    assert_eq!(w, 1..3);
}
