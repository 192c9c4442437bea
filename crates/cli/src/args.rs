//! The spec flags every command shares, and how they combine with `--config`.

use std::path::PathBuf;

use clap::Args;
use ditmem_budget::{
    AttentionMode, Bf16Products, Latents, LoraSpec, LoraTarget, ModelSpec, Optimizer, Precision,
    Recompute, Runtime, Spec, SpecError,
};

/// Flags that describe a spec. Each given flag overrides the config file (or the embedded default).
#[derive(Debug, Clone, Default, Args)]
pub struct SpecArgs {
    /// Spec file (TOML, or JSON by extension; a regular file of at most 1 MiB); flags override
    /// its fields.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Model preset: dit-{s,b,l,xl}-{2,4,8}.
    #[arg(long)]
    pub preset: Option<String>,
    /// Image resolution: HxW, or one number for a square; sides 1–65536 px, at most 1,048,576
    /// tokens per image.
    #[arg(long, value_name = "HxW", allow_hyphen_values = true)]
    pub resolution: Option<String>,
    /// Images per optimizer step (all ranks and microbatches) = microbatch × accumulation × ranks.
    #[arg(long, value_parser = crate::flags::positive_u32, allow_hyphen_values = true)]
    pub batch: Option<u32>,
    /// Images per forward/backward on one rank: 1–65536.
    #[arg(long, value_parser = crate::flags::positive_u32, allow_hyphen_values = true)]
    pub microbatch: Option<u32>,
    /// Microbatches accumulated per optimizer step: 1–1048576 (the budget lays out two; the
    /// rest repeat the second).
    #[arg(long, value_parser = crate::flags::positive_u32, allow_hyphen_values = true)]
    pub accumulation: Option<u32>,
    /// Data-parallel ranks: 1–1048576.
    #[arg(long, value_parser = crate::flags::positive_u32, allow_hyphen_values = true)]
    pub ranks: Option<u32>,
    /// fp64 | fp32 | bf16-mixed | fp16-mixed | bf16-pure
    #[arg(long)]
    pub precision: Option<String>,
    /// adamw | adamw-8bit | sgd
    #[arg(long)]
    pub optimizer: Option<String>,
    /// materialized | memory-efficient
    #[arg(long)]
    pub attention: Option<String>,
    /// none | all | attention-only | every-K | blocks:I,J,…
    #[arg(long)]
    pub recompute: Option<String>,
    /// LoRA rank (freezes the base model); 0 turns LoRA off.
    #[arg(long, value_parser = crate::flags::count_u32, allow_hyphen_values = true)]
    pub lora_rank: Option<u32>,
    /// LoRA targets, comma-separated: qkv,proj,fc1,fc2,adaln.
    #[arg(long)]
    pub lora_targets: Option<String>,
    /// ZeRO stage 0–3 over the ranks.
    #[arg(long, value_parser = crate::flags::zero_stage, allow_hyphen_values = true)]
    pub zero: Option<u8>,
    /// encode (VAE runs in the step) | cached
    #[arg(long)]
    pub latents: Option<String>,
    /// Keep an EMA copy of the weights: on | off.
    #[arg(long)]
    pub ema: Option<String>,
    /// Which executor the budget describes: ditmem-cpu, or pytorch, pytorch:cpu, pytorch:cuda with an optional :sdpa-auto, flash, efficient, cudnn or math.
    #[arg(long)]
    pub runtime: Option<String>,
    /// ditmem-cpu: threads of the engine's pool (spec `cpu.threads`; default: this machine's,
    /// RAYON_NUM_THREADS or every logical core).
    #[arg(long, value_parser = crate::flags::positive_u32, allow_hyphen_values = true)]
    pub cpu_threads: Option<u32>,
    /// ditmem-cpu: kernel | widen — bf16 products on the AVX512-BF16 kernel or widened to f32
    /// (spec `cpu.bf16_products`; default: kernel where this CPU has AVX512-BF16).
    #[arg(long)]
    pub bf16_products: Option<String>,
    /// ditmem-cpu: bytes of the packing slab `gemm` keeps per thread, the L2 cache per core, e.g.
    /// 2MiB (spec `cpu.gemm_l2_bytes`; default: this CPU's, as `gemm` reads it).
    #[arg(long, value_name = "BYTES")]
    pub gemm_l2: Option<String>,
}

fn parse_resolution(text: &str) -> Result<(u32, u32), SpecError> {
    let bad = || {
        SpecError::invalid(
            "workload.resolution",
            format!("'{text}' is not a resolution; allowed: HxW (e.g. 512x768) or one number for a square"),
        )
    };
    let parts: Vec<&str> = text.split(['x', 'X', '×']).collect();
    match parts.as_slice() {
        [n] => {
            let n: u32 = n.trim().parse().map_err(|_| bad())?;
            Ok((n, n))
        }
        [h, w] => Ok((
            h.trim().parse().map_err(|_| bad())?,
            w.trim().parse().map_err(|_| bad())?,
        )),
        _ => Err(bad()),
    }
}

fn parse_targets(text: &str) -> Result<Vec<LoraTarget>, SpecError> {
    let mut out = Vec::new();
    for t in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let target = match t {
            "qkv" => LoraTarget::Qkv,
            "proj" => LoraTarget::Proj,
            "fc1" => LoraTarget::Fc1,
            "fc2" => LoraTarget::Fc2,
            "adaln" => LoraTarget::Adaln,
            _ => {
                return Err(SpecError::invalid(
                    "recipe.lora.targets",
                    format!("'{t}' is not a LoRA target; allowed: qkv, proj, fc1, fc2, adaln"),
                ))
            }
        };
        if !out.contains(&target) {
            out.push(target);
        }
    }
    Ok(out)
}

impl SpecArgs {
    /// Build and validate the spec: config file (or the embedded default), then the flags.
    pub fn to_spec(&self) -> Result<Spec, SpecError> {
        self.to_spec_or(Spec::default_xl)
    }

    /// As [`SpecArgs::to_spec`], with `default` instead of the embedded default when no config
    /// file is given (e.g. `verify`'s small model).
    pub fn to_spec_or(&self, default: impl FnOnce() -> Spec) -> Result<Spec, SpecError> {
        let mut spec = match &self.config {
            Some(path) => crate::input::load_spec(path)?,
            None => default(),
        };
        if let Some(p) = &self.preset {
            let old = spec.model.clone();
            spec.model = ModelSpec::preset(p)?;
            spec.model.attn_dropout = old.attn_dropout;
            spec.model.mlp_dropout = old.mlp_dropout;
        }
        if let Some(r) = &self.resolution {
            let (h, w) = parse_resolution(r)?;
            spec.workload.height = h;
            spec.workload.width = w;
        }
        let w = &mut spec.workload;
        if let Some(r) = self.ranks {
            w.ranks = r;
        }
        if let Some(a) = self.accumulation {
            w.accumulation = a;
        }
        if let Some(m) = self.microbatch {
            w.microbatch = m;
        }
        if let Some(b) = self.batch {
            w.batch = b;
        }
        // Derive what the user left out so that batch = microbatch × accumulation × ranks.
        // In u64: a product past u32 is left for validation to refuse (it names the field),
        // never a division by a wrapped zero.
        let (ranks, acc) = (u64::from(w.ranks.max(1)), u64::from(w.accumulation.max(1)));
        let (batch, micro) = (u64::from(w.batch), u64::from(w.microbatch));
        let narrow = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
        match (
            self.batch.is_some(),
            self.microbatch.is_some(),
            self.accumulation.is_some(),
        ) {
            (true, false, _) if batch % (ranks * acc) == 0 => {
                w.microbatch = narrow(batch / (ranks * acc))
            }
            (true, true, false) if micro > 0 && batch % (micro * ranks) == 0 => {
                w.accumulation = narrow(batch / (micro * ranks))
            }
            (false, true, _) | (false, _, true) => w.batch = narrow(micro * acc * ranks),
            _ => {
                if self.ranks.is_some() && self.batch.is_none() && self.microbatch.is_none() {
                    w.batch = narrow(micro * acc * ranks);
                }
            }
        }
        let r = &mut spec.recipe;
        if let Some(p) = &self.precision {
            r.precision = p.parse::<Precision>()?;
        }
        if let Some(o) = &self.optimizer {
            r.optimizer = o.parse::<Optimizer>()?;
        }
        if let Some(a) = &self.attention {
            r.attention = a.parse::<AttentionMode>()?;
        }
        if let Some(rc) = &self.recompute {
            r.recompute = rc.parse::<Recompute>()?;
        }
        if let Some(rank) = self.lora_rank {
            if rank == 0 {
                r.lora = None;
            } else {
                let targets = r
                    .lora
                    .as_ref()
                    .map(|l| l.targets.clone())
                    .unwrap_or_else(ditmem_budget::default_lora_targets);
                r.lora = Some(LoraSpec {
                    rank,
                    targets,
                    modules: Vec::new(),
                });
            }
        }
        if let Some(t) = &self.lora_targets {
            let targets = parse_targets(t)?;
            match &mut r.lora {
                Some(l) => l.targets = targets,
                None => {
                    return Err(SpecError::invalid(
                        "recipe.lora.targets",
                        "given without --lora-rank; allowed: targets together with a LoRA rank",
                    ))
                }
            }
        }
        if let Some(z) = self.zero {
            r.zero_stage = z;
        }
        if let Some(l) = &self.latents {
            r.latents = l.parse::<Latents>()?;
        }
        if let Some(e) = &self.ema {
            r.ema.enabled = match e.as_str() {
                "on" | "true" | "yes" => true,
                "off" | "false" | "no" => false,
                _ => {
                    return Err(SpecError::invalid(
                        "recipe.ema.enabled",
                        format!("'{e}' is not a switch; allowed: on, off"),
                    ))
                }
            };
        }
        if let Some(rt) = &self.runtime {
            spec.runtime = rt.parse::<Runtime>()?;
        }
        self.fill_cpu(&mut spec)?;
        spec.validate()?;
        Ok(spec)
    }

    /// The `cpu` section of a `ditmem-cpu` spec: the flags over the spec's own section, and this
    /// machine's values (as the engine reads them) for whatever neither sets. The budget never
    /// reads the host; this is where the host enters a spec, visibly.
    fn fill_cpu(&self, spec: &mut Spec) -> Result<(), SpecError> {
        let flags =
            self.cpu_threads.is_some() || self.bf16_products.is_some() || self.gemm_l2.is_some();
        if spec.runtime != Runtime::DitmemCpu {
            if flags {
                return Err(SpecError::invalid(
                    "cpu",
                    format!(
                        "--cpu-threads, --bf16-products and --gemm-l2 describe the ditmem-cpu engine's CPU, but the runtime is {}; allowed: these flags only with --runtime ditmem-cpu",
                        spec.runtime
                    ),
                ));
            }
            if self.runtime.is_some() {
                // `--runtime` moved the spec off the engine: its CPU no longer applies.
                spec.cpu = None;
            }
            return Ok(());
        }
        let mut cpu = spec.cpu.unwrap_or_else(ditmem_engine::host::detect);
        if let Some(t) = self.cpu_threads {
            cpu.threads = t;
        }
        if let Some(p) = &self.bf16_products {
            cpu.bf16_products = p.parse::<Bf16Products>()?;
        }
        if let Some(text) = &self.gemm_l2 {
            cpu.gemm_l2_bytes = ditmem_budget::parse_bytes(text).ok_or_else(|| {
                SpecError::invalid(
                    "cpu.gemm_l2_bytes",
                    format!(
                        "{} is not a size; allowed: bytes with an optional unit, e.g. 1MiB, 2MiB, 1048576",
                        crate::flags::show(text)
                    ),
                )
            })?;
        }
        spec.cpu = Some(cpu);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_alone_sets_microbatch() {
        let a = SpecArgs {
            batch: Some(8),
            ..SpecArgs::default()
        };
        let s = a.to_spec().unwrap();
        assert_eq!(
            (
                s.workload.batch,
                s.workload.microbatch,
                s.workload.accumulation
            ),
            (8, 8, 1)
        );
    }

    #[test]
    fn batch_and_microbatch_derive_accumulation() {
        let a = SpecArgs {
            batch: Some(32),
            microbatch: Some(8),
            ..SpecArgs::default()
        };
        let s = a.to_spec().unwrap();
        assert_eq!(s.workload.accumulation, 4);
    }

    #[test]
    fn inconsistent_split_is_an_error_naming_batch() {
        let a = SpecArgs {
            batch: Some(32),
            microbatch: Some(8),
            accumulation: Some(3),
            ..SpecArgs::default()
        };
        let e = a.to_spec().unwrap_err();
        assert_eq!(e.field(), Some("workload.batch"));
    }

    #[test]
    fn resolutions() {
        assert_eq!(parse_resolution("512").unwrap(), (512, 512));
        assert_eq!(parse_resolution("512x768").unwrap(), (512, 768));
        assert!(parse_resolution("big").is_err());
    }
}
