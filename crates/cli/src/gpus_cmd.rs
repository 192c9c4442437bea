//! `ditmem gpus`: the GPU catalog as a table (or JSON), every figure with its source.

use clap::Args;
use ditmem_budget::gpu::{self, CapacityBasis, Gpu};
use ditmem_budget::{fmt_bytes, SpecError};

use crate::output;

#[derive(Debug, Clone, Args)]
pub(crate) struct GpusArgs {
    /// Show one GPU (a name or alias, case-insensitive: h100, a100-80gb, 4090, …) with its
    /// sources.
    pub name: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn tflops(v: Option<f64>) -> String {
    v.map_or("-".into(), |f| format!("{:.1}", f / 1e12))
}

fn basis(g: &Gpu) -> &'static str {
    match g.capacity_basis {
        CapacityBasis::Reported { .. } => "reported",
        CapacityBasis::Marketing { .. } => "marketing",
        CapacityBasis::Derived { .. } => "derived",
    }
}

/// The catalog table: capacity in binary units, dense TFLOP/s, bandwidth in GB/s (10⁹ B/s, as
/// the datasheets give it).
pub(crate) fn table(gpus: &[&Gpu]) -> String {
    let mut rows = vec![[
        "gpu",
        "capacity",
        "basis",
        "sm",
        "bf16",
        "fp32",
        "tf32",
        "bf16",
        "fp16",
        "fp8",
        "GB/s",
        "context",
        "cuBLAS ws",
    ]
    .map(String::from)];
    for g in gpus {
        let (ma, mi) = g.compute_capability;
        rows.push([
            g.name.to_string(),
            fmt_bytes(g.capacity_bytes()),
            basis(g).to_string(),
            format!("{ma}.{mi}"),
            if g.dtypes().bf16 { "yes" } else { "no" }.to_string(),
            tflops(Some(g.flops.fp32)),
            tflops(g.flops.tf32),
            tflops(g.flops.bf16),
            tflops(g.flops.fp16),
            tflops(g.flops.fp8),
            format!("{:.0}", g.bandwidth / 1e9),
            fmt_bytes(g.context_bytes),
            fmt_bytes(g.cublas_workspace_bytes()),
        ]);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for (i, r) in rows.iter().enumerate() {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(c, v)| {
                if c == 0 || c == 2 {
                    format!("{v:<w$}", w = widths[c])
                } else {
                    format!("{v:>w$}", w = widths[c])
                }
            })
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
        if i == 0 {
            out.push_str(&"-".repeat(widths.iter().sum::<usize>() + 2 * (widths.len() - 1)));
            out.push('\n');
        }
    }
    out.push_str(
        "\nFLOP/s dense, in TFLOP/s (fp32 without tensor cores; GeForce fp16/bf16 with FP32 \
         accumulate). capacity: total_memory as CUDA reports it (reported) or the marketing \
         figure read as GiB (marketing, an upper bound). context: CUDA context beside the \
         allocator (community figures). cuBLAS ws: default workspace per stream, through the \
         caching allocator. Sources: `ditmem gpus NAME`.\n",
    );
    out
}

fn detail(g: &Gpu) -> String {
    let capacity = match g.capacity_basis {
        CapacityBasis::Reported { mib, source } => {
            format!(
                "{} ({mib} MiB as total_memory; {source})",
                fmt_bytes(g.capacity_bytes())
            )
        }
        CapacityBasis::Marketing { gb } => format!(
            "{} (marketing {gb} GB read as {gb} GiB: an upper bound of total_memory)",
            fmt_bytes(g.capacity_bytes())
        ),
        CapacityBasis::Derived { mib, source } => {
            format!("{} ({mib} MiB; {source})", fmt_bytes(g.capacity_bytes()))
        }
    };
    let l = gpu::links_for(g.name);
    let link = |l: &gpu::Link| {
        format!(
            "{} at {:.1} GB/s per direction ({})",
            l.name,
            l.bytes_per_s / 1e9,
            l.source
        )
    };
    let links = format!(
        "  links: between ranks {}; between nodes {}; to the host {}\n",
        link(&l.intra_node),
        link(&l.inter_node),
        link(&l.host)
    );
    let text = format!(
        "{name} — {product}\n  aliases: {aliases}\n  capacity: {capacity}\n  compute capability: \
         {ma}.{mi}; bf16 {bf16}, tf32 {tf32}, fp8 {fp8}\n  dense TFLOP/s: fp32 {f32}, tf32 {t32}, \
         bf16 {b16}, fp16 {h16}, fp8 {f8}\n  bandwidth: {bw:.0} GB/s\n  source: {source}\n  \
         note: {note}\n  CUDA context: {ctx} ({ctx_src})\n  cuBLAS workspace per stream: {ws} \
         (CublasHandlePool.cpp)\n",
        name = g.name,
        product = g.product,
        aliases = g.aliases.join(", "),
        ma = g.compute_capability.0,
        mi = g.compute_capability.1,
        bf16 = g.dtypes().bf16,
        tf32 = g.dtypes().tf32,
        fp8 = g.dtypes().fp8,
        f32 = tflops(Some(g.flops.fp32)),
        t32 = tflops(g.flops.tf32),
        b16 = tflops(g.flops.bf16),
        h16 = tflops(g.flops.fp16),
        f8 = tflops(g.flops.fp8),
        bw = g.bandwidth / 1e9,
        source = g.source,
        note = g.note,
        ctx = fmt_bytes(g.context_bytes),
        ctx_src = g.context_source,
        ws = fmt_bytes(g.cublas_workspace_bytes()),
    );
    text + &links
}

/// A card in `--json`: the catalog entry with its derived capacity and dtypes spelled out.
#[derive(serde::Serialize)]
struct GpuJson<'a> {
    #[serde(flatten)]
    gpu: &'a Gpu,
    capacity_bytes: u64,
    dtypes: gpu::DtypeSupport,
    /// The links the time model uses for this card (`gpu::links_for`).
    links: gpu::GpuLinks,
}

impl<'a> GpuJson<'a> {
    fn of(g: &'a Gpu) -> GpuJson<'a> {
        GpuJson {
            gpu: g,
            capacity_bytes: g.capacity_bytes(),
            dtypes: g.dtypes(),
            links: gpu::links_for(g.name),
        }
    }
}

pub(crate) fn run(args: GpusArgs) -> Result<(), crate::CliError> {
    let gpus: Vec<&Gpu> = match &args.name {
        Some(n) => vec![gpu::lookup(n).map_err(|e| SpecError::invalid("gpu", e.to_string()))?],
        None => gpu::all().iter().collect(),
    };
    if args.json {
        let rows: Vec<GpuJson> = gpus.iter().map(|g| GpuJson::of(g)).collect();
        output::print_json(&rows)?;
    } else if args.name.is_some() {
        crate::output::say(&detail(gpus[0]))?;
    } else {
        crate::output::say(&table(&gpus))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_lists_every_gpu_once() {
        let all: Vec<&Gpu> = gpu::all().iter().collect();
        let t = table(&all);
        for g in &all {
            let rows = t.lines().filter(|l| l.starts_with(&format!("{} ", g.name)));
            assert_eq!(rows.count(), 1, "{}", g.name);
        }
        // T4: no bf16, no tf32 figure; H100: 32 MiB cuBLAS workspace.
        let t4 = t.lines().find(|l| l.starts_with("t4 ")).unwrap();
        assert!(t4.contains(" no "), "{t4}");
        let h100 = t.lines().find(|l| l.starts_with("h100-sxm ")).unwrap();
        assert!(h100.ends_with("32.0 MiB"), "{h100}");
        assert!(h100.contains("79.2 GiB"), "{h100}");
    }

    #[test]
    fn detail_names_the_sources() {
        let d = detail(gpu::lookup("4090").unwrap());
        assert!(d.contains("Ada GPU Architecture whitepaper"));
        assert!(d.contains("24563 MiB"));
        assert!(d.contains("pytorch/pytorch#107667"));
        assert!(
            d.contains("links: between ranks PCIe 4.0 x16 at 31.5 GB/s"),
            "{d}"
        );
        let h = detail(gpu::lookup("h100").unwrap());
        assert!(
            h.contains("NVLink 4") && h.contains("450.0 GB/s per direction"),
            "{h}"
        );
    }
}
