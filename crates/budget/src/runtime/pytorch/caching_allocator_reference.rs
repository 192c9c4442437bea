//! The allocator as it was written before its blocks became a linked arena (commit 7983bd3):
//! kept, for tests only, as the reference the faster one is held equal to event by event
//! (`caching_allocator_tests.rs`, `the_arena_allocator_equals_the_reference`).

use std::collections::{BTreeSet, HashMap};

use super::arena::IdHash;
use super::conf::{AllocConf, AllocatorReport, Oom, LARGE_BUFFER, SMALL_BUFFER};
use super::policy::{BlockStore, Counters};

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
    c: Counters,
    segs: Vec<Option<Seg>>,
    /// Each allocated id's segment and its block's offset there (an allocated block never
    /// moves: splits add blocks after it, merges join only free ones).
    where_: HashMap<u64, (usize, u64), IdHash>,
    /// Every cached (free) block as (small, stream, size, segment, offset): the order in which
    /// `get_free_block` picks one (smallest size, then the first segment, then the lowest
    /// offset), so a request finds its block in O(log n) instead of scanning every block.
    free: BTreeSet<FreeKey>,
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
            c: Counters::new(capacity),
            segs: Vec::new(),
            where_: HashMap::default(),
            free: BTreeSet::new(),
        }
    }

    pub(super) fn allocated(&self) -> u64 {
        self.c.allocated
    }

    pub(super) fn reserved(&self) -> u64 {
        self.c.reserved
    }
}

impl BlockStore for ReferenceAllocator {
    /// (segment, index of the block in the segment).
    type Block = (usize, usize);

    fn conf(&self) -> &AllocConf {
        &self.conf
    }

    fn counters(&mut self) -> &mut Counters {
        &mut self.c
    }

    fn best_fit(&self, size: u64, small: bool, stream: u32) -> Option<(u64, (usize, usize))> {
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
        Some((bsize, (s, k)))
    }

    fn alloc_block(&mut self, alloc_size: u64, small: bool, stream: u32) -> Option<(usize, usize)> {
        if !self.c.fits(alloc_size) {
            return None;
        }
        self.c.device_alloc(alloc_size);
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
        if !self.c.fits(extra) {
            if seg.blocks.is_empty() {
                self.segs[s] = None;
            }
            return None;
        }
        self.c.device_alloc(extra);
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

    fn release_segment(&mut self, s: usize) {
        if let Some(seg) = self.segs[s].take() {
            for b in seg.blocks.iter().filter(|b| b.owner.is_none()) {
                self.free.remove(&free_key(&seg, s, b));
            }
            self.c.device_free(seg.size());
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
                    && seg.blocks.len() == 1
                    && seg.blocks[0].owner.is_none())
                .then(|| (seg.blocks[0].size, s))
            })
            .collect();
        v.sort();
        v
    }

    fn unmap_free_tails(&mut self) {
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
                self.c.device_free(unmap);
            }
            if seg.blocks.is_empty() {
                self.segs[s] = None;
            }
        }
    }
}

impl ReferenceAllocator {
    /// `malloc`: the block [`BlockStore::find_block`] finds, split per `should_split`
    /// (`alloc_found_block`).
    pub(super) fn malloc(&mut self, id: u64, bytes: u64, stream: u32) -> Result<(), Oom> {
        let ((s, k), size) = self.find_block(id, bytes, stream)?;
        let block = self.segs[s].as_ref().map_or(0, |g| g.blocks[k].size);
        let split = self.should_split(block, size);
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
        self.c.took(taken, bytes);
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
        self.c
            .gave_back(seg.blocks[k].size, seg.blocks[k].requested);
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
        self.c.report()
    }
}
