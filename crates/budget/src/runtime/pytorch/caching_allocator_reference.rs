//! The allocator as it was written before its blocks became a linked arena (commit 7983bd3):
//! kept, for tests only, as the reference the faster one is held equal to event by event
//! (`caching_allocator_tests.rs`, `the_arena_allocator_equals_the_reference`).

use std::collections::{BTreeSet, HashMap};

use super::arena::IdHash;
use super::conf::{
    allocation_size, round_size, AllocConf, AllocatorReport, Oom, LARGE_BUFFER, MIN_BLOCK_SIZE,
    SMALL_BUFFER, SMALL_SIZE,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Blk {
    /// Bytes from the segment's start (blocks are contiguous: each starts where the last ends).
    offset: u64,
    size: u64,
    /// The id of the tensor holding it, `None` when cached (free).
    owner: Option<u64>,
    requested: u64,
}

#[derive(Debug, Clone)]
struct Seg {
    small: bool,
    stream: u32,
    expandable: bool,
    /// Contiguous blocks from the segment's start (the mapped range for an expandable one).
    blocks: Vec<Blk>,
}

impl Seg {
    fn size(&self) -> u64 {
        self.blocks.iter().map(|b| b.size).sum()
    }
}

/// The simulated `DeviceCachingAllocator` of one device.
#[derive(Debug, Clone)]
pub(crate) struct ReferenceAllocator {
    conf: AllocConf,
    /// Bytes the allocator may reserve (device memory less the context); `u64::MAX` = unlimited.
    capacity: u64,
    segs: Vec<Option<Seg>>,
    /// Each allocated id's segment and its block's offset there (an allocated block never
    /// moves: splits add blocks after it, merges join only free ones).
    where_: HashMap<u64, (usize, u64), IdHash>,
    /// Every cached (free) block as (small, stream, size, segment, offset): the order in which
    /// `get_free_block` picks one (smallest size, then the first segment, then the lowest
    /// offset), so a request finds its block in O(log n) instead of scanning every block.
    free: BTreeSet<FreeKey>,
    allocated: u64,
    reserved: u64,
    requested: u64,
    report: AllocatorReport,
}

/// A cached block in the free set: (small, stream, size, segment, offset).
type FreeKey = (bool, u32, u64, usize, u64);

fn free_key(seg: &Seg, s: usize, b: &Blk) -> FreeKey {
    (seg.small, seg.stream, b.size, s, b.offset)
}

impl ReferenceAllocator {
    pub(super) fn new(conf: AllocConf, capacity: Option<u64>) -> ReferenceAllocator {
        ReferenceAllocator {
            conf,
            capacity: capacity.unwrap_or(u64::MAX),
            segs: Vec::new(),
            where_: HashMap::default(),
            free: BTreeSet::new(),
            allocated: 0,
            reserved: 0,
            requested: 0,
            report: AllocatorReport::default(),
        }
    }

    pub(super) fn allocated(&self) -> u64 {
        self.allocated
    }

    pub(super) fn reserved(&self) -> u64 {
        self.reserved
    }

    fn note_peaks(&mut self) {
        let r = &mut self.report;
        r.max_reserved = r.max_reserved.max(self.reserved);
        if self.allocated > r.max_allocated {
            r.max_allocated = self.allocated;
            r.reserved_at_max_allocated = self.reserved;
            r.fragmentation_at_peak = self.reserved - self.allocated;
        }
        r.max_requested = r.max_requested.max(self.requested);
    }

    fn fits(&self, extra: u64) -> bool {
        self.reserved
            .checked_add(extra)
            .is_some_and(|t| t <= self.capacity)
    }

    /// `get_free_block`: the smallest cached block of the pool and stream that holds `size`
    /// (ties by address), then the oversize rules: a request below `max_split_size` never takes
    /// a block at or above it; a request at or above it takes a block only below
    /// `size + max_non_split_rounding`.
    fn get_free_block(&self, size: u64, small: bool, stream: u32) -> Option<(usize, usize)> {
        let &(_, _, bsize, s, offset) = self
            .free
            .range((small, stream, size, 0, 0)..)
            .next()
            .filter(|key| key.0 == small && key.1 == stream)?;
        let k = self.segs[s]
            .as_ref()?
            .blocks
            .binary_search_by_key(&offset, |b| b.offset)
            .ok()?;
        let m = self.conf.max_split_size;
        if size < m && bsize >= m {
            return None;
        }
        if size >= m && bsize >= size.saturating_add(self.conf.max_non_split_rounding) {
            return None;
        }
        Some((s, k))
    }

    /// `alloc_block` without expandable segments: `cudaMalloc(alloc_size)` if it fits.
    fn alloc_block(&mut self, alloc_size: u64, small: bool, stream: u32) -> Option<(usize, usize)> {
        if !self.fits(alloc_size) {
            return None;
        }
        self.reserved += alloc_size;
        self.report.device_allocs += 1;
        let seg = Seg {
            small,
            stream,
            expandable: false,
            blocks: vec![Blk {
                offset: 0,
                size: alloc_size,
                owner: None,
                requested: 0,
            }],
        };
        let s = self.segs.len();
        self.free.insert(free_key(&seg, s, &seg.blocks[0]));
        self.segs.push(Some(seg));
        Some((s, 0))
    }

    /// `try_allocate_expandable_block` / `map_block`: the pool's segment for this stream grows
    /// at its end in pages of 2 MiB (small pool) or 20 MiB (large pool), the free block that
    /// ends it (if any) merging with the new pages.
    fn alloc_expandable(&mut self, size: u64, small: bool, stream: u32) -> Option<(usize, usize)> {
        let page = if small { SMALL_BUFFER } else { LARGE_BUFFER };
        let found = self.segs.iter().position(|s| {
            s.as_ref()
                .is_some_and(|s| s.expandable && s.small == small && s.stream == stream)
        });
        let s = match found {
            Some(s) => s,
            None => {
                self.segs.push(Some(Seg {
                    small,
                    stream,
                    expandable: true,
                    blocks: Vec::new(),
                }));
                self.segs.len() - 1
            }
        };
        let seg = self.segs[s].as_ref()?;
        let tail_free = seg
            .blocks
            .last()
            .filter(|b| b.owner.is_none())
            .map_or(0, |b| b.size);
        let extra = (size - tail_free).div_ceil(page) * page;
        if !self.fits(extra) {
            if seg.blocks.is_empty() {
                self.segs[s] = None;
            }
            return None;
        }
        self.reserved += extra;
        self.report.device_allocs += 1;
        let seg = self.segs[s].as_mut()?;
        let end = seg.size();
        match seg.blocks.last() {
            Some(b) if b.owner.is_none() => {
                self.free.remove(&free_key(seg, s, b));
                seg.blocks.last_mut()?.size += extra;
            }
            _ => seg.blocks.push(Blk {
                offset: end,
                size: extra,
                owner: None,
                requested: 0,
            }),
        }
        let last = seg.blocks.last()?;
        self.free.insert(free_key(seg, s, last));
        Some((s, seg.blocks.len() - 1))
    }

    /// `release_block` of a whole cached segment.
    fn release_segment(&mut self, s: usize) {
        if let Some(seg) = self.segs[s].take() {
            for b in seg.blocks.iter().filter(|b| b.owner.is_none()) {
                self.free.remove(&free_key(&seg, s, b));
            }
            self.reserved -= seg.size();
            self.report.device_frees += 1;
        }
    }

    /// Whole (unsplit) cached segments of a pool and stream, as (size, index).
    fn whole_free(&self, small: bool, stream: Option<u32>) -> Vec<(u64, usize)> {
        let mut v: Vec<(u64, usize)> = self
            .segs
            .iter()
            .enumerate()
            .filter_map(|(s, seg)| {
                let seg = seg.as_ref()?;
                (!seg.expandable
                    && seg.small == small
                    && stream.is_none_or(|st| st == seg.stream)
                    && seg.blocks.len() == 1
                    && seg.blocks[0].owner.is_none())
                .then(|| (seg.blocks[0].size, s))
            })
            .collect();
        v.sort();
        v
    }

    /// `release_available_cached_blocks`: only with a `max_split_size`; frees the smallest
    /// cached block of at least max(size, max_split_size), else oversize blocks from the largest
    /// down until that much is freed (those freed stay freed even when it falls short).
    fn release_available(&mut self, size: u64, small: bool, stream: u32) -> bool {
        let m = self.conf.max_split_size;
        if m == u64::MAX {
            return false;
        }
        let key = size.max(m);
        let cached = self.whole_free(small, Some(stream));
        if let Some(&(_, s)) = cached.iter().find(|(b, _)| *b >= key) {
            self.release_segment(s);
            return true;
        }
        let mut total = 0;
        for &(b, s) in cached.iter().rev() {
            if total >= key || b < m {
                break;
            }
            total += b;
            self.release_segment(s);
        }
        total >= key
    }

    /// `release_cached_blocks` → `release_blocks` on both pools: every cached block that is a
    /// whole segment is `cudaFree`d; with expandable segments the free pages that end a segment
    /// are unmapped (`unmap_block`).
    fn release_cached(&mut self) {
        for small in [false, true] {
            for (_, s) in self.whole_free(small, None) {
                self.release_segment(s);
            }
        }
        for s in 0..self.segs.len() {
            let Some(seg) = self.segs[s].as_mut() else {
                continue;
            };
            if !seg.expandable {
                continue;
            }
            let page = if seg.small {
                SMALL_BUFFER
            } else {
                LARGE_BUFFER
            };
            let end = seg.size();
            let Some(&last) = seg.blocks.last().filter(|b| b.owner.is_none()) else {
                continue;
            };
            let start = end - last.size;
            let unmap = end - start.div_ceil(page) * page;
            if unmap > 0 {
                self.free.remove(&free_key(seg, s, &last));
                let kept = last.size - unmap;
                if kept == 0 {
                    seg.blocks.pop();
                } else {
                    let b = seg.blocks.last_mut().expect("the last block");
                    b.size = kept;
                    self.free
                        .insert(free_key(seg, s, &seg.blocks[seg.blocks.len() - 1]));
                }
                self.reserved -= unmap;
                self.report.device_frees += 1;
            }
            if seg.blocks.is_empty() {
                self.segs[s] = None;
            }
        }
    }

    /// `should_split`: small pool or expandable segments: a remainder ≥ 512 B; large pool: only
    /// a request below `max_split_size` with a remainder above 1 MiB (`remaining > kSmallSize`).
    fn should_split(&self, block: u64, size: u64, small: bool) -> bool {
        let remaining = block - size;
        if small || self.conf.expandable_segments {
            remaining >= MIN_BLOCK_SIZE
        } else {
            size < self.conf.max_split_size && remaining > SMALL_SIZE
        }
    }

    /// `malloc`: round, pick the pool, search the cache, else allocate a segment, else release
    /// oversize cached blocks and retry, else release every unsplit cached block and retry, else
    /// out of memory. On success the block is split per `should_split` (`alloc_found_block`).
    pub(super) fn malloc(&mut self, id: u64, bytes: u64, stream: u32) -> Result<(), Oom> {
        let size = round_size(bytes, &self.conf);
        let small = size <= SMALL_SIZE;
        let alloc_size = allocation_size(size);
        let expandable = self.conf.expandable_segments;
        let mut found = self.get_free_block(size, small, stream);
        if found.is_none() {
            let alloc = |a: &mut Self| {
                if expandable {
                    a.alloc_expandable(size, small, stream)
                } else {
                    a.alloc_block(alloc_size, small, stream)
                }
            };
            found = alloc(self);
            if found.is_none() && self.release_available(size, small, stream) {
                self.report.alloc_retries += 1;
                found = alloc(self);
            }
            if found.is_none() {
                self.release_cached();
                self.report.alloc_retries += 1;
                found = alloc(self);
            }
        }
        let Some((s, k)) = found else {
            return Err(Oom {
                event: 0,
                id,
                requested: bytes,
                rounded: size,
                alloc_size: if expandable { size } else { alloc_size },
                allocated: self.allocated,
                reserved: self.reserved,
                capacity: self.capacity,
            });
        };
        let block = self.segs[s].as_ref().map_or(0, |g| g.blocks[k].size);
        let split = self.should_split(block, size, small);
        let seg = self.segs[s].as_mut().expect("found segment");
        self.free.remove(&free_key(seg, s, &seg.blocks[k]));
        let taken = if split {
            seg.blocks[k].size = size;
            let rest = Blk {
                offset: seg.blocks[k].offset + size,
                size: block - size,
                owner: None,
                requested: 0,
            };
            self.free.insert(free_key(seg, s, &rest));
            seg.blocks.insert(k + 1, rest);
            size
        } else {
            block
        };
        seg.blocks[k].owner = Some(id);
        seg.blocks[k].requested = bytes;
        self.where_.insert(id, (s, seg.blocks[k].offset));
        self.allocated += taken;
        self.requested += bytes;
        self.note_peaks();
        Ok(())
    }

    /// `free` → `free_block`: the block returns to its pool and merges with free neighbours
    /// (`try_merge_blocks` on prev and next). Returns false for an id that is not allocated.
    pub(super) fn free(&mut self, id: u64) -> bool {
        let Some((s, offset)) = self.where_.remove(&id) else {
            return false;
        };
        let Some(seg) = self.segs[s].as_mut() else {
            return false;
        };
        let Some(k) = seg
            .blocks
            .binary_search_by_key(&offset, |b| b.offset)
            .ok()
            .filter(|&k| seg.blocks[k].owner == Some(id))
        else {
            return false;
        };
        self.allocated -= seg.blocks[k].size;
        self.requested -= seg.blocks[k].requested;
        seg.blocks[k].owner = None;
        seg.blocks[k].requested = 0;
        let mut k = k;
        if k + 1 < seg.blocks.len() && seg.blocks[k + 1].owner.is_none() {
            self.free.remove(&free_key(seg, s, &seg.blocks[k + 1]));
            seg.blocks[k].size += seg.blocks.remove(k + 1).size;
        }
        if k > 0 && seg.blocks[k - 1].owner.is_none() {
            self.free.remove(&free_key(seg, s, &seg.blocks[k - 1]));
            let b = seg.blocks.remove(k);
            k -= 1;
            seg.blocks[k].size += b.size;
        }
        self.free.insert(free_key(seg, s, &seg.blocks[k]));
        true
    }

    /// `emptyCache` (`torch.cuda.empty_cache()`).
    pub(crate) fn empty_cache(&mut self) {
        self.release_cached();
    }

    /// The counters so far (final values filled in).
    pub(super) fn report(&self) -> AllocatorReport {
        AllocatorReport {
            final_allocated: self.allocated,
            final_reserved: self.reserved,
            ..self.report
        }
    }
}
