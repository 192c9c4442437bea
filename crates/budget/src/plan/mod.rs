//! The planner: the fastest recipe that fits a memory budget, and why.
//!
//! # Search space
//! Candidates start from the base spec and only move levers in the direction that saves memory:
//! lower precision (bf16-pure only when allowed: its bf16 weights lose small updates), recompute
//! of the first `k` blocks or of the attention core only, memory-efficient attention, a smaller
//! microbatch with more accumulation (the effective batch is kept), cached latents and — only when
//! allowed, because they change what is trained or need more devices — LoRA (rank
//! [`PLAN_LORA_RANK`], or the base's), 8-bit AdamW and ZeRO sharding over the base's ranks. A
//! precision other than the base's is tried only when [`Allow::precision`] is set (the CLI sets
//! it unless the user asked for a precision). LoRA and 8-bit AdamW are used only when needed to
//! fit, never for speed: the search runs without them first, then with 8-bit AdamW, then with
//! LoRA, then with both, and stops at the first that fits ([`plan`]). Each
//! candidate's peak is the budget's timeline (never a factor); its time is the [`crate::cost`]
//! model on a [`DeviceProfile`]. Plans are ranked by predicted step time; at equal time the one
//! with fewer changes wins, then the smaller peak.
//!
//! # Block recompute without enumerating subsets
//! Blocks are identical, so what matters is how many are recomputed and where they sit relative
//! to each other and to the top of the stack: in the engine a recomputed block keeps only its
//! input (the previous block's output, kept anyway when that block is stored), and a block
//! recomputed late is rebuilt on top of every graph below it. For each count `k` the planner
//! compares two placements ([`recompute_candidates`]: the first `k`, and the first `k − 1` plus
//! one after a gap), which a test holds against all `2^depth` subsets of a small model. The peak
//! falls with `k` and the time rises, so the smallest `k` that fits is found by bisection —
//! `O(log depth)` timelines instead of `2^depth`. `all` (`k = depth`) lowers the end of forward
//! but can raise the backward peak by one output, so it is evaluated beside, not assumed to be
//! the leanest.
//!
//! # Search order and pruning
//! The other levers form combinations (precision × attention × microbatch × latents × LoRA ×
//! optimizer × ZeRO). Each is visited in order of its fastest time (no recompute). Before any
//! timeline is simulated, a combination is skipped when an evaluated point is at least as fast as
//! its fastest time and at most its persistent bytes (a lower bound of its peak); after its
//! leanest point (`recompute = all`) is simulated, it is skipped when a point is at least as fast
//! and at most that lean. Both skips are exact: every point of a skipped combination is dominated
//! in (time, peak), so neither the best plan, the floor nor the Pareto front changes.
//!
//! # Repeated timelines and the time limit
//! The search stages ([`search_stages`](stages::search_stages)) and the alternatives each search a space that holds
//! the previous one: a point already simulated in an earlier stage (same recipe, same split) is
//! taken from a cache, not simulated again. The search may be bounded by time
//! ([`SearchControl::time_limit`], which the caller passes as a duration: the planner reads the
//! clock only then): once it has passed, no further combination, stage or alternative is
//! started, and the plan says what was left out ([`Plan::not_searched`]). Combinations are
//! visited fastest first, so what a cut search leaves out is the slower end of the space.

mod evaluate;
mod explain;
mod search;
mod stages;
#[cfg(test)]
mod tests;
mod types;

pub(crate) use evaluate::in_parallel;
pub(crate) use evaluate::recompute_first;
pub(crate) use search::microbatch_candidates;
pub use search::PLAN_MAX_MICROBATCHES;
pub use stages::{plan, plan_with};
pub(crate) use types::PLAN_LORA_RANK;
pub use types::{
    engine_runnable, fmt_secs, Allow, Candidate, Limits, Plan, Progress, SearchControl,
    DEFAULT_HEADROOM,
};
