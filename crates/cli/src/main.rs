//! `ditmem`: budget, plan, run and verify the memory of a DiT training step.
//!
//! The binary is thin: the commands live in the `ditmem` library (`lib.rs`); this file only
//! installs the counting allocator that `run` measures with.

/// Counts every heap byte of the process, so `run` measures exact live bytes and peaks.
#[global_allocator]
static ALLOC: ditmem_engine::CountingAlloc = ditmem_engine::CountingAlloc::new();

fn main() -> std::process::ExitCode {
    ditmem::main_with(&ALLOC)
}
