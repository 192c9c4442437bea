//! `ditmem verify`: hold every precision / recompute / attention variant of a spec against a
//! float64 reference — one step on a fixed batch (loss, gradients per tensor), tolerances by
//! dtype, bitwise recompute twins, and the drift of K optimizer steps.
//!
//! Exit codes: 0 when no variant fails, 4 when one does, 2 for bad input (flags, a reference file
//! that cannot be read or was computed for another spec or other seeds), 3 when the predicted
//! memory or the reference file's size does not fit (checked before any work).

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use ditmem_budget::{Spec, SpecError};
use ditmem_conformance::verify::{
    self, compute_reference_in, parse_variants, plan_memory, Event, MemoryPlan, Reference, Report,
    TensorError, Tolerance, Variant, VariantReport, VerifyError, VerifyOptions,
};
use ditmem_engine::EngineError;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::args::SpecArgs;
use crate::conditions::Conditions;
use crate::plot::{line_chart, LineChart, Series};
use crate::render::{fmt_count, recipe_line, spec_line, Column, Table};
use crate::CliError;

/// Exit code when at least one variant fails.
pub(crate) const EXIT_FAILED: u8 = 4;

#[derive(Debug, Clone, Args)]
pub(crate) struct VerifyArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Variants, comma-separated `precision/recompute/attention` (`*` or a missing part = every
    /// default value; block lists as `blocks:0+2`), e.g.
    /// `bf16-mixed/all/materialized,fp32/none/memory-efficient`. Default: every precision ×
    /// {none, all, attention-only} × {materialized, memory-efficient}, narrowed by --precision,
    /// --recompute and --attention when given.
    #[arg(long, value_name = "LIST")]
    pub variants: Option<String>,
    /// Optimizer steps of the drift run (0: one-step comparison only) [default: 50, or the
    /// stored reference's]
    #[arg(long, value_parser = crate::flags::count_u32, allow_hyphen_values = true)]
    pub steps: Option<u32>,
    /// Seed of the initial weights [default: 0, or the stored reference's]
    #[arg(long, value_parser = crate::flags::seed_u64, allow_hyphen_values = true)]
    pub seed: Option<u64>,
    /// Seed of the synthetic data [default: 1, or the stored reference's]
    #[arg(long, value_parser = crate::flags::seed_u64, allow_hyphen_values = true)]
    pub data_seed: Option<u64>,
    /// Learning rate of the drift run [default: 1e-3, or the stored reference's]
    #[arg(long, value_parser = crate::flags::learning_rate, allow_hyphen_values = true)]
    pub lr: Option<f64>,
    /// Variants computed at once [default: the available cores, fewer when their predicted
    /// memory does not fit]
    #[arg(long, value_parser = crate::flags::positive_usize, allow_hyphen_values = true)]
    pub jobs: Option<usize>,
    /// Compare against this stored reference (.safetensors) instead of computing it.
    #[arg(long, value_name = "FILE")]
    pub reference: Option<PathBuf>,
    /// Store the reference to this file (safetensors, f64: the one-step gradients and the
    /// weights — and EMA weights — after each of the K drift steps, the losses, spec and seeds):
    /// 8 B × trained parameters × (K + 2), (2K + 3) with an EMA. It is written as the reference
    /// runs and read one tensor at a time, never held in memory.
    #[arg(long, value_name = "FILE")]
    pub save_reference: Option<PathBuf>,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG of the parameter drift over steps (log y) to this file.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Also print the gradient error of every tensor for each variant.
    #[arg(long)]
    pub tensors: bool,
    /// Run even when the predicted peak exceeds MemAvailable (never past the address-space or
    /// cgroup limit).
    #[arg(long)]
    pub force: bool,
}

/// The small model verify runs by default: seconds per variant on two cores.
/// DiT block structure at depth 2, hidden 64, 4 heads, patch 2, 128×128 images (16×16 latents,
/// 64 tokens), batch 4, 10 classes, no EMA.
pub(crate) fn default_spec() -> Spec {
    Spec::small()
}

/// What `--json` prints.
#[derive(Debug, Serialize)]
struct VerifyJson<'a> {
    /// `computed` or the path of the stored reference.
    reference_source: String,
    /// The predicted peak of this run and its parts (bytes), and the reference file's size.
    memory: &'a MemoryPlan,
    /// What the run held at most, measured: to hold `memory.peak` against.
    measured: Measured,
    conditions: Conditions,
    elapsed_s: f64,
    #[serde(flatten)]
    report: &'a Report,
}

/// The process's own peaks at the end of the run.
#[derive(Debug, Serialize)]
struct Measured {
    /// Highest live heap bytes of the whole process (the counting allocator).
    heap_peak_bytes: u64,
    /// Live heap bytes when `verify` began (the arguments, the process's own): `memory.peak`
    /// predicts `heap_peak_bytes − heap_before_bytes`, what the run adds.
    heap_before_bytes: u64,
    /// The kernel's peak resident set (`VmHWM` of /proc/self/status): the heap's pages
    /// touched, the binary and the threads' stacks; None where it cannot be read.
    max_rss_bytes: Option<u64>,
}

/// `VmHWM` of /proc/self/status in bytes.
fn max_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

fn invalid(field: &str, e: impl std::fmt::Display) -> CliError {
    CliError::Spec(SpecError::invalid(field, e.to_string()))
}

fn map_err(e: VerifyError, field: &str) -> CliError {
    match e {
        VerifyError::Engine(EngineError::Spec(s)) => CliError::Spec(s),
        VerifyError::Engine(EngineError::BadInput { what, why }) => {
            CliError::Spec(SpecError::invalid(what, why))
        }
        VerifyError::Engine(e @ EngineError::Unsupported { .. }) => invalid("spec", e),
        VerifyError::Engine(e) => CliError::Other(anyhow::Error::new(e)),
        e @ VerifyError::Variant { .. } => invalid("--variants", e),
        e @ (VerifyError::Reference { .. } | VerifyError::Mismatch { .. }) => {
            invalid("--reference", e)
        }
        e @ VerifyError::BadInput { .. } => invalid(field, e),
    }
}

/// The variants to verify: `--variants`, or the default set narrowed by the spec flags.
fn variants(args: &VerifyArgs) -> Result<Vec<Variant>, CliError> {
    let text = match &args.variants {
        Some(v) => v.clone(),
        None => {
            let s = &args.spec;
            format!(
                "{}/{}/{}",
                s.precision.as_deref().unwrap_or("*"),
                s.recompute
                    .as_deref()
                    .map(|r| r.replace(',', "+"))
                    .unwrap_or_else(|| "*".into()),
                s.attention.as_deref().unwrap_or("*")
            )
        }
    };
    parse_variants(&text).map_err(|e| map_err(e, "--variants"))
}

/// The resource guard of `verify`: the engine's prediction of its own peak ([`plan_memory`]: the
/// budget's estimate of the steps it runs at once plus what verification keeps). Runs `jobs`
/// variants at once when that fits, fewer otherwise, and refuses (exit 3) when even one does not.
fn guard(
    base: &Spec,
    variants: &[Variant],
    opts: &VerifyOptions,
    jobs: usize,
    stored: bool,
    force: bool,
) -> Result<MemoryPlan, CliError> {
    let mut jobs = jobs.clamp(1, variants.len().max(1));
    loop {
        let plan =
            plan_memory(base, variants, opts, jobs, !stored).map_err(|e| map_err(e, "spec"))?;
        let what = format!(
            "verify ({} variant{} at once{})",
            plan.jobs,
            if plan.jobs == 1 { "" } else { "s" },
            if stored {
                ""
            } else {
                " after the fp64 reference"
            }
        );
        match crate::guard::check(&what, plan.peak, force) {
            Ok(()) => return Ok(plan),
            // What could not run and why, and what would: verify's own levers (its reference is
            // fp64 without recompute whatever the recipe says, so the guard's recompute lever
            // does not apply to it).
            Err(CliError::Refused(m)) if jobs == 1 => {
                let mut levers = Vec::new();
                if opts.steps > 1 {
                    // One drift step keeps no optimizer state (docs/verify.md, Memory).
                    let one = VerifyOptions {
                        steps: 1,
                        ..opts.clone()
                    };
                    let p = plan_memory(base, variants, &one, 1, !stored)
                        .map_err(|e| map_err(e, "spec"))?;
                    levers.push(format!(
                        "`--steps 1` ({}: no AdamW moments kept)",
                        ditmem_budget::fmt_bytes(p.peak)
                    ));
                }
                if base.model.depth > 1 {
                    levers.push(format!(
                        "`--depth 1` (the model's real width with one block of each kind of its \
                         {})",
                        base.model.depth
                    ));
                }
                levers.push(
                    "a lower `--resolution` or `--batch` (the activations; weights and \
                     gradients, 16 B per parameter in the fp64 reference, stay)"
                        .to_string(),
                );
                return Err(CliError::Refused(format!(
                    "{m}; for verify: {} (docs/verify.md)",
                    levers.join(", ")
                )));
            }
            Err(e) if jobs == 1 => return Err(e),
            Err(_) => jobs -= 1,
        }
    }
}

/// Test hook, not a user setting: when set, `DITMEM_TEST_FREE_DISK=<bytes>` stands for the free
/// space of the file system verify writes its reference to, so the CLI tests can exercise the
/// refusal without filling a disk.
pub(crate) const FREE_DISK_ENV: &str = "DITMEM_TEST_FREE_DISK";

/// Bytes an unprivileged process may still write on the file system of `dir` (statvfs:
/// f_bavail × f_frsize); `None` when it cannot be read.
fn free_disk(dir: &Path) -> Option<u64> {
    if let Some(v) = std::env::var_os(FREE_DISK_ENV) {
        return v.to_str()?.trim().parse().ok();
    }
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is plain old data; an all-zero value is valid and the call overwrites it.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path that outlives the call; `st` is ours to write.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Refuse (exit 3) a reference file of `need` bytes that the file system of `dir` cannot hold,
/// before any work: the file is never written in part.
fn check_disk(dir: &Path, need: u64) -> Result<(), CliError> {
    match free_disk(dir) {
        Some(free) if need > free => Err(CliError::Refused(format!(
            "the reference file needs {} ({need} B) but the file system of '{}' has {} ({free} B) \
             free; free space there, save it elsewhere (--save-reference) or lower --steps",
            ditmem_budget::fmt_bytes(need),
            dir.display(),
            ditmem_budget::fmt_bytes(free),
        ))),
        _ => Ok(()),
    }
}

/// A progress bar on stderr, only when it is a terminal (`show` is false with --json).
fn bar(len: u64, show: bool, prefix: &str) -> ProgressBar {
    if !show || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template(&format!("{prefix} [{{bar:30}}] {{pos}}/{{len}} {{msg}}"))
            .expect("a valid template")
            .progress_chars("=> "),
    );
    b
}

pub(crate) fn run(
    args: VerifyArgs,
    alloc: &'static ditmem_engine::CountingAlloc,
) -> Result<(), CliError> {
    let started = Instant::now();
    let heap_before = alloc.live();
    crate::output::check_outputs(&[
        ("--save-reference", args.save_reference.as_deref()),
        ("--plot", args.plot.as_deref()),
    ])?;
    let jobs = worker_jobs(&args)?;
    let mut base = args.spec.to_spec_or(default_spec)?;
    if let Some(cpu) = &mut base.cpu {
        // verify holds numerics, not memory: its variants run on the pool set up above, whatever
        // thread count a spec file names (the bf16 path it names still applies).
        cpu.threads = ditmem_engine::host::threads();
    }
    let variants = variants(&args)?;
    let stored = open_stored(args.reference.as_deref())?;
    let opts = options(&args, stored.as_ref())?;
    let plan = guard(&base, &variants, &opts, jobs, stored.is_some(), args.force)?;
    let jobs = plan.jobs;
    // The reference file is written where it will be kept (a rename at the end) or in the
    // temporary folder, and copied when a stored one is saved again: its file system must hold it.
    let ref_dir = match &args.save_reference {
        Some(p) => crate::output::folder_of(p).to_path_buf(),
        None => std::env::temp_dir(),
    };
    match (&stored, &args.save_reference) {
        (Some(r), Some(_)) => check_disk(&ref_dir, r.file_bytes())?,
        (Some(_), None) => {}
        (None, _) => check_disk(
            &ref_dir,
            verify::reference_file_size(&base, &opts).map_err(|e| map_err(e, "spec"))?,
        )?,
    }
    let show = !args.json;
    let (mut reference, source) = fp64_reference(&args, &base, &opts, stored, &ref_dir, show)?;
    save_reference(&args, &mut reference)?;
    let n = variants.len() as u64;
    let b = bar(n * (u64::from(opts.steps) + 1), show, "variants");
    let mut done = 0;
    let report = verify::verify(
        &base,
        &variants,
        &opts,
        &reference,
        jobs,
        &mut |e| match e {
            Event::Start { name, .. } => b.set_message(name.to_string()),
            Event::Step { .. } => b.inc(1),
            Event::Done { .. } => {
                done += 1;
                b.inc(1);
                b.set_message(format!("{done}/{n} variants done"));
            }
        },
    )
    .map_err(|e| map_err(e, "verify"))?;
    b.finish_and_clear();
    let conditions = Conditions::capture(&reference.spec, 0, opts.steps);
    let elapsed = started.elapsed().as_secs_f64();
    if let Some(path) = &args.plot {
        let svg = drift_chart(&report)?;
        crate::output::write_output("--plot", path, svg.as_bytes())?;
    }
    if args.json {
        crate::output::print_json(&VerifyJson {
            reference_source: source,
            memory: &plan,
            measured: Measured {
                heap_peak_bytes: alloc.peak(),
                heap_before_bytes: heap_before,
                max_rss_bytes: max_rss(),
            },
            conditions,
            elapsed_s: elapsed,
            report: &report,
        })?;
    } else {
        crate::output::say(&render(&View {
            report: &report,
            base: &base,
            source: &source,
            conditions: &conditions,
            elapsed,
            plan: &plan,
            tensors: args.tensors,
        }))?;
    }
    if !report.ok() {
        crate::output::note(&format!(
            "ditmem: verification failed: {} of {} variants fail\n",
            report.failed,
            report.variants.len()
        ));
        std::process::exit(i32::from(EXIT_FAILED));
    }
    Ok(())
}

/// The fp64 reference and where it came from: the stored one (checked against the spec and
/// options) or one computed now (with a progress bar when `show`).
fn fp64_reference(
    args: &VerifyArgs,
    base: &Spec,
    opts: &VerifyOptions,
    stored: Option<Reference>,
    ref_dir: &Path,
    show: bool,
) -> Result<(Reference, String), CliError> {
    Ok(match stored {
        Some(r) => {
            r.check_matches(base, opts)
                .map_err(|e| map_err(e, "--reference"))?;
            let path = args
                .reference
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            (r, path)
        }
        None => {
            let b = bar(u64::from(opts.steps), show, "fp64 reference");
            let mut tick = |s: u32| b.set_position(u64::from(s));
            // Kept: a named file where it will lie (a rename at the end); otherwise a file
            // without a name, freed however the process ends.
            let r = match &args.save_reference {
                Some(_) => compute_reference_in(ref_dir, base, opts, &mut tick),
                None => verify::compute_reference(base, opts, &mut tick),
            }
            .map_err(|e| map_err(e, "spec"))?;
            b.finish_and_clear();
            (r, "computed".to_string())
        }
    })
}

/// The variants' worker count (`--jobs`, else the cores), with the process guard's check.
fn worker_jobs(args: &VerifyArgs) -> Result<usize, CliError> {
    let jobs = args
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if jobs == 0 {
        return Err(invalid("--jobs", "is 0; allowed: at least 1"));
    }
    if jobs > 1 && std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // Parallelism across variants instead of inside the gemms: candle's threaded gemm on
        // 64-wide matrices costs more in synchronisation than it saves (4× slower measured with
        // two variants at once on two cores). Set before any thread exists (reading the spec's
        // CPU starts rayon's pool); candle reads it at each matmul.
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
    // Before the pools start (reading the spec's CPU starts rayon's) and the variants' workers.
    crate::guard::check_process("verify", jobs as u64)?;
    Ok(jobs)
}

/// The stored reference `--reference` names, if any: a regular file only.
fn open_stored(path: Option<&Path>) -> Result<Option<Reference>, CliError> {
    Ok(match path {
        Some(path) => {
            // A regular file only (a FIFO would block); read one tensor at a time.
            match std::fs::metadata(path) {
                Ok(m) if m.is_file() => {}
                Ok(_) => {
                    return Err(invalid(
                        "--reference",
                        format!(
                            "'{}' is not a regular file",
                            crate::flags::show(&path.display().to_string())
                        ),
                    ))
                }
                Err(e) => {
                    return Err(invalid(
                        "--reference",
                        format!("'{}': {e}", crate::flags::show(&path.display().to_string())),
                    ))
                }
            }
            Some(
                Reference::open(path)
                    .map_err(|e| invalid("--reference", format!("'{}': {e}", path.display())))?,
            )
        }
        None => None,
    })
}

/// The run's options: the flags, else the stored reference's, else the defaults; checked.
fn options(args: &VerifyArgs, stored: Option<&Reference>) -> Result<VerifyOptions, CliError> {
    let defaults = stored.map(|r| r.options.clone()).unwrap_or_default();
    let opts = VerifyOptions {
        seed: args.seed.unwrap_or(defaults.seed),
        data_seed: args.data_seed.unwrap_or(defaults.data_seed),
        lr: args.lr.unwrap_or(defaults.lr),
        weight_decay: defaults.weight_decay,
        steps: args.steps.unwrap_or(defaults.steps),
    };
    let (lo, hi) = crate::flags::LEARNING_RATES;
    if !(lo..=hi).contains(&opts.lr) {
        // A stored reference's rate (the flag's own range is checked as it is parsed).
        return Err(invalid(
            "--lr",
            format!(
                "{} is out of range; allowed: a number from 1e-8 to 1",
                crate::flags::fmt_float(opts.lr)
            ),
        ));
    }
    if args.plot.is_some() && opts.steps == 0 {
        return Err(invalid(
            "--plot",
            "needs a drift run; allowed: --steps ≥ 1 with --plot",
        ));
    }
    Ok(opts)
}

/// `--save-reference`: a copy of the stored file, or the computed reference persisted.
fn save_reference(args: &VerifyArgs, reference: &mut Reference) -> Result<(), CliError> {
    if let Some(path) = &args.save_reference {
        if let Some(from) = &args.reference {
            if let Err(e) = std::fs::copy(from, path) {
                // Never leave a half file behind.
                let _ = std::fs::remove_file(path);
                return Err(CliError::Other(anyhow::Error::new(e).context(format!(
                    "cannot copy the reference to '{}'",
                    path.display()
                ))));
            }
        } else {
            crate::output::check_outputs(&[("--save-reference", Some(path.as_path()))])?;
            reference
                .persist(path)
                .map_err(|e| CliError::Other(anyhow::Error::new(e)))?;
        }
    }
    Ok(())
}

/// Scientific notation with 2 digits; "0" for exact zeros, "-" for absent values.
fn sci(x: Option<f64>) -> String {
    match x {
        None => "-".into(),
        Some(0.0) => "0".into(),
        Some(v) if v.is_nan() => "NaN".into(),
        Some(v) if v.is_infinite() => "inf".into(),
        Some(v) => format!("{v:.2e}"),
    }
}

/// What the text report is made of: the report, the spec it verified, where the reference came
/// from, the run's conditions, its time in seconds, its memory plan, and whether to list every
/// tensor's error.
struct View<'a> {
    report: &'a Report,
    base: &'a Spec,
    source: &'a str,
    conditions: &'a Conditions,
    elapsed: f64,
    plan: &'a MemoryPlan,
    tensors: bool,
}

/// What `verify` prints: the run's lines, the tolerances, one row per variant, why the flagged
/// ones are flagged, the per-tensor errors with `tensors`, and the count of each verdict.
fn render(view: &View<'_>) -> String {
    let r = view.report;
    let mut o = run_lines(view);
    o.push_str(&tolerance_section(r));
    o.push_str(&variants_table(r).render());
    o.push_str(
        "  errors are relative: loss |ℓ−ℓ₀|/|ℓ₀|; gradients ‖g−g₀‖/‖g₀‖ per tensor; drift ‖θ−θ₀‖/‖θ₀‖ after \
         1 and K steps; drift margin: ‖θ_K−θ₀,K‖/‖θ₀,K−θ₀,0‖ (the share of the distance trained) / drift tol; \
         loss drift after K steps\n",
    );
    let flagged: Vec<_> = r
        .variants
        .iter()
        .filter(|v| !v.reasons.is_empty())
        .collect();
    if !flagged.is_empty() {
        o.push_str("\nwhy:\n");
        for v in flagged {
            for why in &v.reasons {
                o.push_str(&format!("  {} [{}]: {why}\n", v.name, v.verdict));
            }
        }
    }
    if view.tensors {
        for v in &r.variants {
            o.push_str(&format!("\n{} — gradient error per tensor\n", v.name));
            let t = Table::of(
                &[
                    ("tensor", &|e: &&TensorError| e.name.clone()),
                    ("‖g−g₀‖/‖g₀‖", &|e: &&TensorError| {
                        sci(Some(e.rel_err))
                    }),
                ],
                &v.per_tensor,
            );
            o.push_str(&t.render());
        }
    }
    o.push_str(&format!(
        "\n{} variants: {} pass, {} warn, {} fail{}\n",
        r.variants.len(),
        r.passed,
        r.warned,
        r.failed,
        if r.skipped > 0 {
            format!(", {} skipped", r.skipped)
        } else {
            String::new()
        }
    ));
    o
}

/// The run's lines: the spec and base recipe, the reference, the conditions and the memory plan.
fn run_lines(v: &View<'_>) -> String {
    let View {
        report: r,
        base,
        source,
        conditions,
        elapsed,
        plan,
        ..
    } = *v;
    let mut o = String::new();
    let params = ditmem_engine::trainable_count(base).unwrap_or(0);
    o.push_str(&format!("ditmem verify — {}\n", spec_line(base)));
    o.push_str(&format!(
        "base recipe: {} ({} trained parameters)\n",
        recipe_line(base),
        fmt_count(params)
    ));
    let opt = &r.options;
    o.push_str(&format!(
        "reference: {} ({source}), loss {:.6}; seed {}, data seed {}, {} drift steps of {} at lr {}\n",
        r.reference_variant,
        r.reference_loss,
        opt.seed,
        opt.data_seed,
        opt.steps,
        base.recipe.optimizer.name(),
        opt.lr
    ));
    o.push_str(&format!(
        "conditions: {}; {} variants on {} worker threads in {:.1} s\n\n",
        conditions.line(),
        r.variants.len(),
        plan.jobs,
        elapsed
    ));
    o.push_str(&format!(
        "memory: predicted peak {} = max(fp64 reference step {}, {} variant step(s) {}) + {} kept per variant + {} report; reference file {} on disk\n\n",
        ditmem_budget::fmt_bytes(plan.peak),
        ditmem_budget::fmt_bytes(plan.reference_step),
        plan.jobs,
        ditmem_budget::fmt_bytes(plan.variant_steps),
        ditmem_budget::fmt_bytes(plan.keep_per_job),
        ditmem_budget::fmt_bytes(plan.report),
        ditmem_budget::fmt_bytes(plan.reference_file),
    ));
    o
}

/// How the tolerances are set, one row per precision policy, and the verdict's rule.
fn tolerance_section(r: &Report) -> String {
    let g = &r.growth;
    let mut o = format!(
        "tolerances: u(compute dtype) · √(κ_P²·P + κ_n²·n + κ_s²·S²) with P = {} chained roundings ({} for the loss), \
         n = {} the longest reduction, S = {:.1} the attention-score bound of the reference's first step; \
         each κ = 2 × the largest measured on correct runs (5 seeds; batch 2–8, width 64–384, scores ×1–32); \
         drift: κ_d × the gradient tolerance, as a share of the distance the reference trained\n",
        g.gradient_chain, g.forward_chain, g.reduction, g.score_bound
    );
    let columns: [Column<&Tolerance>; 7] = [
        ("policy", &|t| t.precision.to_string()),
        ("dtype", &|t| t.dtype.to_string()),
        ("u", &|t| {
            format!("2^{}", t.unit_roundoff.log2().round() as i32)
        }),
        ("growth", &|t| format!("{:.1}", t.growth)),
        ("gradient tol", &|t| sci(Some(t.grad))),
        ("loss tol", &|t| sci(Some(t.loss))),
        ("drift tol", &|t| sci(Some(t.drift))),
    ];
    o.push_str(&Table::of(&columns, &r.tolerances).render());
    o.push_str(&format!(
        "verdict: pass ≤ tol < warn ≤ {}×tol < fail (margin = error / tol), for gradients, loss and drift; \
         recompute twins bitwise; drift also warns above {} × K × (drift after step 1); an EMA fails beyond its weights' drift\n\n",
        r.warn_factor, r.drift_growth_factor
    ));
    o
}

/// One row per variant: its verdict, errors, margins, drift and recompute twins.
fn variants_table(r: &Report) -> Table {
    let drift_final = format!("drift@{}", r.options.steps);
    let columns: [Column<&VariantReport>; 15] = [
        ("variant", &|v| v.name.clone()),
        ("verdict", &|v| v.verdict.name().to_uppercase()),
        ("loss err", &|v| sci(v.loss_rel_err)),
        ("grad err max", &|v| sci(v.grad_rel_err_max)),
        ("median", &|v| sci(v.grad_rel_err_median)),
        ("worst tensor", &|v| {
            v.worst_tensor.clone().unwrap_or_else(|| "-".into())
        }),
        ("cosine", &|v| {
            v.cosine.map_or("-".into(), |c| format!("{:.6}", c))
        }),
        ("non-finite", &|v| {
            v.nonfinite_share.map_or("-".into(), |s| {
                if s == 0.0 {
                    "0".into()
                } else {
                    format!("{:.2} %", 100.0 * s)
                }
            })
        }),
        ("tol", &|v| sci(Some(v.tolerance_grad))),
        ("margin", &|v| {
            v.grad_margin.map_or("-".into(), |m| format!("{m:.3}"))
        }),
        ("drift margin", &|v| {
            v.drift_margin.map_or("-".into(), |m| format!("{m:.3}"))
        }),
        ("drift@1", &|v| sci(v.drift_one_step)),
        (&drift_final, &|v| sci(v.drift_final)),
        ("loss drift", &|v| sci(v.loss_drift_final)),
        ("twin", &|v| {
            let twin = v
                .twins
                .iter()
                .map(|c| if c.ok { "= bitwise" } else { "≠ bitwise" }.to_string())
                .collect::<Vec<_>>()
                .join(", ");
            if twin.is_empty() {
                "-".into()
            } else {
                twin
            }
        }),
    ];
    Table::of(&columns, &r.variants)
}

/// Parameter drift over steps, one line per distinct trajectory (recompute twins that matched
/// bitwise share their twin's line), log y. Exact zeros (bitwise twins of the reference) cannot
/// be drawn on a log axis and are listed in the title instead.
fn drift_chart(r: &Report) -> Result<String, CliError> {
    let mut series: Vec<Series> = Vec::new();
    let mut names: Vec<(String, Vec<String>)> = Vec::new();
    let mut zero: Vec<String> = Vec::new();
    for v in &r.variants {
        let Some(d) = &v.drift else { continue };
        if let Some(twin) = v.twins.iter().find(|c| c.kind == "bitwise" && c.ok) {
            if let Some(entry) = names.iter_mut().find(|(n, _)| *n == twin.twin) {
                entry.1.push(v.recompute.clone());
                continue;
            }
        }
        if d.param_rel.iter().all(|&x| x == 0.0) {
            zero.push(v.name.clone());
            continue;
        }
        names.push((v.name.clone(), vec![v.recompute.clone()]));
        series.push(Series {
            name: v.name.clone(),
            points: d
                .param_rel
                .iter()
                .enumerate()
                .map(|(i, &y)| (i as f64, y))
                .collect(),
            markers: false,
            line: true,
        });
    }
    for (s, (_, recomputes)) in series.iter_mut().zip(&names) {
        if recomputes.len() > 1 {
            let (p, rest) = s.name.split_once('/').unwrap_or((&s.name, ""));
            let attn = rest.rsplit_once('/').map_or(rest, |(_, a)| a);
            s.name = format!("{p}/{{{}}}/{attn}", recomputes.join(","));
        }
    }
    let mut title = format!(
        "parameter drift vs the fp64 reference ({} steps, lr {})",
        r.options.steps, r.options.lr
    );
    if !zero.is_empty() {
        title.push_str(&format!("; identical to it: {}", zero.len()));
    }
    let chart = LineChart {
        title,
        x_desc: "optimizer step".into(),
        y_desc: "‖θ − θ_ref‖ / ‖θ_ref‖".into(),
        series,
        log_y: true,
        ..LineChart::default()
    };
    Ok(line_chart(&chart, (1000, 640))?)
}
