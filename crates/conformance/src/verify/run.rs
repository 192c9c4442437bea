//! Running the variants: each one's step and drift run ([`run_variant`]), several at once
//! within the memory plan ([`run_all`]).

use super::drift::{drift, Drift};
use super::error::bad;
use super::error::Result;
use super::one_step::{one_step, OneStep};
use super::reference::{Reference, VerifyOptions};
use super::report::Event;
use super::variant::Variant;
use ditmem_budget::Spec;
use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;

/// What verification keeps of one variant: its comparison (a few numbers per tensor and per
/// step) and one 64-bit digest of every value it computed, for the bitwise twin check.
pub(super) struct Run {
    pub(super) one: OneStep,
    pub(super) drift: Option<Drift>,
    /// SipHash of the bits of the loss, every gradient value, every drift loss and every weight
    /// after every step: two runs with equal digests are bitwise identical (a collision needs
    /// 2^32 distinct runs to become likely).
    pub(super) digest: u64,
}

pub(super) fn run_variant(
    base: &Spec,
    v: &Variant,
    opts: &VerifyOptions,
    reference: &Reference,
    step_done: &mut dyn FnMut(u32),
) -> Result<Run> {
    let mut spec = v.apply(base);
    if let Some(cpu) = &mut spec.cpu {
        // A variant steps on the pool it runs in: a worker's own one-thread pool when several
        // run at once (`run_all`), else the global one. verify holds numerics, not memory, so
        // the spec follows the pool (with RAYON_NUM_THREADS=2 and two jobs the spec said 2 and
        // every variant was refused after the whole reference had run).
        cpu.threads = crate::host::threads();
    }
    let mut rd = reference.reader()?;
    let mut h = DefaultHasher::new();
    let one = one_step(&spec, v.fault.as_ref(), opts, reference, &mut rd, &mut h)?;
    let drift = if opts.steps > 0 {
        Some(drift(&spec, opts, reference, &mut rd, &mut h, step_done)?)
    } else {
        None
    };
    Ok(Run {
        one,
        drift,
        digest: h.finish(),
    })
}

/// Messages from the workers to the calling thread.
pub(super) enum Msg {
    Start(usize),
    Step(usize, u32),
    Done(usize, Box<Result<Run>>),
    /// A worker could not start; the variants it would have run are taken by the others.
    Failed(String),
}

/// Run every variant on `jobs` worker threads (each variant is independent and deterministic:
/// its own trainer, weights, data and optimizer, compared with the reference file as it steps),
/// reporting progress on the calling thread.
pub(super) fn run_all(
    base: &Spec,
    variants: &[Variant],
    opts: &VerifyOptions,
    reference: &Reference,
    jobs: usize,
    progress: &mut dyn FnMut(Event<'_>),
) -> Vec<Result<Run>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    let n = variants.len();
    let next = AtomicUsize::new(0);
    let names: Vec<String> = variants.iter().map(Variant::name).collect();
    let mut results: Vec<Option<Result<Run>>> = (0..n).map(|_| None).collect();
    let mut failure: Option<String> = None;
    let steps = opts.steps;
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel::<Msg>();
        let workers = jobs.clamp(1, n.max(1));
        for _ in 0..workers {
            let tx = tx.clone();
            let next = &next;
            scope.spawn(move || {
                // A trainer's step runs on a rayon pool (`trainer::on_pool`). Several workers
                // sharing the global pool would queue their steps on it — with the one thread
                // the CLI gives it under --jobs > 1, one variant computed at a time however
                // many jobs were asked for (measured: one busy thread of three). Each worker
                // therefore steps on a pool of its own thread; one worker keeps the global pool
                // and all its threads.
                let pool = if workers > 1 {
                    match rayon::ThreadPoolBuilder::new().num_threads(1).build() {
                        Ok(p) => Some(p),
                        Err(e) => {
                            let _ = tx.send(Msg::Failed(format!("cannot start a worker: {e}")));
                            return;
                        }
                    }
                } else {
                    None
                };
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= n {
                        break;
                    }
                    let _ = tx.send(Msg::Start(i));
                    let run = || {
                        run_variant(base, &variants[i], opts, reference, &mut |s| {
                            let _ = tx.send(Msg::Step(i, s));
                        })
                    };
                    let r = match &pool {
                        Some(p) => p.install(run),
                        None => run(),
                    };
                    let _ = tx.send(Msg::Done(i, Box::new(r)));
                }
            });
        }
        drop(tx);
        for msg in rx {
            match msg {
                Msg::Start(i) => progress(Event::Start {
                    index: i,
                    total: n,
                    name: &names[i],
                }),
                Msg::Step(i, s) => progress(Event::Step {
                    index: i,
                    step: s,
                    steps,
                }),
                Msg::Done(i, r) => {
                    progress(Event::Done { index: i });
                    results[i] = Some(*r);
                }
                Msg::Failed(why) => failure = Some(why),
            }
        }
    });
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                Err(bad(
                    "verify",
                    failure
                        .clone()
                        .unwrap_or_else(|| "a worker thread stopped early".into()),
                ))
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Memory.
