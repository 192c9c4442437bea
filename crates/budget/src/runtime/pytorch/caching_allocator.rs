//! PyTorch's CUDA caching allocator, simulated over a sequence of allocations and frees.
//!
//! Follows `c10/cuda/CUDACachingAllocator.cpp` (`DeviceCachingAllocator`, read at pytorch/pytorch
//! 001074d2) and the `PYTORCH_CUDA_ALLOC_CONF` parser of `c10/core/AllocatorConfig.cpp` (read at
//! 065861fb); each rule below names the function it follows. The 512 B and segment-size helpers
//! of [`PyTorch::cuda_block`](crate::runtime::pytorch::device::PyTorch) are the same constants;
//! this module adds pools, blocks, splitting, merging, the oversize rules, the retry path and
//! expandable segments.
//!
//! What is left out, and why it does not change the counters for one process on one device:
//! CUDA graph private pools, cross-stream `record_stream` events (a block is free when its free
//! event arrives), memory fractions and the garbage collector (which runs only with
//! `set_per_process_memory_fraction`). Addresses are modelled as (segment creation order, offset),
//! which orders blocks as `BlockComparatorSize` does for a device that hands out increasing
//! addresses. With expandable segments, the best-fit search does not use the "expandable size" of
//! a free block that ends the mapped range, and on a failed map only the free pages at the end of
//! a segment are unmapped (holes in the middle are not): both can only report more reserved
//! bytes than PyTorch, never fewer.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use serde::{Deserialize, Serialize};
use thiserror::Error;

const MIB: u64 = 1 << 20;
/// `kMinBlockSize`: all sizes are rounded to at least 512 bytes.
pub const MIN_BLOCK_SIZE: u64 = 512;
/// `kSmallSize`: the largest "small" allocation is 1 MiB.
pub const SMALL_SIZE: u64 = MIB;
/// `kSmallBuffer`: "small" allocations are packed in 2 MiB blocks.
pub const SMALL_BUFFER: u64 = 2 * MIB;
/// `kMinLargeAlloc`: allocations between 1 and 10 MiB may use `kLargeBuffer`.
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// `kRoundLarge`: large allocations are rounded up to 2 MiB.
pub const ROUND_LARGE: u64 = 2 * MIB;
/// `kLargeBuffer`: "large" allocations may be packed in 20 MiB blocks.
pub const LARGE_BUFFER: u64 = 20 * MIB;
/// `kRoundUpPowerOfTwoIntervals` (AllocatorConfig.cpp): 16 intervals from 1 MiB to 64 GiB.
const ROUNDUP_INTERVALS: usize = 16;

/// The allocator settings that change device memory (`PYTORCH_CUDA_ALLOC_CONF`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AllocConf {
    /// `max_split_size_mb` in bytes; `u64::MAX` (the default) is unlimited.
    pub max_split_size: u64,
    /// `max_non_split_rounding_mb` in bytes (default `kLargeBuffer`, 20 MiB).
    pub max_non_split_rounding: u64,
    /// `roundup_power2_divisions` per power-of-two interval (1 MiB … 64 GiB); 0 = off.
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// `expandable_segments:True`.
    pub expandable_segments: bool,
    /// `garbage_collection_threshold` (parsed; it acts only with a per-process memory fraction,
    /// which the simulation does not set).
    pub garbage_collection_threshold: Option<f64>,
}

impl Default for AllocConf {
    /// `AllocatorConfig::AllocatorConfig` / `parseArgs` with no environment.
    fn default() -> Self {
        AllocConf {
            max_split_size: u64::MAX,
            max_non_split_rounding: LARGE_BUFFER,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            expandable_segments: false,
            garbage_collection_threshold: None,
        }
    }
}

/// A `PYTORCH_CUDA_ALLOC_CONF` string that PyTorch would refuse (or that the simulation cannot
/// follow); the message names the key.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AllocConfError {
    #[error("PYTORCH_CUDA_ALLOC_CONF: unknown key '{key}': allowed are {allowed}")]
    UnknownKey { key: String, allowed: &'static str },
    #[error("PYTORCH_CUDA_ALLOC_CONF: {key}: {message}")]
    Value { key: String, message: String },
    #[error("PYTORCH_CUDA_ALLOC_CONF: {message}")]
    Syntax { message: String },
}

const KEYS: &str = "max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions, \
expandable_segments, garbage_collection_threshold, backend, release_lock_on_cudamalloc, \
pinned_use_cuda_host_register, pinned_num_register_threads, pinned_use_background_threads";

fn value_err(key: &str, message: impl Into<String>) -> AllocConfError {
    AllocConfError::Value {
        key: key.to_string(),
        message: message.into(),
    }
}

/// `AllocatorConfig::lexArgs`: `,` `:` `[` `]` are tokens, spaces are dropped.
fn lex(env: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut buf = String::new();
    for c in env.chars() {
        if matches!(c, ',' | ':' | '[' | ']') {
            if !buf.is_empty() {
                out.push(std::mem::take(&mut buf));
            }
            out.push(c.to_string());
        } else if c != ' ' {
            buf.push(c);
        }
    }
    if !buf.is_empty() {
        out.push(buf);
    }
    out
}

impl AllocConf {
    /// Parse `PYTORCH_CUDA_ALLOC_CONF` as `AllocatorConfig::parseArgs` does.
    pub fn parse(env: &str) -> Result<AllocConf, AllocConfError> {
        let mut conf = AllocConf::default();
        let t = lex(env);
        let tok = |i: usize| t.get(i).map(String::as_str);
        let mut i = 0;
        while i < t.len() {
            let key = t[i].clone();
            // `consumeToken(config, ++i, ':')`, then the value.
            if tok(i + 1) != Some(":") {
                return Err(AllocConfError::Syntax {
                    message: format!("expected ':' after '{key}'"),
                });
            }
            i += 2;
            let value = tok(i).ok_or_else(|| value_err(&key, "expected a value"))?;
            let number = |v: &str| -> Result<u64, AllocConfError> {
                v.parse::<u64>()
                    .map_err(|_| value_err(&key, format!("'{v}' is not a whole number")))
            };
            let boolean = |v: &str| -> Result<bool, AllocConfError> {
                match v {
                    "True" => Ok(true),
                    "False" => Ok(false),
                    _ => Err(value_err(
                        &key,
                        format!("expected True or False, got '{v}'"),
                    )),
                }
            };
            match key.as_str() {
                // `parseMaxSplitSize` / `parseMaxNonSplitRoundingSize`: ≥ kLargeBuffer / 1 MiB.
                "max_split_size_mb" | "max_non_split_rounding_mb" => {
                    let mb = number(value)?;
                    if mb < LARGE_BUFFER / MIB {
                        return Err(value_err(&key, format!("{mb} is too small, must be >= 20")));
                    }
                    let bytes = mb.saturating_mul(MIB);
                    if key == "max_split_size_mb" {
                        conf.max_split_size = bytes;
                    } else {
                        conf.max_non_split_rounding = bytes;
                    }
                }
                // `parseGarbageCollectionThreshold`: in (0, 1).
                "garbage_collection_threshold" => {
                    let v: f64 = value
                        .parse()
                        .map_err(|_| value_err(&key, format!("'{value}' is not a number")))?;
                    if !(v > 0.0 && v < 1.0) {
                        return Err(value_err(&key, "must be in (0.0, 1.0)"));
                    }
                    conf.garbage_collection_threshold = Some(v);
                }
                "expandable_segments" => conf.expandable_segments = boolean(value)?,
                "roundup_power2_divisions" => {
                    i = parse_roundup(&t, i, &mut conf.roundup_power2_divisions)?;
                }
                "backend" => {
                    match value {
                        "native" => {}
                        "cudaMallocAsync" => return Err(value_err(
                            &key,
                            "cudaMallocAsync is not simulated (only the native caching allocator)",
                        )),
                        v => {
                            return Err(value_err(
                                &key,
                                format!("'{v}': options are native and cudaMallocAsync"),
                            ))
                        }
                    }
                }
                // Host-side or locking options: no effect on device memory.
                "release_lock_on_cudamalloc"
                | "pinned_use_cuda_host_register"
                | "pinned_use_background_threads" => {
                    boolean(value)?;
                }
                "pinned_num_register_threads" => {
                    let n = number(value)?;
                    if !n.is_power_of_two() {
                        return Err(value_err(&key, "has to be a power of 2"));
                    }
                }
                _ => {
                    return Err(AllocConfError::UnknownKey {
                        key: key.chars().take(60).collect(),
                        allowed: KEYS,
                    })
                }
            }
            // `if (i + 1 < config.size()) consumeToken(config, ++i, ',')`.
            if i + 1 < t.len() {
                if tok(i + 1) != Some(",") {
                    return Err(AllocConfError::Syntax {
                        message: format!("expected ',' after the value of '{key}'"),
                    });
                }
                i += 1;
            }
            i += 1;
        }
        Ok(conf)
    }

    /// `AllocatorConfig::roundup_power2_divisions(size)`: the interval of `floor(log2(size))`,
    /// counted from 1 MiB and clamped to the 16 intervals.
    pub fn divisions_for(&self, size: u64) -> u64 {
        let log = 63 - size.max(1).leading_zeros() as i64;
        let index = (log - 20).clamp(0, ROUNDUP_INTERVALS as i64 - 1) as usize;
        self.roundup_power2_divisions[index]
    }
}

/// `parseRoundUpPower2Divisions`: one power of two for every interval, or
/// `[MB:div,…,>:div]` with power-of-two MB keys; the first key also fills the intervals below
/// it and `>` fills from the last key's interval on (that interval included, as the source's
/// `std::fill(begin + last_index, end)` does).
fn parse_roundup(
    t: &[String],
    mut i: usize,
    out: &mut [u64; ROUNDUP_INTERVALS],
) -> Result<usize, AllocConfError> {
    let key = "roundup_power2_divisions";
    let num = |v: &str| -> Result<u64, AllocConfError> {
        v.parse::<u64>()
            .map_err(|_| value_err(key, format!("'{v}' is not a whole number")))
    };
    if t[i] != "[" {
        let v = num(&t[i])?;
        if !v.is_power_of_two() {
            return Err(value_err(key, "the divisions have to be a power of 2"));
        }
        *out = [v; ROUNDUP_INTERVALS];
        return Ok(i);
    }
    let mut first = true;
    let mut last_index = 0;
    loop {
        i += 1;
        match t.get(i).map(String::as_str) {
            None => return Err(value_err(key, "missing ']'")),
            Some("]") => return Ok(i),
            Some(_) => {}
        }
        let interval = t[i].clone();
        if t.get(i + 1).map(String::as_str) != Some(":") {
            return Err(value_err(key, format!("expected ':' after '{interval}'")));
        }
        i += 2;
        let div = num(t.get(i).ok_or_else(|| value_err(key, "expected a value"))?)?;
        if !(div == 0 || div.is_power_of_two()) {
            return Err(value_err(
                key,
                "the divisions have to be a power of 2 or 0 to disable the roundup",
            ));
        }
        if interval == ">" {
            out[last_index..].fill(div);
        } else {
            let mb = num(&interval)?;
            if !mb.is_power_of_two() {
                return Err(value_err(key, "the intervals have to be powers of 2 (MB)"));
            }
            let index = (63 - mb.leading_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
            if first {
                out[..index].fill(div);
                first = false;
            }
            out[index] = div;
            last_index = index;
        }
        if t.get(i + 1).map(String::as_str) != Some("]") {
            if t.get(i + 1).map(String::as_str) != Some(",") {
                return Err(value_err(key, "expected ',' or ']'"));
            }
            i += 1;
        }
    }
}

/// `roundup_power2_next_division`: the next of `divisions` equal steps between two powers of 2.
fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> (63 - divisions.leading_zeros());
    if step == 0 {
        return floor << 1;
    }
    let round_floor = size & !(step - 1);
    if round_floor == size {
        size
    } else {
        round_floor + step
    }
}

/// `round_size`: < 512 → 512; with `roundup_power2_divisions` > 1 and size > 512 × divisions,
/// the next power-of-2 division; otherwise a multiple of 512.
pub fn round_size(size: u64, conf: &AllocConf) -> u64 {
    if size < MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    let div = conf.divisions_for(size);
    if div > 1 && size > MIN_BLOCK_SIZE * div {
        roundup_power2_next_division(size, div)
    } else {
        size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
    }
}

/// `get_allocation_size`: ≤ 1 MiB → 2 MiB; < 10 MiB → 20 MiB; else rounded up to 2 MiB.
pub fn allocation_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

/// One event of an allocation sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AllocEvent {
    /// `malloc(bytes)` on a stream, named by `id` for its free.
    Alloc { id: u64, bytes: u64, stream: u32 },
    /// The tensor `id` is freed (its block returns to the cache).
    Free { id: u64 },
}

/// A sequence that cannot be replayed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SequenceError {
    #[error("allocation sequence, event {event}: id {id} is already allocated")]
    DuplicateId { event: usize, id: u64 },
    #[error("allocation sequence, event {event}: id {id} is not allocated")]
    UnknownFree { event: usize, id: u64 },
}

/// Where an allocation fails (PyTorch raises `torch.OutOfMemoryError` there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Oom {
    /// Index of the failing event in the sequence.
    pub event: usize,
    pub id: u64,
    /// The request, its rounded size and the segment (or mapping) it needed.
    pub requested: u64,
    pub rounded: u64,
    pub alloc_size: u64,
    /// Allocated and reserved bytes when it failed (after the cache was released).
    pub allocated: u64,
    pub reserved: u64,
    pub capacity: u64,
}

/// What the allocator's counters show over a sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct AllocatorReport {
    /// `max_memory_allocated`: rounded (block) bytes.
    pub max_allocated: u64,
    /// `max_memory_reserved`: segment (or mapped) bytes.
    pub max_reserved: u64,
    /// Peak of the requested bytes (`requested_bytes` peak).
    pub max_requested: u64,
    /// Reserved − allocated at the (first) allocated peak: the cached bytes the step's peak
    /// cannot use.
    pub fragmentation_at_peak: u64,
    /// Reserved bytes when allocated peaked.
    pub reserved_at_max_allocated: u64,
    pub final_allocated: u64,
    pub final_reserved: u64,
    /// `cudaMalloc` calls (or page mappings with expandable segments).
    pub device_allocs: u64,
    /// `cudaFree` calls (or unmappings) made to satisfy a request.
    pub device_frees: u64,
    /// `num_alloc_retries`: allocations that released cache and retried.
    pub alloc_retries: u64,
    pub oom: Option<Oom>,
}

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
pub struct CachingAllocator {
    conf: AllocConf,
    /// Bytes the allocator may reserve (device memory less the context); `u64::MAX` = unlimited.
    capacity: u64,
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
    allocated: u64,
    reserved: u64,
    requested: u64,
    report: AllocatorReport,
}

/// Hashing for tensor ids (`u64` keys): one multiply and a fold instead of SipHash, which the
/// replay spent a seventh of its time in (`perf`, `bench/plan_speed/`). Ids come from the step's
/// own sequence, not from outside input, so hash flooding is not a concern; the maps are only
/// looked up, never iterated, so no result depends on the hash.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

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
pub type IdHash = BuildHasherDefault<IdHasher>;

impl CachingAllocator {
    pub fn new(conf: AllocConf, capacity: Option<u64>) -> CachingAllocator {
        CachingAllocator {
            conf,
            capacity: capacity.unwrap_or(u64::MAX),
            segs: Vec::new(),
            blocks: Vec::new(),
            spare: Vec::new(),
            where_: IdMap::default(),
            pools: Vec::new(),
            allocated: 0,
            reserved: 0,
            requested: 0,
            report: AllocatorReport::default(),
        }
    }

    pub fn allocated(&self) -> u64 {
        self.allocated
    }

    pub fn reserved(&self) -> u64 {
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

    /// `get_free_block`: the smallest cached block of the pool and stream that holds `size`
    /// (ties by address), then the oversize rules: a request below `max_split_size` never takes
    /// a block at or above it; a request at or above it takes a block only below
    /// `size + max_non_split_rounding`.
    fn get_free_block(&self, size: u64, small: bool, stream: u32) -> Option<u32> {
        let pool = self
            .pools
            .iter()
            .find(|p| p.small == small && p.stream == stream)?;
        let &(bsize, _, _, b) = pool.blocks.range((size, 0, 0, 0)..).next()?;
        let m = self.conf.max_split_size;
        if size < m && bsize >= m {
            return None;
        }
        if size >= m && bsize >= size.saturating_add(self.conf.max_non_split_rounding) {
            return None;
        }
        Some(b)
    }

    /// `alloc_block` without expandable segments: `cudaMalloc(alloc_size)` if it fits.
    fn alloc_block(&mut self, alloc_size: u64, small: bool, stream: u32) -> Option<u32> {
        if !self.fits(alloc_size) {
            return None;
        }
        self.reserved += alloc_size;
        self.report.device_allocs += 1;
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

    /// `try_allocate_expandable_block` / `map_block`: the pool's segment for this stream grows
    /// at its end in pages of 2 MiB (small pool) or 20 MiB (large pool), the free block that
    /// ends it (if any) merging with the new pages.
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
        if !self.fits(extra) {
            if tail == NIL {
                self.segs[s] = None;
            }
            return None;
        }
        self.reserved += extra;
        self.report.device_allocs += 1;
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

    /// `release_block` of a whole cached segment.
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
            self.reserved -= seg.size;
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
                    && seg.head != NIL
                    && seg.head == seg.tail
                    && !self.blocks[seg.head as usize].allocated)
                    .then(|| (self.blocks[seg.head as usize].size, s))
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
                    self.reserved -= unmap;
                    self.report.device_frees += 1;
                }
            }
            if self.segs[s].as_ref().is_some_and(|g| g.head == NIL) {
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
    pub fn malloc(&mut self, id: u64, bytes: u64, stream: u32) -> Result<(), Oom> {
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
        let Some(b) = found else {
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
        let block = self.blocks[b as usize].size;
        let split = self.should_split(block, size, small);
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
        self.allocated += taken;
        self.requested += bytes;
        self.note_peaks();
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
    pub fn free(&mut self, id: u64) -> bool {
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
        self.allocated -= size;
        self.requested -= requested;
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

    /// `emptyCache` (`torch.cuda.empty_cache()`).
    pub fn empty_cache(&mut self) {
        self.release_cached();
    }

    /// The counters so far (final values filled in).
    pub fn report(&self) -> AllocatorReport {
        AllocatorReport {
            final_allocated: self.allocated,
            final_reserved: self.reserved,
            ..self.report
        }
    }
}

/// Replay a sequence on a fresh allocator; stops at the first allocation that fails against
/// `capacity` (bytes the allocator may reserve), which the report's `oom` names.
pub fn simulate_allocator(
    events: &[AllocEvent],
    conf: &AllocConf,
    capacity: Option<u64>,
) -> Result<AllocatorReport, SequenceError> {
    crate::profile::time(
        crate::profile::Phase::Replay,
        |_| events.len() as u64,
        || replay_once(&[events], conf, capacity),
    )
}

/// Replays already made in this process, by what decides them: the events (a 128-bit
/// fingerprint and their count), the settings and the capacity. The planner and `estimate`'s
/// levers build the same sequence for many candidates (a lever that changes the step time but
/// no allocation, the plain and the expandable-segments check of one candidate): a replay is a
/// pure function of these, so a repeated one is answered from here. Bounded: emptied when full.
type ReplayKey = (u64, u64, usize, String, Option<u64>);
static REPLAYS: std::sync::Mutex<Option<HashMap<ReplayKey, ReplayOutcome>>> =
    std::sync::Mutex::new(None);
type ReplayOutcome = Result<AllocatorReport, SequenceError>;
const MAX_CACHED_REPLAYS: usize = 4096;

/// Two 64-bit lanes of a multiply-fold hash (wyhash's `mum`) over every field of every event.
fn fingerprint(parts: &[&[AllocEvent]]) -> (u64, u64) {
    fn mum(a: u64, b: u64) -> u64 {
        let r = u128::from(a) * u128::from(b);
        (r as u64) ^ ((r >> 64) as u64)
    }
    let (mut h1, mut h2) = (0x243F_6A88_85A3_08D3_u64, 0x1319_8A2E_0370_7344_u64);
    let mut word = |w: u64| {
        h1 = mum(h1 ^ w, 0xA076_1D64_78BD_642F);
        h2 = mum(h2 ^ w.rotate_left(29), 0xE703_7ED1_A0B4_28DB);
    };
    for e in parts.iter().flat_map(|p| p.iter()) {
        match *e {
            AllocEvent::Alloc { id, bytes, stream } => {
                word(id);
                word(bytes);
                word(u64::from(stream) | 1 << 40);
            }
            AllocEvent::Free { id } => {
                word(id);
                word(2 << 40);
            }
        }
    }
    (h1, h2)
}

/// [`replay_once`], or the same replay's outcome made earlier in this process.
fn replay(
    parts: &[&[AllocEvent]],
    conf: &AllocConf,
    capacity: Option<u64>,
) -> Result<AllocatorReport, SequenceError> {
    let (h1, h2) = fingerprint(parts);
    let len = parts.iter().map(|p| p.len()).sum();
    let key: ReplayKey = (h1, h2, len, format!("{conf:?}"), capacity);
    let cached = REPLAYS
        .lock()
        .ok()
        .and_then(|m| m.as_ref().and_then(|m| m.get(&key).cloned()));
    if let Some(r) = cached {
        return r;
    }
    let r = replay_once(parts, conf, capacity);
    if let Ok(mut m) = REPLAYS.lock() {
        let m = m.get_or_insert_with(HashMap::default);
        if m.len() >= MAX_CACHED_REPLAYS {
            m.clear();
        }
        m.insert(key, r.clone());
    }
    r
}

fn replay_once(
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

/// One training process on one catalog GPU: the allocator over a sequence with the cuBLAS
/// workspaces allocated first, and the CUDA context beside it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CudaMemory {
    pub gpu: &'static str,
    pub allocator: AllocatorReport,
    /// cuBLAS workspace bytes per stream (through the allocator, so inside allocated/reserved).
    pub cublas_workspace_per_stream: u64,
    pub streams: u32,
    /// CUDA context bytes (the catalog's figure, with its source there).
    pub context_bytes: u64,
    /// What `nvidia-smi` would show at the peak: context + max reserved.
    pub device_bytes: u64,
    /// `total_memory` of the card.
    pub capacity_bytes: u64,
    /// No allocation failed against capacity − context.
    pub fits: bool,
}

/// Ids the cuBLAS workspaces take in [`simulate_on_gpu`] (above any id a sequence should use).
pub const CUBLAS_WORKSPACE_ID_BASE: u64 = u64::MAX - 1024;

/// Replay `events` on `gpu`: one cuBLAS workspace per stream in `streams` is allocated first
/// (`getNewWorkspace` → the caching allocator, `CublasHandlePool.cpp`; PyTorch allocates it at
/// the first matmul of a (handle, stream) and keeps it), the allocator may reserve the capacity
/// less the context, and the device total adds the context to the reserved peak.
pub fn simulate_on_gpu(
    events: &[AllocEvent],
    gpu: &crate::gpu::Gpu,
    conf: &AllocConf,
    streams: &[u32],
) -> Result<CudaMemory, SequenceError> {
    let ws = gpu.cublas_workspace_bytes();
    let workspaces: Vec<AllocEvent> = streams
        .iter()
        .enumerate()
        .map(|(k, &stream)| AllocEvent::Alloc {
            id: CUBLAS_WORKSPACE_ID_BASE + k as u64,
            bytes: ws,
            stream,
        })
        .collect();
    // The workspaces, then the sequence (events are numbered over both), without copying it.
    let allocator = crate::profile::time(
        crate::profile::Phase::Replay,
        |_| events.len() as u64,
        || replay(&[&workspaces, events], conf, Some(gpu.allocator_bytes())),
    )?;
    Ok(CudaMemory {
        gpu: gpu.name,
        allocator,
        cublas_workspace_per_stream: ws,
        streams: streams.len() as u32,
        context_bytes: gpu.context_bytes,
        device_bytes: gpu.context_bytes + allocator.max_reserved,
        capacity_bytes: gpu.capacity_bytes(),
        fits: allocator.oom.is_none(),
    })
}

#[cfg(test)]
#[path = "caching_allocator_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "caching_allocator_reference.rs"]
mod reference;
