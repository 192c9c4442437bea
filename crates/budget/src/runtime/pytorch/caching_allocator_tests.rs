//! Hand-built allocation sequences whose outcome follows from the allocator's rules (each test
//! names the rule of `CUDACachingAllocator.cpp` it exercises).

use super::arena::*;
use super::conf::*;
use super::*;

const KIB: u64 = 1 << 10;

fn a(id: u64, bytes: u64) -> AllocEvent {
    AllocEvent::Alloc {
        id,
        bytes,
        stream: 0,
    }
}

fn f(id: u64) -> AllocEvent {
    AllocEvent::Free { id }
}

fn run(events: &[AllocEvent], conf: &str, capacity: Option<u64>) -> AllocatorReport {
    simulate_allocator(events, &AllocConf::parse(conf).unwrap(), capacity).unwrap()
}

#[test]
fn round_size_512_and_power2_divisions() {
    let d = AllocConf::default();
    assert_eq!(round_size(1, &d), 512);
    assert_eq!(round_size(512, &d), 512);
    assert_eq!(round_size(513, &d), 1024);
    assert_eq!(round_size(13 * MIB, &d), 13 * MIB);
    // `roundup_power2_next_division`: 4 steps between 1 MiB and 2 MiB → 1,200 KiB → 1.25 MiB.
    let c = AllocConf::parse("roundup_power2_divisions:4").unwrap();
    assert_eq!(round_size(1200 * KIB, &c), 1280 * KIB);
    // At or below 512 × divisions the 512 B rounding applies: 1,200 B → 1,536 B.
    assert_eq!(round_size(1200, &c), 1536);
    // A power of two is kept.
    assert_eq!(round_size(4 * MIB, &c), 4 * MIB);
    // The segment `cudaMalloc`ed for a request no cached block serves (`get_allocation_size`):
    // 2 MiB up to 1 MiB, 20 MiB below 10 MiB, else rounded up to 2 MiB.
    assert_eq!(allocation_size(round_size(1000, &d)), 2 * MIB);
    assert_eq!(allocation_size(round_size(5 * MIB, &d)), 20 * MIB);
    assert_eq!(allocation_size(round_size(11 * MIB + 1, &d)), 12 * MIB);
}

#[test]
fn a_1_5_mib_request_gets_a_20_mib_segment_and_splits_it() {
    // get_allocation_size: 1 MiB < size < 10 MiB → kLargeBuffer; the remainder (18.5 MiB >
    // 1 MiB) is split off and serves the second request from the cache.
    let r = run(&[a(1, 3 * MIB / 2), a(2, 3 * MIB / 2)], "", None);
    assert_eq!(r.max_reserved, 20 * MIB);
    assert_eq!(r.max_allocated, 3 * MIB);
    assert_eq!(r.device_allocs, 1);
    assert_eq!(r.fragmentation_at_peak, 17 * MIB);
}

#[test]
fn a_13_mib_request_is_rounded_to_14_mib_and_the_1_mib_rest_not_split() {
    // get_allocation_size: ≥ 10 MiB → rounded to kRoundLarge (2 MiB); should_split: the 1 MiB
    // remainder is not > kSmallSize, so the whole 14 MiB block is allocated.
    let r = run(&[a(1, 13 * MIB)], "", None);
    assert_eq!(r.max_reserved, 14 * MIB);
    assert_eq!(r.max_allocated, 14 * MIB);
    assert_eq!(r.max_requested, 13 * MIB);
    // 12.5 MiB: remainder 1.5 MiB > 1 MiB is split off: allocated 12.5 MiB of 14.
    let r = run(&[a(1, 25 * MIB / 2)], "", None);
    assert_eq!((r.max_reserved, r.max_allocated), (14 * MIB, 25 * MIB / 2));
}

#[test]
fn small_pool_packs_2_mib_segments_and_pools_are_separate() {
    // ≤ 1 MiB → small pool, 2 MiB segment, split when the remainder ≥ 512 B.
    let r = run(&[a(1, 1000), a(2, 512), a(3, MIB)], "", None);
    assert_eq!(r.max_reserved, 2 * MIB);
    assert_eq!(r.max_allocated, 1024 + 512 + MIB);
    assert_eq!(r.device_allocs, 1);
    // A free small block never serves a large request: 1 MiB + 1 B takes a 20 MiB segment.
    let r = run(&[a(1, MIB), f(1), a(2, MIB + 1)], "", None);
    assert_eq!(r.max_reserved, 22 * MIB);
    assert_eq!(r.device_allocs, 2);
}

#[test]
fn best_fit_takes_the_smallest_cached_block_that_holds_the_request() {
    // Three exact segments of 12, 16 and 14 MiB; 12 and 16 are cached. 11 MiB takes the 12 MiB
    // block (not the 16), 15 MiB then takes the 16 MiB one: no new segment.
    let ev = [
        a(1, 12 * MIB),
        a(2, 16 * MIB),
        a(3, 14 * MIB),
        f(1),
        f(2),
        a(4, 11 * MIB),
        a(5, 15 * MIB),
    ];
    let r = run(&ev, "", None);
    assert_eq!(r.max_reserved, 42 * MIB);
    assert_eq!(r.device_allocs, 3);
    // Remainders of exactly 1 MiB are not split: the blocks are allocated whole.
    assert_eq!(r.final_allocated, 12 * MIB + 16 * MIB + 14 * MIB);
}

#[test]
fn streams_do_not_share_cached_blocks() {
    let ev = [
        a(1, 3 * MIB / 2),
        f(1),
        AllocEvent::Alloc {
            id: 2,
            bytes: 3 * MIB / 2,
            stream: 1,
        },
    ];
    assert_eq!(run(&ev, "", None).max_reserved, 40 * MIB);
}

#[test]
fn freed_neighbours_merge_back_into_one_block() {
    // free_block → try_merge_blocks: three 2 MiB blocks of one 20 MiB segment freed merge
    // with the 14 MiB rest into one 20 MiB block, which then serves a 16 MiB request. Without
    // the merge the largest free block would be 14 MiB and a 16 MiB segment would not fit the
    // 20 MiB capacity.
    let ev = [
        a(1, 2 * MIB),
        a(2, 2 * MIB),
        a(3, 2 * MIB),
        f(2),
        f(1),
        f(3),
        a(4, 16 * MIB),
    ];
    let r = run(&ev, "", Some(20 * MIB));
    assert!(r.oom.is_none());
    assert_eq!(r.max_reserved, 20 * MIB);
    assert_eq!(r.device_allocs, 1);
    // The 4 MiB remainder (> 1 MiB) is split off: 16 MiB allocated.
    assert_eq!(r.final_allocated, 16 * MIB);
}

#[test]
fn oversize_blocks_are_not_split_and_only_serve_close_requests() {
    // max_split_size_mb:20. A 40 MiB block is oversize: a 30 MiB request (≥ max_split, and
    // 40 < 30 + 20) takes it whole; a 4 MiB request (< max_split) may not take it and gets
    // its own 20 MiB segment.
    let conf = "max_split_size_mb:20";
    let r = run(&[a(1, 40 * MIB), f(1), a(2, 30 * MIB)], conf, None);
    assert_eq!((r.max_reserved, r.final_allocated), (40 * MIB, 40 * MIB));
    let r = run(&[a(1, 40 * MIB), f(1), a(2, 4 * MIB)], conf, None);
    assert_eq!(r.max_reserved, 60 * MIB);
    // Without max_split_size the 40 MiB block is split for the 4 MiB request.
    let r = run(&[a(1, 40 * MIB), f(1), a(2, 4 * MIB)], "", None);
    assert_eq!((r.max_reserved, r.final_allocated), (40 * MIB, 4 * MIB));
    // 60 MiB ≥ 30 + 20: too large to round a 30 MiB request up to; a new 30 MiB segment.
    let r = run(&[a(1, 60 * MIB), f(1), a(2, 30 * MIB)], conf, None);
    assert_eq!(r.max_reserved, 90 * MIB);
    // max_non_split_rounding_mb widens the window: 60 < 30 + 40.
    let r = run(
        &[a(1, 60 * MIB), f(1), a(2, 30 * MIB)],
        "max_split_size_mb:20,max_non_split_rounding_mb:40",
        None,
    );
    assert_eq!(r.max_reserved, 60 * MIB);
}

#[test]
fn release_available_cached_blocks_frees_an_oversize_block_before_failing() {
    // Capacity 60 MiB, a cached 50 MiB oversize block: 24 MiB may not take it (50 ≥ 24 + 20),
    // cudaMalloc(24 MiB) fails (50 + 24 > 60), release_available_cached_blocks frees the 50 MiB
    // block (the smallest ≥ max(24, 20) MiB) and the retry succeeds.
    let r = run(
        &[a(1, 50 * MIB), f(1), a(2, 24 * MIB)],
        "max_split_size_mb:20",
        Some(60 * MIB),
    );
    assert!(r.oom.is_none());
    assert_eq!(r.final_reserved, 24 * MIB);
    assert_eq!(r.max_reserved, 50 * MIB);
    assert_eq!(r.alloc_retries, 1);
}

#[test]
fn a_failed_cuda_malloc_releases_the_cache_and_retries_before_an_oom() {
    // Capacity 40 MiB, a cached 30 MiB segment: 32 MiB cannot reuse it and cudaMalloc fails;
    // release_cached_blocks frees it and the retry succeeds.
    let r = run(&[a(1, 30 * MIB), f(1), a(2, 32 * MIB)], "", Some(40 * MIB));
    assert!(r.oom.is_none());
    assert_eq!((r.final_reserved, r.max_reserved), (32 * MIB, 32 * MIB));
    assert_eq!((r.alloc_retries, r.device_frees), (1, 1));
    // With the 30 MiB still allocated nothing can be released: an OOM at event 1.
    let r = run(&[a(1, 30 * MIB), a(2, 12 * MIB)], "", Some(40 * MIB));
    let oom = r.oom.unwrap();
    assert_eq!((oom.event, oom.id), (1, 2));
    assert_eq!((oom.rounded, oom.alloc_size), (12 * MIB, 12 * MIB));
    assert_eq!((oom.allocated, oom.reserved), (30 * MIB, 30 * MIB));
}

/// Ten 6 MiB tensors: three fit a 20 MiB segment with 2 MiB left, so four segments (80 MiB)
/// hold 60 MiB.
fn fragmenting() -> Vec<AllocEvent> {
    (0..10).map(|i| a(i, 6 * MIB)).collect()
}

#[test]
fn expandable_segments_remove_the_fragmentation_between_segments() {
    let r = run(&fragmenting(), "", None);
    assert_eq!((r.max_allocated, r.max_reserved), (60 * MIB, 80 * MIB));
    assert_eq!(r.fragmentation_at_peak, 20 * MIB);
    // One segment grows in 20 MiB pages: 60 MiB mapped for 60 MiB allocated.
    let r = run(&fragmenting(), "expandable_segments:True", None);
    assert_eq!((r.max_allocated, r.max_reserved), (60 * MIB, 60 * MIB));
    assert_eq!(r.fragmentation_at_peak, 0);
    // Against 70 MiB the classic allocator fails at the tenth tensor, expandable fits.
    let r = run(&fragmenting(), "", Some(70 * MIB));
    assert_eq!(r.oom.map(|o| o.event), Some(9));
    assert!(
        run(&fragmenting(), "expandable_segments:True", Some(70 * MIB))
            .oom
            .is_none()
    );
}

#[test]
fn expandable_segments_unmap_free_pages_on_a_failed_map() {
    // Stream 0 maps two 20 MiB pages for 40 MiB and frees them; stream 1's 30 MiB needs two
    // pages of its own segment, 80 MiB > 45 MiB: release_cached_blocks unmaps stream 0's free
    // pages (unmap_block) and the retry maps 40 MiB.
    let ev = [
        a(1, 40 * MIB),
        f(1),
        AllocEvent::Alloc {
            id: 2,
            bytes: 30 * MIB,
            stream: 1,
        },
    ];
    let r = run(&ev, "expandable_segments:True", Some(45 * MIB));
    assert!(r.oom.is_none(), "{r:?}");
    assert_eq!(r.final_reserved, 40 * MIB);
    assert_eq!(r.max_reserved, 40 * MIB);
}

#[test]
fn conf_parses_the_documented_keys() {
    let c = AllocConf::parse("max_split_size_mb:128, expandable_segments:True").unwrap();
    assert_eq!(c.max_split_size, 128 * MIB);
    assert!(c.expandable_segments);
    assert_eq!(AllocConf::parse("").unwrap(), AllocConf::default());
    // Bracketed form: the first key fills below it, `>` fills from the last key's interval on.
    let c = AllocConf::parse("roundup_power2_divisions:[256:1,512:2,>:8]").unwrap();
    assert_eq!(c.roundup_power2_divisions[..9], [1; 9]);
    assert_eq!(c.roundup_power2_divisions[9..], [8; 7]);
    let c = AllocConf::parse("roundup_power2_divisions:[64:8,256:2]").unwrap();
    assert_eq!(c.divisions_for(MIB), 8);
    assert_eq!(c.divisions_for(300 * MIB), 2);
    // 64 MiB ≤ 100 MiB < 128 MiB: the 64 interval; 128–256 MiB was named by no key.
    assert_eq!(c.divisions_for(100 * MIB), 8);
    assert_eq!(c.divisions_for(150 * MIB), 0);
    let c = AllocConf::parse("garbage_collection_threshold:0.6,backend:native").unwrap();
    assert_eq!(c.garbage_collection_threshold, Some(0.6));
}

#[test]
fn conf_errors_name_the_key() {
    let key_of = |s: &str| match AllocConf::parse(s).unwrap_err() {
        AllocConfError::Value { key, .. } | AllocConfError::UnknownKey { key, .. } => key,
        AllocConfError::Syntax { message } => message,
    };
    assert_eq!(key_of("max_split_size_mb:10"), "max_split_size_mb");
    assert_eq!(key_of("max_split_size_mb:lots"), "max_split_size_mb");
    assert_eq!(key_of("expandable_segments:yes"), "expandable_segments");
    assert_eq!(
        key_of("roundup_power2_divisions:3"),
        "roundup_power2_divisions"
    );
    assert_eq!(
        key_of("roundup_power2_divisions:[100:2]"),
        "roundup_power2_divisions"
    );
    assert_eq!(
        key_of("garbage_collection_threshold:1.5"),
        "garbage_collection_threshold"
    );
    assert_eq!(key_of("backend:cudaMallocAsync"), "backend");
    assert_eq!(key_of("max_split:20"), "max_split");
    assert!(key_of("max_split_size_mb").contains("max_split_size_mb"));
    let line = AllocConf::parse("foo:1").unwrap_err().to_string();
    assert!(line.contains("unknown key 'foo'") && line.contains("expandable_segments"));
}

#[test]
fn sequence_errors_are_typed() {
    let d = AllocConf::default();
    assert_eq!(
        simulate_allocator(&[f(3)], &d, None),
        Err(SequenceError::UnknownFree { event: 0, id: 3 })
    );
    assert_eq!(
        simulate_allocator(&[a(1, 8), a(1, 8)], &d, None),
        Err(SequenceError::DuplicateId { event: 1, id: 1 })
    );
}

#[test]
fn cublas_workspaces_go_through_the_allocator() {
    let d = AllocConf::default();
    // sm90: 32 MiB per stream, ≥ 10 MiB → a 32 MiB segment each.
    let h100 = crate::gpu::lookup("h100").unwrap();
    let m = simulate_on_gpu(&[], h100, &d, &[0, 1]).unwrap();
    assert_eq!(
        (m.allocator.max_allocated, m.allocator.max_reserved),
        (64 * MIB, 64 * MIB)
    );
    assert_eq!(m.device_bytes, h100.context_bytes + 64 * MIB);
    assert!(m.fits);
    // sm80: 8.125 MiB (a multiple of 512) < 10 MiB → a 20 MiB segment each; the second
    // workspace does not fit the first segment's 11.875 MiB rest.
    let a100 = crate::gpu::lookup("a100-80gb").unwrap();
    let m = simulate_on_gpu(&[], a100, &d, &[0, 1]).unwrap();
    assert_eq!(m.allocator.max_allocated, 2 * 8_519_680);
    assert_eq!(m.allocator.max_reserved, 40 * MIB);
    // One stream: the workspace's 20 MiB segment is then shared by a 10 MiB tensor.
    let m = simulate_on_gpu(&[a(1, 11 * MIB)], a100, &d, &[0]).unwrap();
    assert_eq!(m.allocator.max_reserved, 20 * MIB);
    // A tensor bigger than the card less its context does not fit.
    let t4 = crate::gpu::lookup("t4").unwrap();
    let m = simulate_on_gpu(&[a(1, 15 * GIB_T4)], t4, &d, &[0]).unwrap();
    assert!(!m.fits);
    assert_eq!(m.allocator.oom.unwrap().event, 1);
}

const GIB_T4: u64 = 1 << 30;

/// Replay `events` on the linked-arena allocator and on the reference (the allocator as it was
/// before, `caching_allocator_reference.rs`) side by side: allocated and reserved after every
/// event, where an allocation fails, and the final report must be the same.
fn held_equal(events: &[AllocEvent], conf: &str, capacity: Option<u64>) -> usize {
    let c = AllocConf::parse(conf).unwrap();
    let mut new = CachingAllocator::new(c.clone(), capacity);
    let mut old = super::reference::ReferenceAllocator::new(c, capacity);
    for (k, e) in events.iter().enumerate() {
        match *e {
            AllocEvent::Alloc { id, bytes, stream } => {
                let (n, o) = (new.malloc(id, bytes, stream), old.malloc(id, bytes, stream));
                assert_eq!(n, o, "{conf:?} event {k}: malloc({id}, {bytes}, {stream})");
                if n.is_err() {
                    assert_eq!(new.report(), old.report(), "{conf:?} at the OOM");
                    return k;
                }
            }
            AllocEvent::Free { id } => {
                assert_eq!(new.free(id), old.free(id), "{conf:?} event {k}: free({id})");
            }
        }
        assert_eq!(
            (new.allocated(), new.reserved()),
            (old.allocated(), old.reserved()),
            "{conf:?} event {k}: {e:?}"
        );
    }
    new.empty_cache();
    old.empty_cache();
    assert_eq!(new.report(), old.report(), "{conf:?} after empty_cache");
    events.len()
}

/// The allocator settings the equality is held under: defaults, expandable segments, an
/// oversize threshold (`release_available_cached_blocks`), power-of-two rounding, and both.
const CONFS: [&str; 5] = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:64",
    "max_split_size_mb:32,roundup_power2_divisions:4,max_non_split_rounding_mb:24",
    "expandable_segments:True,max_split_size_mb:64,roundup_power2_divisions:[256:4,>:1]",
];

/// Random sequences (a fixed-seed generator, so a failure repeats): small, medium and large
/// requests on two streams, frees of random live tensors, unknown and repeated frees, a
/// capacity that makes the retry paths and OOMs happen.
#[test]
fn the_arena_allocator_equals_the_reference_on_random_sequences() {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut next = move || {
        // xorshift64* (Vigna 2016).
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let mut ooms = 0;
    for round in 0..60 {
        let mut live: Vec<u64> = Vec::new();
        let mut events = Vec::new();
        let mut id = 1;
        for _ in 0..3_000 {
            let r = next();
            if live.is_empty() || r % 100 < 55 {
                let bytes = match next() % 10 {
                    0..=3 => next() % (SMALL_SIZE + 1),
                    4..=6 => next() % (12 * MIB),
                    7 | 8 => next() % (200 * MIB),
                    _ => 256 * MIB + next() % (2048 * MIB),
                };
                let stream = u32::from(next() % 8 == 0);
                events.push(AllocEvent::Alloc { id, bytes, stream });
                live.push(id);
                id += if next() % 4 == 0 { 1 << 40 } else { 1 };
            } else {
                let k = (next() % live.len() as u64) as usize;
                events.push(f(live.swap_remove(k)));
            }
        }
        let capacity = match round % 3 {
            0 => None,
            1 => Some(8 << 30),
            _ => Some(3 << 30),
        };
        for conf in CONFS {
            if held_equal(&events, conf, capacity) < events.len() {
                ooms += 1;
            }
        }
    }
    // The capacities made some sequences run out, so the retry and OOM paths were compared.
    assert!(ooms > 0);
    // Frees of ids never allocated, or freed twice, answer false in both.
    held_equal(&[a(1, 8), f(1), f(1), f(7)], "", None);
}

/// Real step sequences (`trace.rs`) of the families and recipes the planner tries, on a card
/// that some of them overflow.
#[test]
fn the_arena_allocator_equals_the_reference_on_step_sequences() {
    use crate::runtime::pytorch::trace::allocation_sequence;
    use crate::spec::{ModelSpec, Recompute, Spec};
    let mut specs = Vec::new();
    for (preset, res, batch) in [
        ("dit-s-2", 256, 8),
        ("pixart-alpha-1024", 512, 2),
        ("sana-600m", 512, 2),
        ("flux.1-dev", 256, 1),
    ] {
        for rc in [Recompute::None, Recompute::EveryK(2), Recompute::All] {
            let mut s = match crate::families::preset_config(preset) {
                Some(text) => crate::denoiser::with_family(
                    Spec::default_xl(),
                    preset,
                    serde_json::from_str(text).unwrap(),
                )
                .unwrap(),
                None => Spec {
                    model: ModelSpec::preset(preset).unwrap(),
                    ..Spec::default_xl()
                },
            };
            s.workload.height = res;
            s.workload.width = res;
            s.workload.batch = batch;
            s.workload.microbatch = batch;
            s.runtime = "pytorch:cuda".parse().unwrap();
            s.recipe.recompute = rc;
            s.validate().unwrap();
            specs.push(s);
        }
    }
    for s in specs {
        let table = crate::denoiser::param_table(&s);
        let seq = allocation_sequence(&s, &table);
        for conf in CONFS {
            held_equal(&seq, conf, None);
            held_equal(&seq, conf, Some(3 << 30));
        }
    }
}
