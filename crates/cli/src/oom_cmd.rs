//! `ditmem oom`: read a PyTorch out-of-memory message, say what it means (true shortage or
//! fragmentation, the card's capacity as CUDA sees it, memory outside PyTorch) and, given the
//! spec flags of the run, rank the levers that make its step fit that card.

use std::io::{IsTerminal, Read};
use std::path::PathBuf;

use clap::Args;
use ditmem_budget::oom::{
    agreement, format_size, rank_levers, Agreement, Cause, Diagnosis, Lever, LeverOptions,
    LeverReport, OomMessage, MAX_MESSAGE_BYTES,
};
use ditmem_budget::{fmt_bytes, gpu, DeviceProfile, SpecError, DEFAULT_HEADROOM};
use serde::Serialize;

use crate::args::SpecArgs;
use crate::CliError;

/// Widest line of the report.
const WIDTH: usize = 100;

#[derive(Debug, Clone, Args)]
pub(crate) struct OomArgs {
    /// The out-of-memory message (quote it), or '-' to read stdin; without it and without
    /// --file, stdin when it is not a terminal. A pasted log is fine: the first message in it is
    /// read (at most 1 MiB).
    #[arg(value_name = "MESSAGE", conflicts_with = "file")]
    pub message: Option<String>,
    /// Read the message from this file (a regular file of at most 1 MiB).
    #[arg(long, value_name = "PATH")]
    pub file: Option<PathBuf>,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Levers that change what is trained, comma-separated: lora, quant (an NF4 base under
    /// LoRA), bf16-pure, precision, or all. Recompute, microbatch, expandable segments, cached
    /// latents / text embeddings, 8-bit AdamW and (with --ranks > 1) ZeRO are always tried.
    #[arg(long, value_delimiter = ',', value_name = "LEVERS")]
    pub allow: Vec<String>,
    /// Share of the capacity kept free for what the budget does not model (as `plan`).
    #[arg(long, default_value_t = DEFAULT_HEADROOM, value_name = "FRACTION",
          value_parser = crate::flags::headroom, allow_hyphen_values = true)]
    pub headroom: f64,
    /// Print JSON instead of the report.
    #[arg(long)]
    pub json: bool,
}

/// Everything `ditmem oom` says, as `--json` prints it.
#[derive(Debug, Serialize)]
pub(crate) struct OomReport {
    pub message: OomMessage,
    pub diagnosis: Diagnosis,
    /// The catalog card the levers were evaluated on (`--gpu`, else the nearest match).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// The spec as given and the levers, when spec flags were given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub levers: Option<LeverReport>,
    /// The spec's predicted allocated peak against the message's allocated + requested.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agreement: Option<Agreement>,
}

/// The message's text: the argument, `--file`, or stdin (`-`, or none given and stdin not a
/// terminal), with the field an error names.
fn read_message(args: &OomArgs) -> Result<(String, &'static str), SpecError> {
    if let Some(path) = &args.file {
        let bytes = crate::input::read_capped("--file", path, MAX_MESSAGE_BYTES as u64)?;
        return Ok((String::from_utf8_lossy(&bytes).into_owned(), "--file"));
    }
    match args.message.as_deref() {
        Some("-") => {}
        Some(m) => return Ok((m.to_string(), "MESSAGE")),
        None if std::io::stdin().is_terminal() => {
            return Err(SpecError::invalid(
                "MESSAGE",
                "none given; allowed: the message as an argument (quoted), '-' or a pipe for \
                 stdin, or --file PATH",
            ))
        }
        None => {}
    }
    let mut bytes = Vec::new();
    std::io::stdin()
        .lock()
        .take(MAX_MESSAGE_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| SpecError::invalid("stdin", format!("cannot be read ({e}); allowed: text")))?;
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(SpecError::invalid(
            "stdin",
            format!("is larger than {MAX_MESSAGE_BYTES} bytes; allowed: at most {MAX_MESSAGE_BYTES} bytes"),
        ));
    }
    Ok((String::from_utf8_lossy(&bytes).into_owned(), "stdin"))
}

/// Whether the flags describe a run (a model), as opposed to only a card.
fn spec_given(s: &SpecArgs) -> bool {
    s.preset.is_some() || s.config.is_some() || s.model.is_some()
}

pub(crate) fn run(args: OomArgs) -> Result<(), CliError> {
    // 8-bit AdamW is always tried; `8bit` is accepted for symmetry with `plan --allow`.
    let allow = crate::plan_cmd::parse_allow(&args.allow)?;
    let (text, field) = read_message(&args)?;
    let msg = OomMessage::parse(&text).map_err(|e| SpecError::invalid(field, e.to_string()))?;
    let diagnosis = msg.diagnosis();
    let mut report = OomReport {
        message: msg,
        diagnosis,
        gpu: None,
        levers: None,
        agreement: None,
    };
    let named = args.spec.gpu.clone();
    if spec_given(&args.spec) {
        let mut spec = args.spec.to_gpu_spec()?;
        if !matches!(
            spec.runtime,
            ditmem_budget::Runtime::Pytorch {
                device: ditmem_budget::TorchDevice::Cuda,
                ..
            }
        ) {
            return Err(SpecError::invalid(
                "runtime",
                format!(
                    "{} is not a CUDA runtime; allowed: pytorch:cuda (an out-of-memory message \
                     comes from the CUDA caching allocator)",
                    spec.runtime
                ),
            )
            .into());
        }
        let card = match &named {
            Some(n) => gpu::lookup(n).map_err(|e| SpecError::invalid("--gpu", e.to_string()))?,
            None => gpu::lookup(report.diagnosis.gpu.nearest)
                .map_err(|e| SpecError::invalid("--gpu", e.to_string()))?,
        };
        spec.cuda.get_or_insert_with(Default::default).gpu = Some(card.name.to_string());
        spec.validate()?;
        let budget = report
            .diagnosis
            .total_bytes
            .saturating_sub(report.diagnosis.other_processes_bytes);
        let levers = rank_levers(
            &spec,
            &LeverOptions {
                budget_bytes: Some(budget),
                headroom: args.headroom,
                allow,
                combine: true,
            },
            &DeviceProfile::for_gpu(card),
        )?;
        report.agreement = Some(agreement(&report.message, &levers.base));
        report.gpu = Some(card.name.to_string());
        report.levers = Some(levers);
    } else if let Some(n) = &named {
        let card = gpu::lookup(n).map_err(|e| SpecError::invalid("--gpu", e.to_string()))?;
        report.gpu = Some(card.name.to_string());
    }
    if args.json {
        crate::output::print_json(&report)?;
    } else {
        say(&render(&report))?;
    }
    Ok(())
}

/// Print to stdout; a closed pipe ends the output quietly.
fn say(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("writing to stdout"))
        }
        _ => Ok(()),
    }
}

/// `text` broken at spaces into lines of at most `width` characters (a longer word is cut).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let width = width.max(8);
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        let mut word: String = word.to_string();
        loop {
            let (n, w) = (line.chars().count(), word.chars().count());
            let extra = if n == 0 { w } else { n + 1 + w };
            if extra <= width {
                if n > 0 {
                    line.push(' ');
                }
                line.push_str(&word);
                break;
            }
            if n > 0 {
                lines.push(std::mem::take(&mut line));
                continue;
            }
            // A word longer than a line: cut it.
            let head: String = word.chars().take(width).collect();
            word = word.chars().skip(width).collect();
            lines.push(head);
        }
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}

/// `label` then `text` wrapped under it, indented to the label's width.
fn para(label: &str, text: &str) -> String {
    let indent = label.chars().count();
    let mut out = String::new();
    for (i, l) in wrap(text, WIDTH - indent).into_iter().enumerate() {
        if i == 0 {
            out.push_str(label);
        } else {
            out.push_str(&" ".repeat(indent));
        }
        out.push_str(&l);
        out.push('\n');
    }
    out
}

/// A figure of the message, as PyTorch printed it.
fn pt(b: u64) -> String {
    format_size(b)
}

fn opt_bytes(b: Option<u64>) -> String {
    b.map_or("not given".into(), pt)
}

/// PyTorch holds at least this share of the card at the failure (allocated + requested): a
/// fragmentation there is a shortage in practice.
const FULL: f64 = 0.9;

fn full(d: &Diagnosis) -> bool {
    d.needed_bytes as f64 >= FULL * d.total_bytes.saturating_sub(d.other_processes_bytes) as f64
}

fn cause_text(d: &Diagnosis, m: &OomMessage) -> String {
    let env = if m.backend == "HIP" {
        "PYTORCH_HIP_ALLOC_CONF"
    } else {
        "PYTORCH_CUDA_ALLOC_CONF"
    };
    let pieces = format!(
        "free {} + reserved-but-unallocated {} = {}",
        opt_bytes(d.free_bytes),
        pt(d.reserved_unallocated_bytes),
        pt(d.available_bytes)
    );
    match d.cause {
        Cause::Fragmentation if full(d) => format!(
            "FRAGMENTATION — the request ({}) is within {pieces}, but no free piece is that large. \
             Yet PyTorch already holds {:.0} % of the card: {env}=expandable_segments:True may get \
             past this allocation, but the step likely needs more than the card has (a shortage \
             in practice).",
            pt(d.requested_bytes),
            100.0 * d.needed_bytes as f64 / d.total_bytes.max(1) as f64,
        ),
        Cause::Fragmentation => format!(
            "FRAGMENTATION — the request ({}) is within {pieces}, but no free piece is that large: \
             the cached segments' free parts are split. Lever: {env}=expandable_segments:True \
             (segments grow by mapped pages){}.",
            pt(d.requested_bytes),
            if d.free_bytes.unwrap_or(0) >= d.requested_bytes {
                "; free alone covers it, so memory may also have been taken by another process \
                 meanwhile"
            } else {
                ""
            }
        ),
        Cause::Shortage => format!(
            "TRUE SHORTAGE — the request ({}) is more than {pieces}: {} short. The step needs \
             less memory (the levers below), or a larger card.",
            pt(d.requested_bytes),
            pt(d.shortfall_bytes)
        ),
        Cause::Limit => format!(
            "MEMORY-FRACTION LIMIT — the card has room ({pieces}) but the process is capped at {} \
             (torch.cuda.set_per_process_memory_fraction).",
            opt_bytes(m.allowed_bytes)
        ),
    }
}

fn card_text(d: &Diagnosis, m: &OomMessage, used: Option<&str>) -> String {
    let g = &d.gpu;
    let cap = |name: &str| {
        gpu::lookup(name)
            .map(|c| pt(c.capacity_bytes()))
            .unwrap_or_default()
    };
    let mut s = format!("{} as CUDA sees it; ", pt(d.total_bytes));
    if g.within {
        let list: Vec<String> = g
            .candidates
            .iter()
            .map(|n| format!("{n} ({})", cap(n)))
            .collect();
        s.push_str(&format!(
            "catalog match{}: {}",
            if list.len() > 1 { "es" } else { "" },
            list.join(", ")
        ));
    } else {
        s.push_str(&format!(
            "no catalog card within 7 % (nearest {} at {})",
            g.nearest,
            pt(g.nearest_capacity_bytes)
        ));
    }
    if m.backend == "HIP" {
        s.push_str("; a ROCm card: the catalog lists NVIDIA cards only");
    }
    if let Some(u) = used {
        s.push_str(&format!(
            "; levers evaluated on {u}'s context and speed, within the message's capacity"
        ));
        if g.candidates.len() > 1 {
            s.push_str(" (name yours with --gpu)");
        }
    }
    s
}

fn memory_text(d: &Diagnosis, m: &OomMessage) -> String {
    let mut s = format!(
        "allocated by PyTorch {} + reserved but unallocated {} = reserved {}; free {}",
        pt(d.allocated_bytes),
        pt(d.reserved_unallocated_bytes),
        pt(d.reserved_bytes),
        opt_bytes(d.free_bytes)
    );
    match d.non_pytorch_bytes {
        Some(n) => s.push_str(&format!(
            "; this process outside PyTorch's allocator {} (CUDA context, cuBLAS/cuDNN, NCCL, \
             bitsandbytes paged state)",
            pt(n)
        )),
        None => s.push_str("; the message does not say what this process holds outside PyTorch"),
    }
    if let Some(p) = m.self_listed() {
        s.push_str(&format!(
            "; process {} ({}) is taken to be this one (a container's pid)",
            p.pid,
            pt(p.bytes)
        ));
    }
    let others: Vec<String> = m
        .processes
        .iter()
        .filter(|p| Some(**p) != m.self_listed())
        .map(|p| format!("{} ({})", p.pid, pt(p.bytes)))
        .collect();
    if !others.is_empty() {
        s.push_str(&format!(
            "; other processes hold {}: {}",
            pt(d.other_processes_bytes),
            others.join(", ")
        ));
    }
    if let Some(a) = m.allowed_bytes {
        s.push_str(&format!("; capped at {} (memory fraction)", pt(a)));
    }
    if let Some(p) = m.private_pool_bytes {
        s.push_str(&format!("; {} in private pools (CUDA Graphs)", pt(p)));
    }
    s
}

fn pct(x: f64) -> String {
    format!("{:+.1} %", 100.0 * x)
}

fn lever_table(r: &LeverReport) -> String {
    // #, lever, device peak, fits, step, vs spec; the change (and its cost) on the lines below.
    let cells = |i: &str, lever: &str, peak: &str, fits: &str, step: &str, vs: &str| {
        format!("{i:>3}  {lever:<24} {peak:>10}  {fits:<4} {step:>9} {vs:>9}\n")
    };
    let mut out = cells("#", "lever", "peak", "fits", "step", "vs spec");
    out.push_str(&"-".repeat(66));
    out.push('\n');
    let mut line = |i: String, l: &Lever| {
        out.push_str(&cells(
            &i,
            &l.lever.chars().take(24).collect::<String>(),
            &fmt_bytes(l.device_peak_bytes),
            if l.fits { "yes" } else { "no" },
            &ditmem_budget::fmt_secs(l.step_time_s),
            &if l.lever == "as given" {
                "—".to_string()
            } else {
                pct(l.slowdown)
            },
        ));
        if l.lever == "as given" {
            return;
        }
        let text = if l.note.is_empty() {
            l.change.clone()
        } else {
            format!("{} — {}", l.change, l.note)
        };
        for w in wrap(&text, WIDTH - 5) {
            out.push_str("     ");
            out.push_str(&w);
            out.push('\n');
        }
    };
    line("–".into(), &r.base);
    for (i, l) in r.levers.iter().enumerate() {
        line((i + 1).to_string(), l);
    }
    out
}

/// The levers `oom` did not try because they were not allowed, and why they need asking for.
fn not_tried(levers: &[ditmem_budget::levers::NotAllowed]) -> String {
    format!(
        "{} — {} what is trained or its numerics",
        levers
            .iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        if levers.len() == 1 {
            "it changes"
        } else {
            "they change"
        }
    )
}

/// The human report: the meaning first, then the levers.
pub(crate) fn render(r: &OomReport) -> String {
    let (m, d) = (&r.message, &r.diagnosis);
    let mut out = String::new();
    let backend = if m.backend.is_empty() {
        "out of memory".to_string()
    } else {
        format!("{} out of memory", m.backend)
    };
    let mut title = format!("ditmem oom — {backend}");
    if let Some(dev) = m.device {
        title.push_str(&format!(" on GPU {dev}"));
    }
    if let Some(rank) = m.rank {
        title.push_str(&format!(" (rank {rank})"));
    }
    title.push_str(&format!(
        ": tried to allocate {} with {} allocated",
        pt(m.requested_bytes),
        pt(m.allocated_bytes)
    ));
    out.push_str(&para("", &title));
    out.push_str(&para("meaning: ", &cause_text(d, m)));
    out.push_str(&para("memory:  ", &memory_text(d, m)));
    out.push_str(&para("card:    ", &card_text(d, m, r.gpu.as_deref())));
    if m.messages_in_text > 1 {
        out.push_str(&para(
            "note:    ",
            &format!(
                "the text holds {} out-of-memory messages; the first is read",
                m.messages_in_text
            ),
        ));
    }
    let (Some(l), Some(a)) = (&r.levers, &r.agreement) else {
        out.push_str(&para(
            "levers:  ",
            "give the run's spec flags (e.g. --preset flux.1-dev --lora-rank 16 --resolution 1024 \
             --batch 1) to rank the levers that make it fit this card",
        ));
        return out;
    };
    let b = &l.base;
    out.push('\n');
    out.push_str(&para(
        "spec:    ",
        &format!(
            "predicted {} on the device (allocated peak {}) against {} usable ({} capacity{} − \
             {:.0} % headroom): {}",
            fmt_bytes(b.device_peak_bytes),
            fmt_bytes(b.allocated_peak_bytes),
            fmt_bytes(l.usable_bytes.unwrap_or_default()),
            pt(d.total_bytes),
            if d.other_processes_bytes > 0 {
                format!(" − {} other processes", pt(d.other_processes_bytes))
            } else {
                String::new()
            },
            100.0 * l.headroom,
            if b.fits {
                "fits as given"
            } else {
                "does not fit"
            }
        ),
    ));
    out.push_str(&para("vs msg:  ", &a.verdict));
    out.push('\n');
    let fitting = l.levers.iter().filter(|x| x.fits).count();
    out.push_str(&para(
        "",
        &format!(
            "levers on {} ({} of {} fit; ranked: fits first, then the least slowdown; step times \
             from the time model, not measured, ±{:.0} % against fast-DiT's A100 rows):",
            l.gpu,
            fitting,
            l.levers.len(),
            100.0 * ditmem_budget::GPU_TIME_ERROR
        ),
    ));
    out.push_str(&lever_table(l));
    if !l.not_allowed.is_empty() {
        out.push_str(&para("not tried: ", &not_tried(&l.not_allowed)));
    }
    if fitting == 0 {
        out.push_str(&para("nothing fits: ", &nothing_fits(l)));
    }
    out
}

/// What to try when no lever fits: the `--allow` names of the levers not tried, then the
/// workload and the card.
fn nothing_fits(l: &LeverReport) -> String {
    let allow: Vec<&str> = l.not_allowed.iter().map(|n| n.allow).collect();
    let more = if allow.is_empty() {
        String::new()
    } else {
        format!("allow what was not tried (--allow {}), ", allow.join(","))
    };
    format!("{more}lower the resolution or batch, or use a larger card")
}

#[cfg(test)]
mod tests {
    use super::*;
    use ditmem_budget::oom::match_gpu;

    #[test]
    fn wraps_within_the_width() {
        let t = "a ".repeat(200) + &"x".repeat(250);
        for l in wrap(&t, 40) {
            assert!(l.chars().count() <= 40, "{l}");
        }
        assert_eq!(wrap("one two", 40), vec!["one two"]);
    }

    #[test]
    fn allow_lists() {
        assert!(
            crate::plan_cmd::parse_allow(&["lora".into(), "quant".into()])
                .unwrap()
                .quant
        );
        let e = crate::plan_cmd::parse_allow(&["wings".into()]).unwrap_err();
        assert_eq!(e.field(), Some("--allow"));
    }

    #[test]
    fn catalog_match_names_the_24_gb_cards() {
        let m = match_gpu(25_393_868_390);
        assert!(m.candidates.contains(&"rtx-4090"));
    }
}
