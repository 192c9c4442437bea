//! Reading a PyTorch out-of-memory message, saying what it means, and ranking the levers that
//! make a spec's step fit the card it came from (`ditmem oom`).
//!
//! # The wording
//! The caching allocator raises `OutOfMemoryError` from `DeviceCachingAllocator::malloc` in
//! pytorch/pytorch `c10/cuda/CUDACachingAllocator.cpp`. Since PyTorch 2.1 it reads
//!
//! ```text
//! CUDA out of memory. Tried to allocate {alloc}. GPU {n} has a total capacity of {total} of which
//! {free} is free. [Process {pid} has {x} memory in use. ...][Including non-PyTorch memory, this
//! process has {x} memory in use. ][{allowed} allowed; ]Of the allocated memory {allocated} is
//! allocated by PyTorch, [With {p} allocated in private pools (e.g., CUDA Graphs), ]and {unalloc}
//! is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting
//! PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation. ...
//! ```
//!
//! (2.1 spelt "total capacty" and ended on `max_split_size_mb`; the process lines come from NVML
//! and are absent on ROCm, whose hipified copy says "HIP out of memory" and
//! `PYTORCH_HIP_ALLOC_CONF`). Up to 2.0 it read
//!
//! ```text
//! CUDA out of memory. Tried to allocate {alloc} (GPU {n}; {total} total capacity; {allocated}
//! already allocated; {free} free; [{allowed} allowed; ]{reserved} reserved in total by PyTorch)
//! ```
//!
//! (before 1.5: `{reserved} cached)`). Sizes are `format_size`: at most 1,024 B as "N bytes",
//! then KiB, MiB and GiB with two decimals ([`format_size`]); other tools print B, KB, MB, GB or
//! TiB, all read here as binary units.

use serde::Serialize;
use thiserror::Error;

pub use crate::levers::{rank_levers, Lever, LeverOptions, LeverReport};
use crate::units::fmt_bytes;

/// Largest message read: 1 MiB (a pasted log with its traceback is a few KiB).
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// How far after "Tried to allocate" the figures of one message are looked for.
const WINDOW_CHARS: usize = 4096;

/// What a message that is one looks like, for the errors.
const EXPECTED: &str = "a PyTorch out-of-memory message such as 'CUDA out of memory. Tried to \
     allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB of which 1.20 GiB is free. ... \
     Of the allocated memory 20.30 GiB is allocated by PyTorch, and 1.60 GiB is reserved by \
     PyTorch but unallocated.' (or the older '(GPU 0; 15.78 GiB total capacity; 14.56 GiB \
     already allocated; 3.75 MiB free; 14.71 GiB reserved in total by PyTorch)')";

/// A text that could not be read as an out-of-memory message.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum OomError {
    /// Nothing but white space.
    #[error("the message is empty; expected {EXPECTED}")]
    Empty,
    /// Longer than [`MAX_MESSAGE_BYTES`].
    #[error("the message has {0} bytes; allowed: at most {MAX_MESSAGE_BYTES} bytes")]
    TooLong(usize),
    /// No "out of memory" in it at all.
    #[error("no out-of-memory message found; expected {EXPECTED}")]
    NotAnOom,
    /// "out of memory" without the caching allocator's figures ("CUDA error: out of memory"
    /// from a kernel launch, cuBLAS or NCCL).
    #[error(
        "an out-of-memory error without the caching allocator's figures (no 'Tried to allocate'; \
         e.g. 'CUDA error: out of memory' from cuBLAS, NCCL or a kernel); expected {EXPECTED}"
    )]
    NoFigures,
    /// A figure the message must carry is not there.
    #[error("the message has no {0}; expected {EXPECTED}")]
    Missing(&'static str),
    /// A figure is there but its size does not read.
    #[error(
        "{field}: '{text}' is not a size; allowed: a number with bytes, B, KiB, MiB, GiB or TiB"
    )]
    BadSize { field: &'static str, text: String },
}

/// Which wording the message uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Wording {
    /// PyTorch ≥ 2.1: "GPU 0 has a total capacity of … of which … is free."
    Current,
    /// PyTorch ≤ 2.0: "(GPU 0; … total capacity; … already allocated; … free; … reserved …)".
    Legacy,
}

/// One "Process {pid} has {x} memory in use." entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ProcessUse {
    pub pid: u64,
    pub bytes: u64,
}

/// The figures of one out-of-memory message, in bytes (read from two-decimal figures: within
/// 0.5 % of a unit of what PyTorch counted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OomMessage {
    /// `CUDA`, `HIP`, `XPU`, … (the word before "out of memory"; empty when none).
    pub backend: String,
    pub wording: Wording,
    /// The device index ("GPU 3").
    pub device: Option<u32>,
    /// The rank of a `[rank7]:` prefix (torchrun's log lines), when there is one.
    pub rank: Option<u32>,
    /// "Tried to allocate": the block the allocator could not find (rounded by the allocator).
    pub requested_bytes: u64,
    /// `cudaMemGetInfo`'s total: the capacity as CUDA sees it.
    pub total_bytes: u64,
    /// `cudaMemGetInfo`'s free at the failure (absent from some backends' wording).
    pub free_bytes: Option<u64>,
    /// Allocated by PyTorch (private pools included).
    pub allocated_bytes: u64,
    /// Reserved by PyTorch but unallocated: cached segments' free parts.
    pub reserved_unallocated_bytes: u64,
    /// "With … allocated in private pools (e.g., CUDA Graphs)".
    pub private_pool_bytes: Option<u64>,
    /// "… allowed;": the cap of `torch.cuda.set_per_process_memory_fraction`.
    pub allowed_bytes: Option<u64>,
    /// "Including non-PyTorch memory, this process has … memory in use".
    pub this_process_bytes: Option<u64>,
    /// "Process {pid} has … memory in use", in order.
    pub processes: Vec<ProcessUse>,
    /// How many out-of-memory messages the text holds (the first is read).
    pub messages_in_text: usize,
}

/// Parse a size as PyTorch and friends print it: "2.00 GiB", "0 bytes", "512 B", "20.00 MiB".
fn size_token(num: &str, unit: &str) -> Option<u64> {
    if num.is_empty() || num.len() > 32 || !num.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return None;
    }
    let v: f64 = num.parse().ok()?;
    let unit = unit.trim_end_matches(['.', ',', ';', ')']);
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "bytes" | "byte" | "b" => 1.0,
        "kib" | "kb" => 1024.0,
        "mib" | "mb" => 1024.0 * 1024.0,
        "gib" | "gb" => 1024.0 * 1024.0 * 1024.0,
        "tib" | "tb" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    let b = (v * mult).round();
    (b.is_finite() && (0.0..9.0e18).contains(&b)).then_some(b as u64)
}

/// The size at the start of `s` ("2.00 GiB…"), and the text after it; the number may touch its
/// unit ("20.00MiB").
fn size_after(s: &str) -> Option<(u64, &str)> {
    let s = s.trim_start();
    let n = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, rest) = s.split_at(n);
    let rest = rest.trim_start();
    let u = rest
        .find(|c: char| !c.is_ascii_alphabetic())
        .unwrap_or(rest.len());
    let (unit, after) = rest.split_at(u);
    size_token(num, unit).map(|b| (b, after))
}

/// Where the run of trailing characters of `s` that satisfy `keep` starts (a char boundary).
fn trailing_run(s: &str, keep: impl Fn(char) -> bool) -> usize {
    s.char_indices()
        .rev()
        .find(|&(_, c)| !keep(c))
        .map_or(0, |(i, c)| i + c.len_utf8())
}

/// The size that ends `s` ("… 14.56 GiB"), e.g. the text before " already allocated".
fn size_before(s: &str) -> Option<u64> {
    let s = s.trim_end();
    let (head, unit) = s.split_at(trailing_run(s, |c| c.is_ascii_alphabetic()));
    let head = head.trim_end();
    let n = trailing_run(head, |c| c.is_ascii_digit() || c == '.');
    size_token(&head[n..], unit)
}

/// A few words of `s` for an error (never the whole log).
fn shown(s: &str) -> String {
    let t: String = s.trim().chars().take(24).collect();
    t.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// `find`, ASCII case-insensitive (the needle is ASCII, so every match starts and ends on a
/// character boundary).
fn find_ci(hay: &str, needle: &str) -> Option<usize> {
    let (h, n) = (hay.as_bytes(), needle.as_bytes());
    if n.is_empty() || h.len() < n.len() {
        return None;
    }
    (0..=h.len() - n.len()).find(|&i| h[i..i + n.len()].eq_ignore_ascii_case(n))
}

/// The size right after `key` in `w` (`Ok(None)` when `key` is not there).
fn after_key(w: &str, key: &str, field: &'static str) -> Result<Option<u64>, OomError> {
    match w.find(key) {
        None => Ok(None),
        Some(i) => {
            let rest = &w[i + key.len()..];
            size_after(rest)
                .map(|(b, _)| Some(b))
                .ok_or(OomError::BadSize {
                    field,
                    text: shown(rest),
                })
        }
    }
}

/// The size right before `key` in `w`, looking no further back than `from`.
fn before_key(
    w: &str,
    from: usize,
    key: &str,
    field: &'static str,
) -> Result<Option<u64>, OomError> {
    match w[from..].find(key) {
        None => Ok(None),
        Some(i) => {
            let head = &w[from..from + i];
            // The field is the text after the last separator.
            let start = head.rfind([';', '(', ',']).map_or(0, |j| j + 1);
            let text = &head[start..];
            size_before(text).map(Some).ok_or(OomError::BadSize {
                field,
                text: shown(text),
            })
        }
    }
}

/// The unsigned integer at the start of `s`.
fn leading_int(s: &str) -> Option<u64> {
    let n = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    if n == 0 || n > 18 {
        return None;
    }
    s[..n].parse().ok()
}

/// The "Process {pid} has {x} memory in use." entries, in order.
fn processes_in(w: &str) -> Vec<ProcessUse> {
    let mut processes = Vec::new();
    let mut pos = 0;
    while let Some(i) = w[pos..].find("Process ") {
        let start = pos + i + "Process ".len();
        pos = start;
        let Some(pid) = leading_int(&w[start..]) else {
            continue;
        };
        let rest = &w[start..];
        let Some(h) = rest.find(" has ") else {
            continue;
        };
        if h > 20 {
            continue;
        }
        if let Some((bytes, after)) = size_after(&rest[h + 5..]) {
            if after.trim_start().starts_with("memory in use") {
                processes.push(ProcessUse { pid, bytes });
            }
        }
    }
    processes
}

/// The figures of the PyTorch ≥ 2.1 wording ("GPU 0 has a total capacity of … of which … is
/// free. … Of the allocated memory … is reserved by PyTorch but unallocated").
fn read_current(w: &str, total_bytes: u64, head: OomMessage) -> Result<OomMessage, OomError> {
    let free_bytes = match w.find(" of which ") {
        Some(i) => before_key(w, i + 9, " is free", "free")?,
        None => None,
    };
    let processes = processes_in(w);
    let this_process_bytes = after_key(w, "this process has ", "this process")?;
    let allowed_bytes = before_key(w, 0, " allowed; ", "allowed")?;
    let allocated_bytes = after_key(w, "Of the allocated memory ", "allocated")?.ok_or(
        OomError::Missing("allocated memory ('Of the allocated memory …')"),
    )?;
    let private_pool_bytes = match w.find(" allocated in private pools") {
        Some(_) => after_key(w, "With ", "private pools")?,
        None => None,
    };
    let reserved_unallocated_bytes = before_key(
        w,
        0,
        " is reserved by PyTorch but unallocated",
        "reserved but unallocated",
    )?
    .ok_or(OomError::Missing(
        "reserved memory ('… is reserved by PyTorch but unallocated')",
    ))?;
    Ok(OomMessage {
        total_bytes,
        free_bytes,
        allocated_bytes,
        reserved_unallocated_bytes,
        private_pool_bytes,
        allowed_bytes,
        this_process_bytes,
        processes,
        ..head
    })
}

/// The figures of the PyTorch ≤ 2.0 wording ("(GPU 0; … total capacity; … already allocated;
/// … free; … reserved in total by PyTorch)").
fn read_legacy(w: &str, head: OomMessage) -> Result<OomMessage, OomError> {
    let total_bytes = before_key(w, 0, " total capacity", "total capacity")?
        .ok_or(OomError::Missing("total capacity"))?;
    let allocated_bytes = before_key(w, 0, " already allocated", "already allocated")?.ok_or(
        OomError::Missing("allocated memory ('… already allocated')"),
    )?;
    let free_bytes = before_key(w, 0, " free;", "free")?;
    let allowed_bytes = before_key(w, 0, " allowed;", "allowed")?;
    let reserved = match before_key(w, 0, " reserved in total by PyTorch", "reserved")? {
        Some(r) => r,
        None => before_key(w, 0, " cached)", "cached")?.ok_or(OomError::Missing(
            "reserved memory ('… reserved in total by PyTorch')",
        ))?,
    };
    Ok(OomMessage {
        wording: Wording::Legacy,
        total_bytes,
        free_bytes,
        allocated_bytes,
        reserved_unallocated_bytes: reserved.saturating_sub(allocated_bytes),
        allowed_bytes,
        ..head
    })
}

impl OomMessage {
    /// Read the first out-of-memory message in `text` (a pasted log is fine: the traceback and
    /// other lines around it are skipped; line breaks inside the message are read as spaces).
    pub fn parse(text: &str) -> Result<OomMessage, OomError> {
        if text.len() > MAX_MESSAGE_BYTES {
            return Err(OomError::TooLong(text.len()));
        }
        if text.trim().is_empty() {
            return Err(OomError::Empty);
        }
        let norm = text.split_whitespace().collect::<Vec<_>>().join(" ");
        const ANCHOR: &str = "out of memory. Tried to allocate";
        let Some(at) = find_ci(&norm, ANCHOR) else {
            return Err(if find_ci(&norm, "out of memory").is_some() {
                OomError::NoFigures
            } else {
                OomError::NotAnOom
            });
        };
        let mut messages_in_text = 1;
        let mut next = at + ANCHOR.len();
        while let Some(i) = find_ci(&norm[next..], ANCHOR) {
            messages_in_text += 1;
            next += i + ANCHOR.len();
        }
        let backend = norm[..at]
            .split(|c: char| c.is_whitespace() || c == ':')
            .rev()
            .find(|w| !w.is_empty())
            .filter(|w| w.len() <= 8 && w.chars().all(|c| c.is_ascii_uppercase()))
            .unwrap_or("")
            .to_string();
        let rank = {
            // `at` is a char boundary; 200 bytes before it may not be: move up to one.
            let mut s = at.saturating_sub(200);
            while !norm.is_char_boundary(s) {
                s += 1;
            }
            let head = &norm[s..at];
            head.rfind("[rank")
                .and_then(|i| leading_int(&head[i + 5..]))
                .and_then(|r| u32::try_from(r).ok())
        };
        let body = &norm[at + ANCHOR.len()..];
        let body_end = find_ci(body, ANCHOR).unwrap_or(body.len());
        let mut cut = body_end.min(WINDOW_CHARS);
        while !body.is_char_boundary(cut) {
            cut -= 1;
        }
        let w = &body[..cut];
        let (requested_bytes, _) = size_after(w).ok_or(OomError::BadSize {
            field: "Tried to allocate",
            text: shown(w),
        })?;
        let device = w
            .find("GPU ")
            .and_then(|i| leading_int(&w[i + 4..]))
            .and_then(|d| u32::try_from(d).ok());
        // What both wordings carry; each reader fills in its own figures.
        let head = OomMessage {
            backend,
            wording: Wording::Current,
            device,
            rank,
            requested_bytes,
            total_bytes: 0,
            free_bytes: None,
            allocated_bytes: 0,
            reserved_unallocated_bytes: 0,
            private_pool_bytes: None,
            allowed_bytes: None,
            this_process_bytes: None,
            processes: Vec::new(),
            messages_in_text,
        };
        let current_total = match after_key(w, "has a total capacity of ", "total capacity")? {
            Some(b) => Some(b),
            None => after_key(w, "has a total capacty of ", "total capacity")?,
        };
        match current_total {
            Some(total_bytes) => read_current(w, total_bytes, head),
            None => read_legacy(w, head),
        }
    }

    /// Reserved by PyTorch: allocated + cached but unallocated.
    pub fn reserved_bytes(&self) -> u64 {
        self.allocated_bytes
            .saturating_add(self.reserved_unallocated_bytes)
    }

    /// What the process needed when it failed: allocated + the request (a lower bound of the
    /// step's peak: the failure may come before it).
    pub fn needed_bytes(&self) -> u64 {
        self.allocated_bytes.saturating_add(self.requested_bytes)
    }

    /// The entry of `processes` that is this process, when the message has no "this process"
    /// line but lists one at least as large as PyTorch's reservation (NVML sees the host's pid
    /// and the process its container's, so it lists itself as another process).
    pub fn self_listed(&self) -> Option<ProcessUse> {
        if self.this_process_bytes.is_some() {
            return None;
        }
        self.processes
            .iter()
            .copied()
            .filter(|p| p.bytes >= self.reserved_bytes())
            .max_by_key(|p| p.bytes)
    }

    /// Memory held by other processes on the device.
    pub fn other_processes_bytes(&self) -> u64 {
        let me = self.self_listed();
        self.processes
            .iter()
            .filter(|p| Some(**p) != me)
            .map(|p| p.bytes)
            .sum()
    }

    /// This process's memory outside PyTorch's allocator (CUDA context, cuBLAS/cuDNN handles,
    /// NCCL buffers, bitsandbytes' paged memory …), when the message says what the process holds.
    pub fn non_pytorch_bytes(&self) -> Option<u64> {
        self.this_process_bytes
            .or(self.self_listed().map(|p| p.bytes))
            .map(|t| t.saturating_sub(self.reserved_bytes()))
    }

    /// What the failure means ([`Cause`]).
    pub fn cause(&self) -> Cause {
        let free = self.free_bytes.unwrap_or(0);
        if let Some(a) = self.allowed_bytes {
            if self.reserved_bytes().saturating_add(self.requested_bytes) > a
                && free >= self.requested_bytes
            {
                return Cause::Limit;
            }
        }
        if free.saturating_add(self.reserved_unallocated_bytes) >= self.requested_bytes {
            Cause::Fragmentation
        } else {
            Cause::Shortage
        }
    }
}

/// Why the allocation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// Free + reserved-but-unallocated covers the request: the bytes are there, in pieces (cached
    /// segments' free parts no request of this size can use). `expandable_segments:True` is the
    /// lever.
    Fragmentation,
    /// Free + reserved-but-unallocated is less than the request: the step needs more memory than
    /// the card has left.
    Shortage,
    /// The device has the bytes, but `set_per_process_memory_fraction`'s cap ("allowed") is hit.
    Limit,
}

impl Cause {
    pub const fn name(self) -> &'static str {
        match self {
            Cause::Fragmentation => "fragmentation",
            Cause::Shortage => "true shortage",
            Cause::Limit => "memory-fraction limit",
        }
    }
}

/// PyTorch's `format_size` (c10/cuda/CUDACachingAllocator.cpp): "N bytes" up to 1,024, then
/// KiB up to 1 MiB, MiB up to 1 GiB, GiB above, two decimals.
pub fn format_size(size: u64) -> String {
    let s = size as f64;
    if size <= 1024 {
        format!("{size} bytes")
    } else if size <= 1 << 20 {
        format!("{:.2} KiB", s / 1024.0)
    } else if size <= 1 << 30 {
        format!("{:.2} MiB", s / 1048576.0)
    } else {
        format!("{:.2} GiB", s / 1073741824.0)
    }
}

/// The catalog cards whose capacity a reported total matches.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuMatch {
    /// The catalog card nearest in capacity.
    pub nearest: &'static str,
    pub nearest_capacity_bytes: u64,
    /// Every catalog card within [`MATCH_BELOW`] below to [`MATCH_ABOVE`] above the total, nearest
    /// first (a "24 GB" total matches several cards: the name is the user's to give).
    pub candidates: Vec<&'static str>,
    /// Whether any card is within the tolerance (else `nearest` is only the closest).
    pub within: bool,
}

/// A reported total may sit this far below a card's catalog capacity (WDDM and MIG keep some;
/// a marketing-basis capacity is an upper bound).
pub(crate) const MATCH_BELOW: f64 = 0.07;
/// … and this far above it (drivers move the figure by tens of MiB).
pub(crate) const MATCH_ABOVE: f64 = 0.01;

/// The catalog cards a reported total capacity matches.
pub fn match_gpu(total_bytes: u64) -> GpuMatch {
    let t = total_bytes as f64;
    let mut all: Vec<&'static crate::gpu::Gpu> = crate::gpu::all().iter().collect();
    all.sort_by_key(|g| g.capacity_bytes().abs_diff(total_bytes));
    let nearest = all[0];
    let candidates: Vec<&'static str> = all
        .iter()
        .filter(|g| {
            let c = g.capacity_bytes() as f64;
            t >= c * (1.0 - MATCH_BELOW) && t <= c * (1.0 + MATCH_ABOVE)
        })
        .map(|g| g.name)
        .collect();
    GpuMatch {
        nearest: nearest.name,
        nearest_capacity_bytes: nearest.capacity_bytes(),
        within: !candidates.is_empty(),
        candidates,
    }
}

/// The figures of a message in words-ready form: what failed and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Diagnosis {
    pub cause: Cause,
    pub requested_bytes: u64,
    pub total_bytes: u64,
    pub free_bytes: Option<u64>,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    pub reserved_unallocated_bytes: u64,
    /// Free + reserved-but-unallocated: what could have served the request, were it in one piece.
    pub available_bytes: u64,
    /// Request − available, when a true shortage.
    pub shortfall_bytes: u64,
    /// Allocated + requested: what the process needed at the failure.
    pub needed_bytes: u64,
    pub non_pytorch_bytes: Option<u64>,
    pub other_processes_bytes: u64,
    pub gpu: GpuMatch,
}

impl OomMessage {
    pub fn diagnosis(&self) -> Diagnosis {
        let available = self
            .free_bytes
            .unwrap_or(0)
            .saturating_add(self.reserved_unallocated_bytes);
        Diagnosis {
            cause: self.cause(),
            requested_bytes: self.requested_bytes,
            total_bytes: self.total_bytes,
            free_bytes: self.free_bytes,
            allocated_bytes: self.allocated_bytes,
            reserved_bytes: self.reserved_bytes(),
            reserved_unallocated_bytes: self.reserved_unallocated_bytes,
            available_bytes: available,
            shortfall_bytes: self.requested_bytes.saturating_sub(available),
            needed_bytes: self.needed_bytes(),
            non_pytorch_bytes: self.non_pytorch_bytes(),
            other_processes_bytes: self.other_processes_bytes(),
            gpu: match_gpu(self.total_bytes),
        }
    }
}

/// How the spec's predicted peak compares with what the message reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Agreement {
    /// The spec's allocated peak (requested bytes).
    pub predicted_allocated_bytes: u64,
    /// Allocated + requested in the message.
    pub message_needed_bytes: u64,
    /// predicted / needed.
    pub ratio: f64,
    /// In words.
    pub verdict: String,
}

/// Hold the spec's predicted allocated peak against the message's allocated + requested (a
/// lower bound of the step's need: the failure may come before the peak).
pub fn agreement(msg: &OomMessage, base: &Lever) -> Agreement {
    let needed = msg.needed_bytes();
    let pred = base.allocated_peak_bytes;
    let ratio = if needed > 0 {
        pred as f64 / needed as f64
    } else {
        0.0
    };
    let verdict = if ratio >= 0.9 {
        format!(
            "consistent: the spec predicts an allocated peak of {} ({:.2} × the {} the process \
             held when it failed; the failure can come before the peak)",
            fmt_bytes(pred),
            ratio,
            fmt_bytes(needed)
        )
    } else {
        format!(
            "the spec predicts less than the process held: {} against {} ({:.2} ×) — the run \
             likely holds more than the spec describes (a larger batch or resolution, text \
             encoders or a VAE on the device, an EMA copy, another model)",
            fmt_bytes(pred),
            fmt_bytes(needed),
            ratio
        )
    };
    Agreement {
        predicted_allocated_bytes: pred,
        message_needed_bytes: needed,
        ratio,
        verdict,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::levers::compact_blocks;
    use proptest::prelude::*;

    const GIB: f64 = 1073741824.0;
    const MIB: f64 = 1048576.0;

    fn close(got: u64, want_units: f64, unit: f64) {
        let want = want_units * unit;
        assert!(
            (got as f64 - want).abs() <= 0.5,
            "got {got}, want {want} ({want_units} × {unit})"
        );
    }

    const CURRENT: &str = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB of which 1.20 GiB is free. Including non-PyTorch memory, this process has 22.43 GiB memory in use. Of the allocated memory 20.30 GiB is allocated by PyTorch, and 1.60 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.";

    #[test]
    fn oom_reads_the_current_wording() {
        let m = OomMessage::parse(CURRENT).unwrap();
        assert_eq!(m.backend, "CUDA");
        assert_eq!(m.wording, Wording::Current);
        assert_eq!(m.device, Some(0));
        close(m.requested_bytes, 2.0, GIB);
        close(m.total_bytes, 23.65, GIB);
        close(m.free_bytes.unwrap(), 1.20, GIB);
        close(m.this_process_bytes.unwrap(), 22.43, GIB);
        close(m.allocated_bytes, 20.30, GIB);
        close(m.reserved_unallocated_bytes, 1.60, GIB);
        // 1.20 free + 1.60 cached ≥ 2.00 requested: the bytes are there, in pieces.
        assert_eq!(m.cause(), Cause::Fragmentation);
        close(m.non_pytorch_bytes().unwrap(), 22.43 - 21.90, GIB);
    }

    #[test]
    fn oom_reads_the_legacy_wording_and_classifies_shortage() {
        let t = "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.56 GiB already allocated; 3.75 MiB free; 14.71 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.";
        let m = OomMessage::parse(t).unwrap();
        assert_eq!(m.wording, Wording::Legacy);
        close(m.requested_bytes, 20.0, MIB);
        close(m.total_bytes, 15.78, GIB);
        close(m.allocated_bytes, 14.56, GIB);
        close(m.free_bytes.unwrap(), 3.75, MIB);
        // 3.75 MiB free + 0.15 GiB cached ≥ 20 MiB: fragmentation.
        assert_eq!(m.cause(), Cause::Fragmentation);
        let t = "CUDA out of memory. Tried to allocate 146.00 MiB (GPU 1; 8.00 GiB total capacity; 7.21 GiB already allocated; 0 bytes free; 7.22 GiB reserved in total by PyTorch)";
        let m = OomMessage::parse(t).unwrap();
        assert_eq!(m.device, Some(1));
        assert_eq!(m.free_bytes, Some(0));
        assert_eq!(m.cause(), Cause::Shortage);
        // Before PyTorch 1.5: "cached".
        let t = "CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0; 10.92 GiB total capacity; 8.57 MiB already allocated; 9.28 GiB free; 4.68 MiB cached)";
        let m = OomMessage::parse(t).unwrap();
        close(m.allocated_bytes, 8.57, MIB);
        // Cached below allocated (as printed): nothing reserved but unallocated.
        assert_eq!(m.reserved_unallocated_bytes, 0);
    }

    #[test]
    fn oom_reads_hip_processes_ranks_and_limits() {
        let t = "[rank3]: torch.OutOfMemoryError: HIP out of memory. Tried to allocate 124.00 MiB. GPU 3 has a total capacity of 19.94 GiB of which 554.47 MiB is free. Of the allocated memory 15.87 GiB is allocated by PyTorch, and 165.29 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_HIP_ALLOC_CONF=expandable_segments:True";
        let m = OomMessage::parse(t).unwrap();
        assert_eq!(
            (m.backend.as_str(), m.device, m.rank),
            ("HIP", Some(3), Some(3))
        );
        assert!(m.processes.is_empty() && m.this_process_bytes.is_none());
        let t = "CUDA out of memory. Tried to allocate 180.00 MiB. GPU 0 has a total capacity of 23.53 GiB of which 81.00 MiB is free. Process 1692486 has 506.00 MiB memory in use. Process 3154968 has 550.00 MiB memory in use. Including non-PyTorch memory, this process has 22.39 GiB memory in use. 10.00 GiB allowed; Of the allocated memory 21.58 GiB is allocated by PyTorch, With 1.00 GiB allocated in private pools (e.g., CUDA Graphs), and 350.11 MiB is reserved by PyTorch but unallocated.";
        let m = OomMessage::parse(t).unwrap();
        assert_eq!(m.processes.len(), 2);
        assert_eq!(m.processes[0].pid, 1692486);
        close(m.other_processes_bytes(), 1056.0, MIB);
        close(m.allowed_bytes.unwrap(), 10.0, GIB);
        close(m.private_pool_bytes.unwrap(), 1.0, GIB);
        // A process listed by its host pid (a container) is this one when nothing else is.
        let t = "CUDA out of memory. Tried to allocate 48.00 MiB. GPU 0 has a total capacty of 23.64 GiB of which 9.69 MiB is free. Process 20296 has 23.63 GiB memory in use. Of the allocated memory 22.81 GiB is allocated by PyTorch, and 362.31 MiB is reserved by PyTorch but unallocated.";
        let m = OomMessage::parse(t).unwrap();
        assert_eq!(m.self_listed().map(|p| p.pid), Some(20296));
        assert_eq!(m.other_processes_bytes(), 0);
        assert_eq!(m.cause(), Cause::Fragmentation);
    }

    #[test]
    fn oom_refuses_what_is_not_one() {
        assert_eq!(OomMessage::parse("  \n"), Err(OomError::Empty));
        assert_eq!(OomMessage::parse("hello"), Err(OomError::NotAnOom));
        assert_eq!(
            OomMessage::parse("RuntimeError: CUDA error: out of memory"),
            Err(OomError::NoFigures)
        );
        let e = OomMessage::parse("CUDA out of memory. Tried to allocate lots. GPU 0").unwrap_err();
        assert!(matches!(e, OomError::BadSize { .. }), "{e}");
        let e = OomMessage::parse("CUDA out of memory. Tried to allocate 2 GiB.").unwrap_err();
        assert_eq!(e, OomError::Missing("total capacity"));
        for e in [OomError::Empty, OomError::NotAnOom, OomError::NoFigures] {
            let line = e.to_string();
            assert!(!line.contains('\n') && line.contains("expected"), "{line}");
        }
    }

    #[test]
    fn oom_matches_catalog_cards() {
        let m = match_gpu((23.65 * GIB) as u64);
        assert!(m.within);
        assert!(m.candidates.contains(&"rtx-4090") && m.candidates.contains(&"rtx-3090"));
        let m = match_gpu((79.15 * GIB) as u64);
        assert!(m.candidates.contains(&"h100-sxm") || m.candidates.contains(&"a100-80gb"));
        let m = match_gpu(1 << 40);
        assert!(!m.within && m.candidates.is_empty());
    }

    #[test]
    fn oom_compacts_block_lists() {
        assert_eq!(
            compact_blocks("recompute 5 of 9 blocks (blocks:0,1,2,3,5); x"),
            "recompute 5 of 9 blocks (blocks 0–3, 5); x"
        );
        assert_eq!(compact_blocks("precision a → b"), "precision a → b");
        assert_eq!(compact_blocks("(blocks:x)"), "(blocks:x)");
    }

    #[test]
    fn oom_format_size_is_pytorchs() {
        assert_eq!(format_size(0), "0 bytes");
        assert_eq!(format_size(1024), "1024 bytes");
        assert_eq!(format_size(1025), "1.00 KiB");
        assert_eq!(format_size(20 << 20), "20.00 MiB");
        assert_eq!(format_size(2 << 30), "2.00 GiB");
    }

    /// A message in either wording from exact figures.
    fn message(current: bool, f: &[u64; 5], device: u32) -> String {
        let [req, total, free, alloc, unalloc] = f.map(format_size);
        if current {
            format!(
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {req}. GPU {device} has a total capacity of {total} of which {free} is free. Including non-PyTorch memory, this process has {total} memory in use. Of the allocated memory {alloc} is allocated by PyTorch, and {unalloc} is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
            )
        } else {
            let reserved = format_size(f[3] + f[4]);
            format!(
                "RuntimeError: CUDA out of memory. Tried to allocate {req} (GPU {device}; {total} total capacity; {alloc} already allocated; {free} free; {reserved} reserved in total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
            )
        }
    }

    /// Within what two decimals of the printed unit can say.
    fn near(got: u64, want: u64) -> bool {
        let unit = if want <= 1024 {
            return got == want;
        } else if want <= 1 << 20 {
            1024.0
        } else if want <= 1 << 30 {
            MIB
        } else {
            GIB
        };
        (got as f64 - want as f64).abs() <= 0.005 * unit + 1.0
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn oom_never_panics_on_any_text(s in "\\PC{0,400}") {
            let _ = OomMessage::parse(&s);
        }

        #[test]
        fn oom_never_panics_on_mangled_messages(cut in 0usize..600, junk in "\\PC{0,40}") {
            let mut t: String = CURRENT.chars().take(cut).collect();
            t.push_str(&junk);
            t.push_str(&CURRENT.chars().skip(cut).collect::<String>());
            let _ = OomMessage::parse(&t);
        }

        #[test]
        fn oom_round_trips_generated_messages(
            current in any::<bool>(),
            req in 0u64..(64u64 << 30),
            total in (1u64 << 30)..(200u64 << 30),
            free in 0u64..(8u64 << 30),
            alloc in 0u64..(150u64 << 30),
            unalloc in 0u64..(8u64 << 30),
            device in 0u32..16,
        ) {
            let f = [req, total, free, alloc, unalloc];
            let t = message(current, &f, device);
            let m = OomMessage::parse(&t).unwrap();
            prop_assert_eq!(m.device, Some(device));
            prop_assert!(near(m.requested_bytes, req), "req {} vs {}", m.requested_bytes, req);
            prop_assert!(near(m.total_bytes, total));
            prop_assert!(near(m.free_bytes.unwrap(), free));
            prop_assert!(near(m.allocated_bytes, alloc));
            if current {
                prop_assert!(near(m.reserved_unallocated_bytes, unalloc));
            } else {
                prop_assert!(near(m.reserved_bytes(), alloc + unalloc));
            }
        }
    }
}
