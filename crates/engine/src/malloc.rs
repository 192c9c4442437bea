//! The process's malloc policy (glibc): one arena, and freed blocks kept for the next step.
//!
//! **One arena.** glibc gives every thread that allocates an arena of its own (up to 8 per
//! core), and memory a thread frees returns to that thread's arena only: other threads cannot
//! reuse it. `verify` computes its f64 reference on one thread and the variants on worker
//! threads, so each arena kept its own high-water mark and the resident set grew to about their
//! sum, while the live bytes that the budget predicts (and the counting allocator measures)
//! stayed at the largest phase.
//!
//! **Blocks kept.** By default glibc maps every block above its mmap threshold afresh and
//! unmaps it on free (raising the threshold as it goes, up to 32 MiB), and trims the heap's top
//! once 128 KiB are free there: a step's activations come back from the kernel as zeroed pages
//! every step. Pinning the mmap threshold at its 32 MiB ceiling and trimming only past 2 GiB
//! (with a 256 MiB top pad so the heap grows in large steps; under an address-space limit at
//! most a sixteenth of it) keeps those pages for the next step
//! — what PyTorch's caching allocators do on purpose. Blocks above 32 MiB are still mapped and
//! returned.
//!
//! Measured with `/usr/bin/time` (release, AMD EPYC, 2 cores shared with other builds, so times
//! are not compared), GLIBC_TUNABLES setting the same values:
//!
//! | run | glibc default | one arena | one arena + blocks kept |
//! |---|---|---|---|
//! | `verify` DiT-S/2 64², batch 2, 5 steps, 6 variants, 2 jobs (predicted 1.04 GiB) | RSS 1.75 GiB, 1.48 M faults | RSS 1.03 GiB, 1.29 M faults | |
//! | `verify` DiT-S/4 32², batch 2, 2 steps, 4 variants, 2 jobs (predicted 1.04 GiB) | RSS 1.75 GiB | RSS 1.01 GiB, 867 k faults | RSS 1.01 GiB, 262 k faults |
//! | `run` DiT-S/2 256², batch 8, fp32, 1 + 2 steps | | 512 k faults, 1.37 s system | 298 k faults, 0.94 s system |
//!
//! (fp32 batch 8 measured per step by differencing 2- and 4-step runs: 164 k faults, 0.40 s of
//! system time a step with glibc's default, 2.3 k with blocks kept.) The price of one arena is a
//! lock shared by the threads that allocate; the engine's threads allocate a step's tensors one
//! op at a time, not in inner loops. The environment still decides when it says so:
//! `GLIBC_TUNABLES` or `MALLOC_ARENA_MAX` set leaves every glibc setting alone.

/// What [`one_arena`] did, for a run's conditions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArenaPolicy {
    /// The `mallopt` settings took effect: every thread allocates from one arena, and freed
    /// blocks up to 32 MiB stay in it.
    One,
    /// The environment sets glibc's malloc tunables; they were left as they are.
    Environment,
    /// Not glibc, or `mallopt` refused: the C library's default.
    LibraryDefault,
}

impl ArenaPolicy {
    /// The policy in force, as the conditions print it.
    pub fn describe(self) -> &'static str {
        match self {
            ArenaPolicy::One => {
                "one glibc arena, blocks kept (M_ARENA_MAX 1, M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 2 GiB)"
            },
            ArenaPolicy::Environment => "glibc tunables from the environment",
            ArenaPolicy::LibraryDefault => "the C library's default",
        }
    }
}

static POLICY: std::sync::OnceLock<ArenaPolicy> = std::sync::OnceLock::new();

/// Limit glibc to one malloc arena that keeps freed blocks, unless the environment configures
/// malloc. Call it first thing
/// in `main`, before any other thread exists: a thread keeps the arena of its first allocation.
pub fn one_arena() -> ArenaPolicy {
    *POLICY.get_or_init(|| {
        if std::env::var_os("GLIBC_TUNABLES").is_some()
            || std::env::var_os("MALLOC_ARENA_MAX").is_some()
        {
            return ArenaPolicy::Environment;
        }
        set_one_arena()
    })
}

/// The policy [`one_arena`] put in force (the library default when it was not called).
pub fn policy() -> ArenaPolicy {
    POLICY.get().copied().unwrap_or(ArenaPolicy::LibraryDefault)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_one_arena() -> ArenaPolicy {
    /// glibc's ceiling of the dynamic mmap threshold on 64-bit (`DEFAULT_MMAP_THRESHOLD_MAX`).
    const MMAP_THRESHOLD: i32 = 32 << 20;
    const TRIM_THRESHOLD: i32 = i32::MAX;
    const TOP_PAD: i32 = 256 << 20;
    let settings = [
        (libc::M_ARENA_MAX, 1),
        (libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (libc::M_TOP_PAD, top_pad(TOP_PAD)),
    ];
    let set = |(option, value): (i32, i32)| {
        // SAFETY: mallopt only sets a glibc parameter; each option is valid and each value in
        // its range (glibc returns 1 on success, 0 on error).
        unsafe { libc::mallopt(option, value) == 1 }
    };
    if settings.into_iter().all(set) {
        ArenaPolicy::One
    } else {
        ArenaPolicy::LibraryDefault
    }
}

/// The heap's top pad under the process's address-space limit (`ulimit -v`, RLIMIT_AS): every
/// growth of the heap, even for a few bytes, asks the kernel for the pad as well, and a growth
/// that fails aborts the process. Under a limit the pad is at most a sixteenth of it (a 300 MB
/// limit: 18 MiB steps), so the limit is spent on what the process allocates and the memory
/// guard, not the pad, decides what does not fit.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn top_pad(pad: i32) -> i32 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } != 0
        || lim.rlim_cur == libc::RLIM_INFINITY
    {
        return pad;
    }
    i32::try_from(lim.rlim_cur / 16).map_or(pad, |p| p.min(pad))
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_one_arena() -> ArenaPolicy {
    ArenaPolicy::LibraryDefault
}
