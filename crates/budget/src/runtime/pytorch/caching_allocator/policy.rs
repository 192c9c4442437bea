//! What the allocator does whatever holds its blocks: the counters against the capacity, and
//! `malloc`'s path from a request to a block (the cache, a new segment, the two releases and
//! their retries, out of memory) over a [`BlockStore`]: the linked arena ([`super::arena`]) and,
//! for tests, the reference it is held equal to.

use super::conf::{
    allocation_size, round_size, AllocConf, AllocatorReport, Oom, MIN_BLOCK_SIZE, SMALL_SIZE,
};

/// The counters of `DeviceStats` that the report reads, against the bytes the allocator may
/// reserve.
#[derive(Debug, Clone)]
pub(super) struct Counters {
    /// Bytes the allocator may reserve (device memory less the context); `u64::MAX` = unlimited.
    capacity: u64,
    pub(super) allocated: u64,
    pub(super) reserved: u64,
    requested: u64,
    pub(super) report: AllocatorReport,
}

impl Counters {
    pub(super) fn new(capacity: Option<u64>) -> Counters {
        Counters {
            capacity: capacity.unwrap_or(u64::MAX),
            allocated: 0,
            reserved: 0,
            requested: 0,
            report: AllocatorReport::default(),
        }
    }

    /// Whether `extra` more reserved bytes stay within the capacity.
    pub(super) fn fits(&self, extra: u64) -> bool {
        self.reserved
            .checked_add(extra)
            .is_some_and(|t| t <= self.capacity)
    }

    /// A `cudaMalloc` (or a page mapping) of `bytes`.
    pub(super) fn device_alloc(&mut self, bytes: u64) {
        self.reserved += bytes;
        self.report.device_allocs += 1;
    }

    /// A `cudaFree` (or an unmapping) of `bytes`.
    pub(super) fn device_free(&mut self, bytes: u64) {
        self.reserved -= bytes;
        self.report.device_frees += 1;
    }

    /// A block of `taken` bytes handed to a tensor that requested `bytes`.
    pub(super) fn took(&mut self, taken: u64, bytes: u64) {
        self.allocated += taken;
        self.requested += bytes;
        let r = &mut self.report;
        r.max_reserved = r.max_reserved.max(self.reserved);
        if self.allocated > r.max_allocated {
            r.max_allocated = self.allocated;
            r.reserved_at_max_allocated = self.reserved;
            r.fragmentation_at_peak = self.reserved - self.allocated;
        }
        r.max_requested = r.max_requested.max(self.requested);
    }

    /// A tensor's block of `size` bytes (`requested` of them asked for) returned to the cache.
    pub(super) fn gave_back(&mut self, size: u64, requested: u64) {
        self.allocated -= size;
        self.requested -= requested;
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

/// The segments and blocks of one device's allocator, as `malloc` reaches them. Segments are
/// named by their index in creation order.
pub(super) trait BlockStore {
    /// A block as the store names it.
    type Block;

    fn conf(&self) -> &AllocConf;

    fn counters(&mut self) -> &mut Counters;

    /// The smallest cached block of the pool and stream that holds `size` (ties by address),
    /// with its size.
    fn best_fit(&self, size: u64, small: bool, stream: u32) -> Option<(u64, Self::Block)>;

    /// `alloc_block` without expandable segments: `cudaMalloc(alloc_size)` if it fits.
    fn alloc_block(&mut self, alloc_size: u64, small: bool, stream: u32) -> Option<Self::Block>;

    /// `try_allocate_expandable_block` / `map_block`: the pool's segment for this stream grows
    /// at its end in pages of 2 MiB (small pool) or 20 MiB (large pool), the free block that
    /// ends it (if any) merging with the new pages.
    fn alloc_expandable(&mut self, size: u64, small: bool, stream: u32) -> Option<Self::Block>;

    /// Whole (unsplit) cached segments of a pool and stream, as (size, index), smallest first.
    fn whole_free(&self, small: bool, stream: Option<u32>) -> Vec<(u64, usize)>;

    /// `release_block` of a whole cached segment.
    fn release_segment(&mut self, s: usize);

    /// With expandable segments, the free pages that end a segment unmapped (`unmap_block`).
    fn unmap_free_tails(&mut self);

    /// `get_free_block`: the [best fit](BlockStore::best_fit), then the oversize rules: a
    /// request below `max_split_size` never takes a block at or above it; a request at or above
    /// it takes a block only below `size + max_non_split_rounding`.
    fn get_free_block(&self, size: u64, small: bool, stream: u32) -> Option<Self::Block> {
        let (bsize, b) = self.best_fit(size, small, stream)?;
        let m = self.conf().max_split_size;
        if size < m && bsize >= m {
            return None;
        }
        if size >= m && bsize >= size.saturating_add(self.conf().max_non_split_rounding) {
            return None;
        }
        Some(b)
    }

    /// `release_available_cached_blocks`: only with a `max_split_size`; frees the smallest
    /// cached block of at least max(size, max_split_size), else oversize blocks from the largest
    /// down until that much is freed (those freed stay freed even when it falls short).
    fn release_available(&mut self, size: u64, small: bool, stream: u32) -> bool {
        let m = self.conf().max_split_size;
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
        self.unmap_free_tails();
    }

    /// `should_split` of a block of `block` bytes for a request of (rounded) `size`: small pool
    /// or expandable segments: a remainder ≥ 512 B; large pool: only a request below
    /// `max_split_size` with a remainder above 1 MiB (`remaining > kSmallSize`).
    fn should_split(&self, block: u64, size: u64) -> bool {
        let remaining = block - size;
        if size <= SMALL_SIZE || self.conf().expandable_segments {
            remaining >= MIN_BLOCK_SIZE
        } else {
            size < self.conf().max_split_size && remaining > SMALL_SIZE
        }
    }

    /// `malloc` up to its block: round, pick the pool, search the cache, else allocate a
    /// segment, else release oversize cached blocks and retry, else release every unsplit cached
    /// block and retry, else out of memory. The block found, and the request's rounded size.
    fn find_block(&mut self, id: u64, bytes: u64, stream: u32) -> Result<(Self::Block, u64), Oom> {
        let size = round_size(bytes, self.conf());
        let small = size <= SMALL_SIZE;
        let alloc_size = allocation_size(size);
        let expandable = self.conf().expandable_segments;
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
                self.counters().report.alloc_retries += 1;
                found = alloc(self);
            }
            if found.is_none() {
                self.release_cached();
                self.counters().report.alloc_retries += 1;
                found = alloc(self);
            }
        }
        let c = self.counters();
        found.map(|b| (b, size)).ok_or(Oom {
            event: 0,
            id,
            requested: bytes,
            rounded: size,
            alloc_size: if expandable { size } else { alloc_size },
            allocated: c.allocated,
            reserved: c.reserved,
            capacity: c.capacity,
        })
    }
}
