//! The allocator's settings (`PYTORCH_CUDA_ALLOC_CONF`, parsed as `c10/core/AllocatorConfig.cpp`
//! does) and its size rounding (`round_size`, `allocation_size`), with the allocation sequence's
//! events and the report of a replay: the leaf the arena ([`super::arena`]) and the replay
//! (`caching_allocator.rs`) use.

use serde::{Deserialize, Serialize};
use thiserror::Error;

pub(super) const MIB: u64 = 1 << 20;
/// `kMinBlockSize`: all sizes are rounded to at least 512 bytes.
pub(crate) const MIN_BLOCK_SIZE: u64 = 512;
/// `kSmallSize`: the largest "small" allocation is 1 MiB.
pub(crate) const SMALL_SIZE: u64 = MIB;
/// `kSmallBuffer`: "small" allocations are packed in 2 MiB blocks.
pub(crate) const SMALL_BUFFER: u64 = 2 * MIB;
/// `kMinLargeAlloc`: allocations between 1 and 10 MiB may use `kLargeBuffer`.
pub(crate) const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// `kRoundLarge`: large allocations are rounded up to 2 MiB.
pub(crate) const ROUND_LARGE: u64 = 2 * MIB;
/// `kLargeBuffer`: "large" allocations may be packed in 20 MiB blocks.
pub(crate) const LARGE_BUFFER: u64 = 20 * MIB;
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
    /// Parse `PYTORCH_CUDA_ALLOC_CONF` as `AllocatorConfig::parseArgs` does: `key:value` pairs
    /// separated by `,`, each value read by [`AllocConf::set`].
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
            i = conf.set(&key, value, &t, i)?;
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

    /// One key's `value` (token `i` of `t`), one arm per key in the order and with the checks of
    /// `parseArgs`, so the two read side by side. Returns the index of the value's last token
    /// (a `[…]` list of `roundup_power2_divisions` takes several).
    fn set(
        &mut self,
        key: &str,
        value: &str,
        t: &[String],
        mut i: usize,
    ) -> Result<usize, AllocConfError> {
        let number = |v: &str| -> Result<u64, AllocConfError> {
            v.parse::<u64>()
                .map_err(|_| value_err(key, format!("'{v}' is not a whole number")))
        };
        let boolean = |v: &str| -> Result<bool, AllocConfError> {
            match v {
                "True" => Ok(true),
                "False" => Ok(false),
                _ => Err(value_err(key, format!("expected True or False, got '{v}'"))),
            }
        };
        match key {
            // `parseMaxSplitSize` / `parseMaxNonSplitRoundingSize`: ≥ kLargeBuffer / 1 MiB.
            "max_split_size_mb" | "max_non_split_rounding_mb" => {
                let mb = number(value)?;
                if mb < LARGE_BUFFER / MIB {
                    return Err(value_err(key, format!("{mb} is too small, must be >= 20")));
                }
                let bytes = mb.saturating_mul(MIB);
                if key == "max_split_size_mb" {
                    self.max_split_size = bytes;
                } else {
                    self.max_non_split_rounding = bytes;
                }
            }
            // `parseGarbageCollectionThreshold`: in (0, 1).
            "garbage_collection_threshold" => {
                let v: f64 = value
                    .parse()
                    .map_err(|_| value_err(key, format!("'{value}' is not a number")))?;
                if !(v > 0.0 && v < 1.0) {
                    return Err(value_err(key, "must be in (0.0, 1.0)"));
                }
                self.garbage_collection_threshold = Some(v);
            }
            "expandable_segments" => self.expandable_segments = boolean(value)?,
            "roundup_power2_divisions" => {
                i = parse_roundup(t, i, &mut self.roundup_power2_divisions)?;
            }
            "backend" => match value {
                "native" => {}
                "cudaMallocAsync" => {
                    return Err(value_err(
                        key,
                        "cudaMallocAsync is not simulated (only the native caching allocator)",
                    ))
                }
                v => {
                    return Err(value_err(
                        key,
                        format!("'{v}': options are native and cudaMallocAsync"),
                    ))
                }
            },
            // Host-side or locking options: no effect on device memory.
            "release_lock_on_cudamalloc"
            | "pinned_use_cuda_host_register"
            | "pinned_use_background_threads" => {
                boolean(value)?;
            }
            "pinned_num_register_threads" => {
                let n = number(value)?;
                if !n.is_power_of_two() {
                    return Err(value_err(key, "has to be a power of 2"));
                }
            }
            _ => {
                return Err(AllocConfError::UnknownKey {
                    key: key.chars().take(60).collect(),
                    allowed: KEYS,
                })
            }
        }
        Ok(i)
    }

    /// `AllocatorConfig::roundup_power2_divisions(size)`: the interval of `floor(log2(size))`,
    /// counted from 1 MiB and clamped to the 16 intervals.
    pub(crate) fn divisions_for(&self, size: u64) -> u64 {
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
pub(crate) fn round_size(size: u64, conf: &AllocConf) -> u64 {
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
pub(crate) fn allocation_size(size: u64) -> u64 {
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
pub(crate) enum AllocEvent {
    /// `malloc(bytes)` on a stream, named by `id` for its free.
    Alloc { id: u64, bytes: u64, stream: u32 },
    /// The tensor `id` is freed (its block returns to the cache).
    Free { id: u64 },
}

/// A sequence that cannot be replayed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub(crate) enum SequenceError {
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
pub(crate) struct AllocatorReport {
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
