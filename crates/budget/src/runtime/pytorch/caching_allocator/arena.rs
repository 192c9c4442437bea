//! The allocator itself: pools of cached blocks in a linked arena, segments, splitting and
//! merging, the oversize rules, the retry path and expandable segments
//! (`c10/cuda/CUDACachingAllocator.cpp` `DeviceCachingAllocator`, see `caching_allocator.rs`).

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use super::conf::{
    AllocConf, AllocEvent, AllocatorReport, Oom, SequenceError, LARGE_BUFFER, SMALL_BUFFER,
};
use super::policy::{BlockStore, Counters};

/// "No block": the end of a segment's block list, or an id with no block.
const NIL: u32 = u32::MAX;

/// A block (`Block` of CUDACachingAllocator.cpp): a range of a segment, in the segment's
/// doubly linked list of blocks (`prev`/`next`, as PyTorch links them), so a split or a merge
/// is O(1) however many blocks the segment holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Blk {
    seg: u32,
    prev: u32,
    next: u32,
    /// Bytes from the segment's start (blocks are contiguous: each starts where the last ends).
    offset: u64,
    size: u64,
    /// Bytes requested for the tensor holding it (0 when cached).
    requested: u64,
    /// Held by a tensor (`allocated`); false when cached (free).
    allocated: bool,
}

#[derive(Debug, Clone)]
struct Seg {
    small: bool,
    stream: u32,
    expandable: bool,
    /// First and last block of the segment (`NIL` when it has none: an expandable segment
    /// whose first mapping failed).
    head: u32,
    tail: u32,
    /// Bytes of the segment (the mapped range for an expandable one): the sum of its blocks.
    size: u64,
}

/// The cached blocks of one pool and stream (`BlockPool::blocks`, a `std::set` ordered by
/// `BlockComparatorSize`: stream, size, address) as (size, segment, offset, block): the
/// order in which `get_free_block` picks one (smallest size, then the first segment, then the
/// lowest offset), so a request finds its block in O(log n) instead of scanning every block.
/// The block index only names the entry; (segment, offset) is already unique.
type FreeKey = (u64, u32, u64, u32);

#[derive(Debug, Clone)]
struct Pool {
    small: bool,
    stream: u32,
    blocks: BTreeSet<FreeKey>,
}

/// Each allocated id's block. Ids below `dense.len()` are looked up by index (the replay of a
/// sequence sizes it to the sequence's ids, which `trace.rs` numbers from 1 up); any other id
/// in a map.
#[derive(Debug, Clone, Default)]
struct IdMap {
    dense: Vec<u32>,
    sparse: HashMap<u64, u32, IdHash>,
}

impl IdMap {
    fn with_dense(n: usize) -> IdMap {
        IdMap {
            dense: vec![NIL; n],
            sparse: HashMap::default(),
        }
    }

    fn slot(&mut self, id: u64) -> Option<&mut u32> {
        usize::try_from(id).ok().and_then(|i| self.dense.get_mut(i))
    }

    fn contains(&self, id: u64) -> bool {
        match usize::try_from(id).ok().and_then(|i| self.dense.get(i)) {
            Some(&b) => b != NIL,
            None => self.sparse.contains_key(&id),
        }
    }

    fn insert(&mut self, id: u64, b: u32) {
        match self.slot(id) {
            Some(slot) => *slot = b,
            None => {
                self.sparse.insert(id, b);
            }
        }
    }

    fn remove(&mut self, id: u64) -> Option<u32> {
        match self.slot(id) {
            Some(slot) => Some(std::mem::replace(slot, NIL)).filter(|&b| b != NIL),
            None => self.sparse.remove(&id),
        }
    }
}

/// The simulated `DeviceCachingAllocator` of one device.
#[derive(Debug, Clone)]
pub(crate) struct CachingAllocator {
    conf: AllocConf,
    c: Counters,
    /// Segments in creation order (the index is the address order); `None` once released.
    segs: Vec<Option<Seg>>,
    /// Every block of every segment; `spare` lists the slots merged or released blocks left.
    blocks: Vec<Blk>,
    spare: Vec<u32>,
    /// Each allocated id's block (an allocated block never moves: splits add blocks after it,
    /// merges join only free ones).
    where_: IdMap,
    /// Cached blocks by pool (small or large) and stream.
    pools: Vec<Pool>,
}

/// Hashing for tensor ids (`u64` keys): one multiply and a fold instead of SipHash, which the
/// replay spent a seventh of its time in (`perf`, `bench/plan_speed/`). Ids come from the step's
/// own sequence, not from outside input, so hash flooding is not a concern; the maps are only
/// looked up, never iterated, so no result depends on the hash.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        // Fibonacci hashing (Knuth, TAOCP 3, 6.4): the high bits of the product mix every input
        // bit; the fold brings them down to the bits hashbrown indexes by.
        let m = (self.0 ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = m ^ (m >> 29);
    }
}

/// [`IdHasher`] as a map's hasher.
pub(crate) type IdHash = BuildHasherDefault<IdHasher>;

impl CachingAllocator {
    pub(crate) fn new(conf: AllocConf, capacity: Option<u64>) -> CachingAllocator {
        CachingAllocator {
            conf,
            c: Counters::new(capacity),
            segs: Vec::new(),
            blocks: Vec::new(),
            spare: Vec::new(),
            where_: IdMap::default(),
            pools: Vec::new(),
        }
    }

    pub(crate) fn allocated(&self) -> u64 {
        self.c.allocated
    }

    pub(crate) fn reserved(&self) -> u64 {
        self.c.reserved
    }

    /// The index of the pool of (small, stream), made on first use.
    fn pool(&mut self, small: bool, stream: u32) -> usize {
        match self
            .pools
            .iter()
            .position(|p| p.small == small && p.stream == stream)
        {
            Some(i) => i,
            None => {
                self.pools.push(Pool {
                    small,
                    stream,
                    blocks: BTreeSet::new(),
                });
                self.pools.len() - 1
            }
        }
    }

    /// The free-set entry of block `b` and the pool it belongs in.
    fn key(&self, b: u32) -> (bool, u32, FreeKey) {
        let blk = &self.blocks[b as usize];
        let seg = self.segs[blk.seg as usize]
            .as_ref()
            .expect("a block's segment is live");
        (seg.small, seg.stream, (blk.size, blk.seg, blk.offset, b))
    }

    fn cache(&mut self, b: u32) {
        let (small, stream, key) = self.key(b);
        let p = self.pool(small, stream);
        self.pools[p].blocks.insert(key);
    }

    fn uncache(&mut self, b: u32) {
        let (small, stream, key) = self.key(b);
        let p = self.pool(small, stream);
        self.pools[p].blocks.remove(&key);
    }

    fn new_block(&mut self, blk: Blk) -> u32 {
        match self.spare.pop() {
            Some(b) => {
                self.blocks[b as usize] = blk;
                b
            }
            None => {
                self.blocks.push(blk);
                (self.blocks.len() - 1) as u32
            }
        }
    }
}

impl BlockStore for CachingAllocator {
    type Block = u32;

    fn conf(&self) -> &AllocConf {
        &self.conf
    }

    fn counters(&mut self) -> &mut Counters {
        &mut self.c
    }

    fn best_fit(&self, size: u64, small: bool, stream: u32) -> Option<(u64, u32)> {
        let pool = self
            .pools
            .iter()
            .find(|p| p.small == small && p.stream == stream)?;
        let &(bsize, _, _, b) = pool.blocks.range((size, 0, 0, 0)..).next()?;
        Some((bsize, b))
    }

    fn alloc_block(&mut self, alloc_size: u64, small: bool, stream: u32) -> Option<u32> {
        if !self.c.fits(alloc_size) {
            return None;
        }
        self.c.device_alloc(alloc_size);
        let s = self.segs.len() as u32;
        let b = self.new_block(Blk {
            seg: s,
            prev: NIL,
            next: NIL,
            offset: 0,
            size: alloc_size,
            requested: 0,
            allocated: false,
        });
        self.segs.push(Some(Seg {
            small,
            stream,
            expandable: false,
            head: b,
            tail: b,
            size: alloc_size,
        }));
        self.cache(b);
        Some(b)
    }

    fn alloc_expandable(&mut self, size: u64, small: bool, stream: u32) -> Option<u32> {
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
                    head: NIL,
                    tail: NIL,
                    size: 0,
                }));
                self.segs.len() - 1
            }
        };
        let (tail, end) = self.segs[s].as_ref().map(|g| (g.tail, g.size))?;
        let tail_free = Some(tail)
            .filter(|&t| t != NIL && !self.blocks[t as usize].allocated)
            .map_or(0, |t| self.blocks[t as usize].size);
        let extra = (size - tail_free).div_ceil(page) * page;
        if !self.c.fits(extra) {
            if tail == NIL {
                self.segs[s] = None;
            }
            return None;
        }
        self.c.device_alloc(extra);
        let last = if tail != NIL && !self.blocks[tail as usize].allocated {
            self.uncache(tail);
            self.blocks[tail as usize].size += extra;
            tail
        } else {
            let b = self.new_block(Blk {
                seg: s as u32,
                prev: tail,
                next: NIL,
                offset: end,
                size: extra,
                requested: 0,
                allocated: false,
            });
            if tail != NIL {
                self.blocks[tail as usize].next = b;
            }
            let seg = self.segs[s].as_mut()?;
            if seg.head == NIL {
                seg.head = b;
            }
            seg.tail = b;
            b
        };
        self.segs[s].as_mut()?.size += extra;
        self.cache(last);
        Some(last)
    }

    fn release_segment(&mut self, s: usize) {
        let Some(head) = self.segs[s].as_ref().map(|g| g.head) else {
            return;
        };
        let mut b = head;
        while b != NIL {
            if !self.blocks[b as usize].allocated {
                self.uncache(b);
            }
            self.spare.push(b);
            b = self.blocks[b as usize].next;
        }
        if let Some(seg) = self.segs[s].take() {
            self.c.device_free(seg.size);
        }
    }

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
                    && seg.head != NIL
                    && seg.head == seg.tail
                    && !self.blocks[seg.head as usize].allocated)
                    .then(|| (self.blocks[seg.head as usize].size, s))
            })
            .collect();
        v.sort();
        v
    }

    fn unmap_free_tails(&mut self) {
        for s in 0..self.segs.len() {
            let Some((expandable, small, tail, end)) = self.segs[s]
                .as_ref()
                .map(|g| (g.expandable, g.small, g.tail, g.size))
            else {
                continue;
            };
            if !expandable {
                continue;
            }
            let page = if small { SMALL_BUFFER } else { LARGE_BUFFER };
            if tail != NIL && !self.blocks[tail as usize].allocated {
                let last = self.blocks[tail as usize];
                let start = end - last.size;
                let unmap = end - start.div_ceil(page) * page;
                if unmap > 0 {
                    self.uncache(tail);
                    let kept = last.size - unmap;
                    let seg = self.segs[s].as_mut().expect("a live segment");
                    seg.size -= unmap;
                    if kept == 0 {
                        seg.tail = last.prev;
                        if last.prev == NIL {
                            seg.head = NIL;
                        } else {
                            self.blocks[last.prev as usize].next = NIL;
                        }
                        self.spare.push(tail);
                    } else {
                        self.blocks[tail as usize].size = kept;
                        self.cache(tail);
                    }
                    self.c.device_free(unmap);
                }
            }
            if self.segs[s].as_ref().is_some_and(|g| g.head == NIL) {
                self.segs[s] = None;
            }
        }
    }
}

impl CachingAllocator {
    /// `malloc`: the block [`BlockStore::find_block`] finds, split per `should_split`
    /// (`alloc_found_block`).
    pub(crate) fn malloc(&mut self, id: u64, bytes: u64, stream: u32) -> Result<(), Oom> {
        let (b, size) = self.find_block(id, bytes, stream)?;
        let block = self.blocks[b as usize].size;
        let split = self.should_split(block, size);
        self.uncache(b);
        let taken = if split {
            let Blk {
                seg, offset, next, ..
            } = self.blocks[b as usize];
            let rest = self.new_block(Blk {
                seg,
                prev: b,
                next,
                offset: offset + size,
                size: block - size,
                requested: 0,
                allocated: false,
            });
            if next == NIL {
                if let Some(g) = self.segs[seg as usize].as_mut() {
                    g.tail = rest;
                }
            } else {
                self.blocks[next as usize].prev = rest;
            }
            let blk = &mut self.blocks[b as usize];
            blk.next = rest;
            blk.size = size;
            self.cache(rest);
            size
        } else {
            block
        };
        let blk = &mut self.blocks[b as usize];
        blk.allocated = true;
        blk.requested = bytes;
        self.where_.insert(id, b);
        self.c.took(taken, bytes);
        Ok(())
    }

    /// Unlink block `b` (a free neighbour merged into another) and keep its slot.
    fn unlink(&mut self, b: u32) {
        let Blk {
            seg, prev, next, ..
        } = self.blocks[b as usize];
        if prev != NIL {
            self.blocks[prev as usize].next = next;
        }
        if next != NIL {
            self.blocks[next as usize].prev = prev;
        }
        if let Some(g) = self.segs[seg as usize].as_mut() {
            if g.head == b {
                g.head = next;
            }
            if g.tail == b {
                g.tail = prev;
            }
        }
        self.spare.push(b);
    }

    /// `free` → `free_block`: the block returns to its pool and merges with free neighbours
    /// (`try_merge_blocks` on prev and next). Returns false for an id that is not allocated.
    pub(crate) fn free(&mut self, id: u64) -> bool {
        let Some(b) = self.where_.remove(id) else {
            return false;
        };
        let Blk {
            size,
            requested,
            prev,
            next,
            allocated,
            ..
        } = self.blocks[b as usize];
        if !allocated {
            return false;
        }
        self.c.gave_back(size, requested);
        {
            let blk = &mut self.blocks[b as usize];
            blk.allocated = false;
            blk.requested = 0;
        }
        if next != NIL && !self.blocks[next as usize].allocated {
            self.uncache(next);
            self.blocks[b as usize].size += self.blocks[next as usize].size;
            self.unlink(next);
        }
        let mut k = b;
        if prev != NIL && !self.blocks[prev as usize].allocated {
            self.uncache(prev);
            self.blocks[prev as usize].size += self.blocks[b as usize].size;
            self.unlink(b);
            k = prev;
        }
        self.cache(k);
        true
    }

    /// `emptyCache` (`torch.cuda.empty_cache()`). No step rule calls it (the scripts do not);
    /// the test against the reference allocator does.
    #[cfg(test)]
    pub(crate) fn empty_cache(&mut self) {
        self.release_cached();
    }

    /// The counters so far (final values filled in).
    pub(crate) fn report(&self) -> AllocatorReport {
        self.c.report()
    }
}

/// Replays the events of `parts` (one sequence in parts) on a fresh allocator: the report, with
/// the first allocation that fails against `capacity` as its `oom`.
pub(super) fn replay_once(
    parts: &[&[AllocEvent]],
    conf: &AllocConf,
    capacity: Option<u64>,
) -> Result<AllocatorReport, SequenceError> {
    let mut a = CachingAllocator::new(conf.clone(), capacity);
    // Ids up to a few per event (trace.rs numbers them from 1 up) are looked up by index.
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let dense = 8 * len + 1024;
    let top = parts
        .iter()
        .flat_map(|p| p.iter())
        .filter_map(|e| match *e {
            AllocEvent::Alloc { id, .. } => usize::try_from(id).ok().filter(|&i| i < dense),
            AllocEvent::Free { .. } => None,
        })
        .max();
    a.where_ = IdMap::with_dense(top.map_or(0, |t| t + 1));
    for (event, e) in parts.iter().flat_map(|p| p.iter()).enumerate() {
        match *e {
            AllocEvent::Alloc { id, bytes, stream } => {
                if a.where_.contains(id) {
                    return Err(SequenceError::DuplicateId { event, id });
                }
                if let Err(oom) = a.malloc(id, bytes, stream) {
                    let mut r = a.report();
                    r.oom = Some(Oom { event, ..oom });
                    return Ok(r);
                }
            }
            AllocEvent::Free { id } => {
                if !a.free(id) {
                    return Err(SequenceError::UnknownFree { event, id });
                }
            }
        }
    }
    Ok(a.report())
}
