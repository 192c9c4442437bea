//! The one resource guard of every command that executes (`run`, `compare`, `verify`, `agree`):
//! the budget's predicted peak against the smallest of the machine's available memory, the
//! process's address-space limit and its cgroup's memory limit, before anything is allocated.

use ditmem_budget::fmt_bytes;

use crate::CliError;

/// A memory limit and what is left under it now, in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Limit {
    /// Names the limit in messages.
    pub name: &'static str,
    /// Bytes left under it.
    pub left: u64,
    /// Whether `--force` may override it: MemAvailable is an estimate (the kernel may swap or
    /// reclaim more); crossing the address-space or cgroup limit aborts or kills the process.
    pub soft: bool,
}

const AVAILABLE: &str = "available memory (MemAvailable)";
const ADDRESS_SPACE: &str = "address-space limit (ulimit -v, RLIMIT_AS)";
const CGROUP: &str = "cgroup memory limit";

fn read_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn status_kib(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// RLIMIT_AS (`ulimit -v`), when the process has one.
fn address_space_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } != 0 {
        return None;
    }
    (lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
}

/// The address space the process maps now (VmSize).
fn mapped_now() -> u64 {
    status_kib("VmSize:").map_or(0, |k| k * 1024)
}

/// What the process allocates beside a step that no budget counts (the spec, the budget's
/// tables, messages): measured below 4 MiB for every command; 16 MiB keeps a margin.
const PROCESS_MARGIN: u64 = 16 << 20;

/// The heap's growth step in force: glibc asks for its top pad with every growth (see
/// `ditmem_engine::malloc`: 256 MiB, at most a sixteenth of an address-space limit).
fn heap_step(limit: u64) -> u64 {
    (256u64 << 20).min(limit / 16)
}

/// RLIMIT_AS minus the address space the process already maps and what it needs beside the
/// step ([`PROCESS_MARGIN`] and a growth of the heap, [`heap_step`]).
fn address_space_left() -> Option<u64> {
    let limit = address_space_limit()?;
    Some(
        limit
            .saturating_sub(mapped_now())
            .saturating_sub(PROCESS_MARGIN + heap_step(limit)),
    )
}

/// The stack of each thread the process starts (Rust's default, or `RUST_MIN_STACK`), and
/// its guard page.
fn thread_stack_bytes() -> u64 {
    let stack = std::env::var("RUST_MIN_STACK")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(2 << 20);
    stack + 4096
}

/// Threads of the pools the engine starts: rayon's (`RAYON_NUM_THREADS`, else every logical
/// core) and candle's barrier pool (as many again), read without starting either.
fn pool_threads() -> u64 {
    let n = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u64));
    2 * n
}

/// The address space a command that executes the engine needs before its step, by part.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ProcessNeed {
    /// Mapped now: the binary, its libraries, the heap so far.
    mapped: u64,
    threads: u64,
    stacks: u64,
    /// `gemm`'s packing slab, one per pool thread.
    slabs: u64,
    heap_step: u64,
    margin: u64,
}

impl ProcessNeed {
    fn total(&self) -> u64 {
        self.mapped + self.stacks + self.slabs + self.heap_step + self.margin
    }
}

fn process_need(limit: u64, extra_threads: u64) -> ProcessNeed {
    let pool = pool_threads();
    let threads = pool + extra_threads;
    ProcessNeed {
        mapped: mapped_now(),
        threads,
        stacks: threads * thread_stack_bytes(),
        slabs: (pool / 2) * ditmem_engine::host::gemm_l2_bytes(),
        heap_step: heap_step(limit),
        margin: PROCESS_MARGIN,
    }
}

fn refuse_process(command: &str, limit: u64, n: &ProcessNeed) -> CliError {
    CliError::Refused(format!(
        "the {ADDRESS_SPACE} is {} ({limit} B) but `ditmem {command}` needs at least {} ({} B) \
         before its step: {} mapped now (the binary, its libraries), {} thread stacks ({}), \
         gemm's packing slabs ({}), a heap growth step ({}) and {} for the process's own \
         allocations; raise that limit",
        fmt_bytes(limit),
        fmt_bytes(n.total()),
        n.total(),
        fmt_bytes(n.mapped),
        n.threads,
        fmt_bytes(n.stacks),
        fmt_bytes(n.slabs),
        fmt_bytes(n.heap_step),
        fmt_bytes(n.margin),
    ))
}

/// The first thing a command that executes the engine does (`run`, `compare`, `verify`,
/// `agree`), before its thread pools exist or anything large is allocated: refuse (exit 3) an
/// address-space limit below what the process needs before any step ([`ProcessNeed`]), which
/// would otherwise abort in an allocation or panic where a thread cannot start.
/// `extra_threads` are threads the command starts beside the pools (verify's workers).
pub(crate) fn check_process(command: &str, extra_threads: u64) -> Result<(), CliError> {
    let Some(limit) = address_space_limit() else {
        return Ok(());
    };
    let need = process_need(limit, extra_threads);
    if need.total() > limit {
        return Err(refuse_process(command, limit, &need));
    }
    Ok(())
}

/// The process's cgroup paths (v2 entry `0::/x`, v1 `N:memory:/x`).
fn cgroup_paths() -> (Option<String>, Option<String>) {
    let text = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut v2 = None;
    let mut v1 = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, ctrl, path) = (parts.next(), parts.next(), parts.next());
        match (ctrl, path) {
            (Some(""), Some(p)) => v2 = Some(p.to_string()),
            (Some(c), Some(p)) if c.split(',').any(|c| c == "memory") => v1 = Some(p.to_string()),
            _ => {}
        }
    }
    (v2, v1)
}

/// The tightest cgroup limit minus its usage: cgroup v2 `memory.max − memory.current` on the
/// process's cgroup and each parent, v1 `memory.limit_in_bytes − memory.usage_in_bytes`.
fn cgroup_left() -> Option<u64> {
    let (v2, v1) = cgroup_paths();
    let mut best: Option<u64> = None;
    let mut take = |left: u64| best = Some(best.map_or(left, |b| b.min(left)));
    if let Some(p) = v2 {
        let mut dir = std::path::PathBuf::from("/sys/fs/cgroup");
        dir.push(p.trim_start_matches('/'));
        loop {
            let max = std::fs::read_to_string(dir.join("memory.max")).ok();
            if let Some(max) = max.and_then(|m| m.trim().parse::<u64>().ok()) {
                let current = read_u64(&dir.join("memory.current").to_string_lossy()).unwrap_or(0);
                take(max.saturating_sub(current));
            }
            if dir == std::path::Path::new("/sys/fs/cgroup") || !dir.pop() {
                break;
            }
        }
    }
    let mut v1_dirs = vec!["/sys/fs/cgroup/memory".to_string()];
    if let Some(p) = v1 {
        v1_dirs.push(format!("/sys/fs/cgroup/memory{}", p.trim_end_matches('/')));
    }
    for d in v1_dirs {
        // v1 writes "no limit" as a number near 2⁶³.
        if let Some(limit) =
            read_u64(&format!("{d}/memory.limit_in_bytes")).filter(|&l| l < 1 << 60)
        {
            let usage = read_u64(&format!("{d}/memory.usage_in_bytes")).unwrap_or(0);
            take(limit.saturating_sub(usage));
        }
    }
    best
}

/// Every limit that applies now.
pub(crate) fn limits() -> Vec<Limit> {
    let mut out = Vec::new();
    if let Some(left) = crate::conditions::available_memory() {
        out.push(Limit {
            name: AVAILABLE,
            left,
            soft: true,
        });
    }
    if let Some(left) = address_space_left() {
        out.push(Limit {
            name: ADDRESS_SPACE,
            left,
            soft: false,
        });
    }
    if let Some(left) = cgroup_left() {
        out.push(Limit {
            name: CGROUP,
            left,
            soft: false,
        });
    }
    out
}

/// Refuse (exit 3) `predicted` bytes that exceed the smallest limit; `--force` overrides only
/// MemAvailable. `what` says what the prediction is of.
pub(crate) fn check(what: &str, predicted: u64, force: bool) -> Result<(), CliError> {
    check_against(what, predicted, force, &limits())
}

fn check_against(
    what: &str,
    predicted: u64,
    force: bool,
    limits: &[Limit],
) -> Result<(), CliError> {
    let binding = limits
        .iter()
        .filter(|l| !(force && l.soft))
        .min_by_key(|l| l.left);
    match binding {
        Some(l) if predicted > l.left => Err(CliError::Refused(format!(
            "the budget predicts a peak of {} ({predicted} B) for {what} but the {} leaves {} \
             ({} B); lower the microbatch, recompute blocks (--recompute all){}",
            fmt_bytes(predicted),
            l.name,
            fmt_bytes(l.left),
            l.left,
            if l.soft {
                ", or pass --force to run anyway"
            } else {
                ", or raise that limit"
            }
        ))),
        _ => Ok(()),
    }
}

/// The budget of `spec`, checked (see [`check`]); returns the predicted peak.
pub(crate) fn check_spec(spec: &ditmem_budget::Spec, force: bool) -> Result<u64, CliError> {
    let budget = ditmem_budget::estimate(spec)?;
    check("this step", budget.peak_bytes, force)?;
    Ok(budget.peak_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smallest_limit_refuses_and_is_named() {
        let l = [
            Limit {
                name: AVAILABLE,
                left: 8 << 30,
                soft: true,
            },
            Limit {
                name: ADDRESS_SPACE,
                left: 2 << 30,
                soft: false,
            },
        ];
        assert!(check_against("x", 1 << 30, false, &l).is_ok());
        match check_against("x", 3 << 30, false, &l) {
            Err(CliError::Refused(m)) => {
                assert!(m.contains(ADDRESS_SPACE) && m.contains("2.00 GiB"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        // --force lifts MemAvailable only.
        assert!(check_against("x", 9 << 30, true, &l[..1]).is_ok());
        assert!(check_against("x", 3 << 30, true, &l).is_err());
    }

    #[test]
    fn the_process_need_names_its_parts() {
        let n = ProcessNeed {
            mapped: 20 << 20,
            threads: 4,
            stacks: 4 * ((2 << 20) + 4096),
            slabs: 2 << 20,
            heap_step: 6 << 20,
            margin: PROCESS_MARGIN,
        };
        assert_eq!(n.total(), ((20 + 8 + 2 + 6 + 16) << 20) + 4 * 4096);
        match refuse_process("run", 50_000_000, &n) {
            CliError::Refused(m) => {
                assert!(m.contains(ADDRESS_SPACE) && m.contains("50000000 B"), "{m}");
                assert!(m.contains("`ditmem run` needs at least"), "{m}");
                assert!(m.contains("4 thread stacks"), "{m}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(heap_step(100_000_000), 6_250_000);
        assert_eq!(heap_step(u64::MAX), 256 << 20);
    }

    #[test]
    fn limits_are_read_without_error() {
        for l in limits() {
            assert!(!l.name.is_empty());
        }
    }
}
