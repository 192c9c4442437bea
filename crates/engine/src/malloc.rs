//! The process's malloc policy: one glibc arena.
//!
//! glibc gives every thread that allocates an arena of its own (up to 8 per core), and memory a
//! thread frees returns to that thread's arena only: other threads cannot reuse it, and glibc
//! hands it back to the system only from the top of a heap. `verify` computes its f64 reference
//! on one thread and the variants on worker threads, so each arena kept its own high-water mark
//! and the resident set grew to about their sum, while the live bytes that the budget predicts
//! (and the counting allocator measures) stayed at the largest phase. Measured with
//! `/usr/bin/time -v` on `ditmem verify --preset dit-s-2 --resolution 64 --batch 2 --steps 5
//! --jobs 2` with six variants (release, AMD EPYC, 2 cores), predicted peak 1.04 GiB:
//!
//! | glibc setting                    | max RSS   | minor page faults |
//! |----------------------------------|-----------|-------------------|
//! | default (arena per thread)       | 1.75 GiB  | 1.48 M            |
//! | `arena_max=1`                    | 1.03 GiB  | 1.29 M            |
//! | `mmap_threshold=128 KiB` (fixed) | 1.04 GiB  | 14.6 M            |
//! | `trim_threshold=0`               | 1.01 GiB  | 14.6 M            |
//!
//! One arena brings the resident set to the prediction without the page faults of returning
//! every block to the system (the other two settings also pin glibc's mmap threshold, so each
//! large tensor is mapped and faulted in afresh). The price is a lock shared by the threads that
//! allocate; the engine's threads allocate a step's tensors one op at a time, not in inner
//! loops. The environment still decides when it says so: `GLIBC_TUNABLES` or `MALLOC_ARENA_MAX`
//! set leaves glibc's setting alone.

/// What [`one_arena`] did, for a run's conditions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArenaPolicy {
    /// `mallopt(M_ARENA_MAX, 1)` took effect: every thread allocates from one arena.
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
            ArenaPolicy::One => "one glibc arena (M_ARENA_MAX = 1)",
            ArenaPolicy::Environment => "glibc tunables from the environment",
            ArenaPolicy::LibraryDefault => "the C library's default",
        }
    }
}

static POLICY: std::sync::OnceLock<ArenaPolicy> = std::sync::OnceLock::new();

/// Limit glibc to one malloc arena unless the environment configures malloc. Call it first thing
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
    // SAFETY: mallopt only sets a glibc parameter; M_ARENA_MAX is a valid option and 1 a valid
    // value (glibc returns 1 on success, 0 on error).
    if unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) } == 1 {
        ArenaPolicy::One
    } else {
        ArenaPolicy::LibraryDefault
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_one_arena() -> ArenaPolicy {
    ArenaPolicy::LibraryDefault
}
