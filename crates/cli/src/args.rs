//! The spec flags every command shares, and how they combine with `--config`.

use std::path::PathBuf;

use clap::Args;
use ditmem_budget::{
    denoiser, AttentionMode, Bf16Products, Latents, LoraSpec, LoraTarget, ModelSpec, Optimizer,
    OptimizerImpl, Precision, Recompute, Runtime, SdpaBackend, Spec, SpecError, TorchDevice,
};

/// Flags that describe a spec. Each given flag overrides the config file (or the embedded default).
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct SpecArgs {
    /// Spec file (TOML, or JSON by extension; a regular file of at most 1 MiB); flags override
    /// its fields.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Model preset: dit-{s,b,l,xl}-{2,4,8} (the original DiT), or a diffusers checkpoint:
    /// flux.1-dev, flux.1-schnell, sd3-medium, sd3.5-medium, sd3.5-large, pixart-alpha-1024,
    /// pixart-sigma-1024, sana-600m, sana-1600m, wan2.1-1.3b, wan2.1-14b, dit-xl-2-256,
    /// dit-xl-2-512 (`ditmem params --preset NAME` shows one). A diffusers checkpoint brings
    /// its family's training defaults: the pipeline's resolution (FLUX, SD3/3.5, PixArt, Sana
    /// 1024²; Wan 81 × 480 × 832), 1 sample per rank, the scripts' text tokens; a --config
    /// file's fields and the flags still win. The DiTs keep 256², batch 32.
    #[arg(long)]
    pub preset: Option<String>,
    /// A diffusers transformer `config.json`, or the folder holding one (a checkpoint's
    /// `transformer/`): PixArt, SD3/SD3.5, Flux, Sana, Wan 2.1 or diffusers' DiT; brings the
    /// family's training defaults as --preset does.
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// A diffusers `config.json` given as a value rather than a file (the API's `model` dict, a
    /// live model's `config`); read as `--model` reads the file.
    #[arg(skip)]
    pub model_json: Option<serde_json::Map<String, serde_json::Value>>,
    /// Text tokens per text encoder of the model, comma-separated in the family's order (Flux:
    /// CLIP,T5 e.g. 77,512; SD3: CLIP,T5 e.g. 77,256; PixArt: T5; Sana: Gemma; Wan: umT5);
    /// default: what the family's training scripts encode.
    #[arg(long, value_name = "N[,M]")]
    pub text_tokens: Option<String>,
    /// Video frames per sample (Wan: 1 + 4k, e.g. 81); 1 for images.
    #[arg(long, value_parser = crate::flags::positive_u32, allow_hyphen_values = true)]
    pub frames: Option<u32>,
    /// The model with fewer blocks, every other dimension kept (a preset at its real width within
    /// a CPU's memory): N blocks, each 1 to the model's depth. Flux: N double- and N single-stream
    /// blocks, or D,S; SD3.5-medium: N dual-attention and N joint blocks, or D,S.
    #[arg(long, value_name = "N[,S]", allow_hyphen_values = true)]
    pub depth: Option<String>,
    /// none | int8 | nf4 | fp8 — how a frozen LoRA base's block Linears are stored (nf4: QLoRA
    /// with bitsandbytes; fp8: layerwise casting); needs --lora-rank.
    #[arg(long)]
    pub base_quant: Option<String>,
    /// for-loop | foreach | fused — torch.optim.AdamW's implementation (pytorch runtime;
    /// default: the device's, for-loop on the CPU and foreach on CUDA).
    #[arg(long)]
    pub optimizer_impl: Option<String>,
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
    /// Data-parallel ranks: 1–1048576. Without --batch each rank keeps its microbatch (the
    /// batch over all ranks grows with them: a family preset's 1 per rank, 8 over 8 ranks).
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
    /// LoRA targets, comma-separated: qkv,proj,fc1,fc2,adaln for the original DiT; module names
    /// as PEFT's target_modules for a diffusers model (default to_k,to_q,to_v,to_out.0).
    #[arg(long)]
    pub lora_targets: Option<String>,
    /// The dtype LoRA adapters are kept in: fp32 (default: cast_training_params) or weight (the
    /// frozen base's, as the diffusers LoRA scripts keep them under --mixed_precision bf16).
    #[arg(long)]
    pub lora_dtype: Option<String>,
    /// ZeRO stage 0–3 over the ranks.
    #[arg(long, value_parser = crate::flags::zero_stage, allow_hyphen_values = true)]
    pub zero: Option<u8>,
    /// Who shards a ZeRO stage: deepspeed (default) | fsdp (FSDP2: stage 3 reshards after
    /// forward, stage 2 does not; no stage 1).
    #[arg(long, value_name = "SHARDER")]
    pub sharder: Option<String>,
    /// What a sharded step keeps in host memory: none (default) | optimizer (ZeRO-Offload) |
    /// optimizer+params (ZeRO-3 offload_param, FSDP2 CPUOffloadPolicy).
    #[arg(long, value_name = "OFFLOAD")]
    pub offload: Option<String>,
    /// DDP (stage 0 over several ranks): gradients as views of the all-reduce buckets: on | off.
    #[arg(long, value_name = "on|off")]
    pub gradient_as_bucket_view: Option<String>,
    /// encode (VAE runs in the step) | cached
    #[arg(long)]
    pub latents: Option<String>,
    /// on | off — bitsandbytes' paged 8-bit AdamW (PagedAdamW8bit; with --optimizer adamw-8bit on pytorch:cuda): large tensors' state in CUDA managed memory, outside the caching allocator
    #[arg(long, value_name = "on|off")]
    pub paged_optimizer: Option<String>,
    /// on | off — fp32 matmuls on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32; the diffusers scripts' --allow_tf32): the time model prices fp32 compute at the card's TF32 rate; default on, as DiT's train.py and the exports set it
    #[arg(long, value_name = "on|off")]
    pub tf32: Option<String>,
    /// cached | online | offloaded — a family's frozen text encoders (T5, CLIP, Gemma, umT5): caption embeddings computed beforehand; encoders on the device all step in weight_dtype; or moved to the device only to encode (the scripts' --offload)
    #[arg(long, value_name = "WHERE")]
    pub text_encoders: Option<String>,
    /// Keep an EMA copy of the weights: on | off.
    #[arg(long)]
    pub ema: Option<String>,
    /// Which executor the budget describes: ditmem-cpu, or pytorch, pytorch:cpu, pytorch:cuda with an optional :sdpa-auto, flash, efficient, cudnn or math.
    #[arg(long)]
    pub runtime: Option<String>,
    /// pytorch:cuda: the GPU the step runs on (`ditmem gpus` lists them: h100-80gb, rtx-4090, …);
    /// sets the runtime to pytorch:cuda, the plan's default budget and whether it fits.
    #[arg(long, value_name = "NAME")]
    pub gpu: Option<String>,
    /// pytorch:cuda: the caching allocator's PYTORCH_CUDA_ALLOC_CONF, e.g.
    /// expandable_segments:True or max_split_size_mb:128.
    #[arg(long, value_name = "CONF")]
    pub alloc_conf: Option<String>,
    /// pytorch:cuda: the card's memory as your own torch prints it
    /// (`torch.cuda.get_device_properties(0).total_memory`, bytes, or a size such as 39.5GiB),
    /// instead of the catalog's figure for --gpu.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub gpu_memory: Option<String>,
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

/// Comma-separated counts (`77,512`), each 1–65,536.
fn parse_counts(field: &str, text: &str) -> Result<Vec<u32>, SpecError> {
    text.split(',')
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .ok()
                .filter(|&n| (1..=ditmem_budget::MAX_TEXT_TOKENS).contains(&n))
                .ok_or_else(|| {
                    SpecError::invalid(
                        field,
                        format!(
                            "'{}' is not a token count; allowed: comma-separated counts 1–{}, one per text encoder (e.g. 77,512)",
                            crate::flags::show(t),
                            ditmem_budget::MAX_TEXT_TOKENS
                        ),
                    )
                })
        })
        .collect()
}

/// `--depth N[,S]`: a diffusers model keeps N blocks of each kind (`model.keep_blocks`, read
/// with its config); the original DiT's `model.depth` becomes N, at most the depth it had.
fn apply_depth(spec: &mut Spec, text: &str) -> Result<(), SpecError> {
    let counts: Vec<u32> = text
        .split(',')
        .map(|t| t.trim().parse::<u32>().ok().filter(|&n| n >= 1))
        .collect::<Option<_>>()
        .ok_or_else(|| {
            SpecError::invalid(
                "--depth",
                format!(
                    "{} is not a block count; allowed: N or D,S with each count 1 to the \
                     model's blocks of that kind",
                    crate::flags::show(text)
                ),
            )
        })?;
    if spec.model.diffusers.is_some() {
        spec.model.keep_blocks = counts;
        return denoiser::resolve(spec).map_err(|e| match e {
            SpecError::Invalid { field, message } if field == "model.keep_blocks" => {
                SpecError::invalid("--depth", message)
            }
            other => other,
        });
    }
    let depth = spec.model.depth;
    match counts.as_slice() {
        [n] if *n <= depth => {
            spec.model.depth = *n;
            Ok(())
        }
        _ => Err(SpecError::invalid(
            "--depth",
            format!(
                "{} on the original DiT of {depth} blocks; allowed: one count N with \
                 1 ≤ N ≤ {depth}",
                crate::flags::show(text)
            ),
        )),
    }
}

/// PEFT `target_modules` names: comma-separated module names (`to_q,to_k,to_v,to_out.0`).
fn parse_modules(text: &str) -> Result<Vec<String>, SpecError> {
    let names: Vec<String> = text
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .collect();
    let bad = names.iter().find(|n| {
        n.len() > 200
            || !n
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
    });
    if names.is_empty() || bad.is_some() {
        return Err(SpecError::invalid(
            "recipe.lora.modules",
            format!(
                "'{}' is not a list of module names; allowed: comma-separated names such as to_q,to_k,to_v,to_out.0",
                crate::flags::show(text)
            ),
        ));
    }
    Ok(names)
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

/// Whether a `--config` file (as a tree of values) gives the field at `path`.
fn states(config: Option<&serde_json::Value>, path: &[&str]) -> bool {
    let Some(mut v) = config else {
        return false;
    };
    for key in path {
        match v.get(key) {
            Some(x) => v = x,
            None => return false,
        }
    }
    true
}

/// A family model's training defaults over `spec` (just given the model by a preset or
/// `--model`), except the fields the config file states: those keep the file's values (`before`
/// is the spec as the file gave it). The original DiT and diffusers' DiT have none: the spec's
/// workload stays.
fn family_defaults(
    spec: &mut Spec,
    before: &Spec,
    config: Option<&serde_json::Value>,
) -> Result<(), SpecError> {
    let given = |path: &[&str]| states(config, path);
    if let Some(d) = denoiser::training_defaults(spec)? {
        let w = &mut spec.workload;
        if !given(&["workload", "height"]) {
            w.height = d.height;
        }
        if !given(&["workload", "width"]) {
            w.width = d.width;
        }
        if !given(&["workload", "frames"]) {
            w.frames = d.frames;
        }
        if !given(&["workload", "microbatch"]) {
            w.microbatch = d.microbatch;
        }
        if !given(&["workload", "accumulation"]) {
            w.accumulation = d.accumulation;
        }
        if !given(&["workload", "batch"]) {
            // One sample per rank and microbatch: the batch over all ranks follows.
            let b = u64::from(w.microbatch) * u64::from(w.accumulation) * u64::from(w.ranks);
            w.batch = u32::try_from(b).unwrap_or(u32::MAX);
        }
        if !given(&["workload", "text_tokens"]) {
            // The family's own (`TextEncoder::default_tokens`).
            w.text_tokens = None;
        }
    }
    // `with_family` set diffusers' recipe (SDPA, no EMA): the file's own choice stays.
    if given(&["recipe", "attention"]) {
        spec.recipe.attention = before.recipe.attention;
    }
    if given(&["recipe", "ema", "enabled"]) {
        spec.recipe.ema.enabled = before.recipe.ema.enabled;
    }
    Ok(())
}

impl SpecArgs {
    /// Build and validate the spec: config file (or the embedded default), then the flags.
    pub(crate) fn to_spec(&self) -> Result<Spec, SpecError> {
        self.to_spec_or(Spec::default_xl)
    }

    /// As [`SpecArgs::to_spec`], with `default` instead of the embedded default when no config
    /// file is given (e.g. `verify`'s small model).
    pub(crate) fn to_spec_or(&self, default: impl FnOnce() -> Spec) -> Result<Spec, SpecError> {
        self.build(default, None)
    }

    /// `estimate`, `plan` and `spec`: the step on a CUDA GPU (`pytorch:cuda`) unless
    /// `--runtime`, the config file's `runtime` or an engine flag (`--cpu-threads`,
    /// `--bf16-products`, `--gemm-l2`: the `ditmem-cpu` engine) says otherwise.
    pub(crate) fn to_gpu_spec(&self) -> Result<Spec, SpecError> {
        let engine_flags =
            self.cpu_threads.is_some() || self.bf16_products.is_some() || self.gemm_l2.is_some();
        if engine_flags {
            return self.to_spec();
        }
        let cuda = Runtime::Pytorch {
            device: TorchDevice::Cuda,
            sdpa: SdpaBackend::Auto,
        };
        self.build(
            || {
                let mut s = Spec::default_xl();
                s.runtime = cuda;
                s
            },
            Some(cuda),
        )
    }

    /// The spec: the config file (its runtime, or `runtime` when the file names none) or
    /// `default`, then the flags.
    fn build(
        &self,
        default: impl FnOnce() -> Spec,
        runtime: Option<Runtime>,
    ) -> Result<Spec, SpecError> {
        let mut spec = self.model_layers(default, runtime)?;
        self.apply_workload(&mut spec)?;
        self.apply_recipe(&mut spec)?;
        if let Some(rt) = &self.runtime {
            spec.runtime = rt.parse::<Runtime>()?;
        }
        self.fill_cuda(&mut spec)?;
        self.fill_cpu(&mut spec)?;
        denoiser::resolve(&mut spec)?;
        denoiser::check(&spec)?;
        Ok(spec)
    }

    /// The spec before the flags that set single fields: the command's default or `--config`,
    /// then the model a preset, `--model` or `--model-json` names, with its family's defaults.
    fn model_layers(
        &self,
        default: impl FnOnce() -> Spec,
        runtime: Option<Runtime>,
    ) -> Result<Spec, SpecError> {
        let mut spec = match &self.config {
            Some(path) => {
                let mut s = crate::input::load_spec(path)?;
                if let Some(rt) = runtime {
                    if !crate::input::config_names_runtime(path)? {
                        s.runtime = rt;
                        s.cpu = None;
                    }
                }
                s
            }
            None => default(),
        };
        // A preset or `--model` brings its family's training defaults. The layers, each over the
        // one before: the command's default spec (the original DiT's workload), the family's
        // defaults (its pipeline's resolution and frames, one sample per rank, SDPA, no EMA),
        // the fields the --config file states, the flags. So `--config s.toml --preset X` is
        // the file's workload on model X, and `--preset X` alone is X as its scripts train it.
        let before = spec.clone();
        let family_flag = self.model.is_some()
            || self.model_json.is_some()
            || self
                .preset
                .as_ref()
                .is_some_and(|p| ditmem_budget::preset_config(&p.to_ascii_lowercase()).is_some());
        if let Some(p) = &self.preset {
            let lower = p.to_ascii_lowercase();
            if let Some(text) = ditmem_budget::preset_config(&lower) {
                let map = serde_json::from_str(text).map_err(|e| {
                    SpecError::invalid("--preset", format!("built-in config of {lower}: {e}"))
                })?;
                spec = denoiser::with_family(spec, &lower, map)?;
            } else {
                let old = spec.model.clone();
                // Not a diffusers checkpoint: an original DiT, or a name the refusal answers with
                // every preset (the spec crate's own lists only the DiTs).
                spec.model = ModelSpec::preset(p).map_err(|_| ditmem_budget::unknown_preset(p))?;
                spec.model.attn_dropout = old.attn_dropout;
                spec.model.mlp_dropout = old.mlp_dropout;
                // The original DiT reads the SD VAE's latents.
                let w = &mut spec.workload;
                w.latent_channels = spec.model.in_channels;
                w.vae_factor = 8;
                w.vae_temporal_factor = 1;
                w.text_tokens = None;
            }
        }
        if let Some(path) = &self.model {
            let (m, map) = crate::input::load_model(path)?;
            spec = denoiser::with_family(spec, &m.name, map)?;
        }
        if let Some(value) = &self.model_json {
            let (m, map) = crate::input::model_from_value("model", value)?;
            spec = denoiser::with_family(spec, &m.name, map)?;
        }
        if family_flag {
            let stated = match &self.config {
                Some(path) => Some(crate::input::spec_value(path)?),
                None => None,
            };
            family_defaults(&mut spec, &before, stated.as_ref())?;
        }
        Ok(spec)
    }

    /// The workload's flags: text tokens, depth, frames, resolution, the batch's counts (and
    /// what they leave out, derived).
    fn apply_workload(&self, spec: &mut Spec) -> Result<(), SpecError> {
        if let Some(t) = &self.text_tokens {
            spec.workload.text_tokens = Some(parse_counts("workload.text_tokens", t)?);
        }
        if let Some(d) = &self.depth {
            apply_depth(spec, d)?;
        }
        if let Some(f) = self.frames {
            spec.workload.frames = f;
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
        Ok(())
    }

    /// The recipe's flags.
    fn apply_recipe(&self, spec: &mut Spec) -> Result<(), SpecError> {
        if let Some(q) = &self.base_quant {
            spec.recipe.base_quant = q.parse::<ditmem_budget::BaseQuant>()?;
        }
        if let Some(i) = &self.optimizer_impl {
            spec.recipe.optimizer_impl = Some(i.parse::<OptimizerImpl>()?);
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
                    dtype: r.lora.as_ref().map(|l| l.dtype).unwrap_or_default(),
                    rank,
                    targets,
                    modules: Vec::new(),
                });
            }
        }
        if let Some(t) = &self.lora_targets {
            let family = spec.model.diffusers.is_some();
            match &mut r.lora {
                Some(l) if family => l.modules = parse_modules(t)?,
                Some(l) => l.targets = parse_targets(t)?,
                None => {
                    return Err(SpecError::invalid(
                        "recipe.lora.targets",
                        "given without --lora-rank; allowed: targets together with a LoRA rank",
                    ))
                }
            }
        }
        if let Some(d) = &self.lora_dtype {
            let d = d.parse::<ditmem_budget::LoraDtype>()?;
            match &mut r.lora {
                Some(l) => l.dtype = d,
                None => {
                    return Err(SpecError::invalid(
                        "recipe.lora.dtype",
                        "given without --lora-rank; allowed: an adapter dtype together with a LoRA rank",
                    ))
                }
            }
        }
        if let Some(z) = self.zero {
            r.zero_stage = z;
        }
        if let Some(x) = &self.sharder {
            r.sharder = ditmem_budget::Sharder::parse(x, "--sharder")?;
        }
        if let Some(x) = &self.offload {
            r.offload = ditmem_budget::Offload::parse(x, "--offload")?;
        }
        if let Some(v) = &self.gradient_as_bucket_view {
            r.gradient_as_bucket_view = switch(
                "--gradient-as-bucket-view",
                &v.chars().take(60).collect::<String>(),
            )?;
        }
        if let Some(l) = &self.latents {
            r.latents = l.parse::<Latents>()?;
        }
        if let Some(t) = &self.text_encoders {
            r.text_encoders = t.parse::<ditmem_budget::TextEncoders>()?;
        }
        if let Some(p) = &self.paged_optimizer {
            r.paged_optimizer = switch("recipe.paged_optimizer", p)?;
        }
        if let Some(t) = &self.tf32 {
            r.tf32 = switch("recipe.tf32", t)?;
        }
        if let Some(e) = &self.ema {
            r.ema.enabled = switch("recipe.ema.enabled", e)?;
        }
        Ok(())
    }

    /// The `cuda` section: `--gpu` (which moves a spec onto `pytorch:cuda` unless `--runtime`
    /// names another device) and `--alloc-conf`.
    fn fill_cuda(&self, spec: &mut Spec) -> Result<(), SpecError> {
        if self.gpu.is_none() && self.alloc_conf.is_none() && self.gpu_memory.is_none() {
            return Ok(());
        }
        let cuda = matches!(
            spec.runtime,
            Runtime::Pytorch {
                device: ditmem_budget::TorchDevice::Cuda,
                ..
            }
        );
        if !cuda {
            if self.runtime.is_some() {
                return Err(SpecError::invalid(
                    "cuda",
                    format!(
                        "--gpu and --alloc-conf describe a CUDA device, but --runtime is {}; allowed: with pytorch:cuda",
                        spec.runtime
                    ),
                ));
            }
            spec.runtime = "pytorch:cuda".parse::<Runtime>()?;
            spec.cpu = None;
        }
        let mut c = spec.cuda.clone().unwrap_or_default();
        if let Some(g) = &self.gpu {
            let gpu = ditmem_budget::gpu::lookup(g)
                .map_err(|e| SpecError::invalid("cuda.gpu", e.to_string()))?;
            c.gpu = Some(gpu.name.to_string());
        }
        if let Some(a) = &self.alloc_conf {
            ditmem_budget::pytorch::AllocConf::parse(a)
                .map_err(|e| SpecError::invalid("cuda.alloc_conf", e.to_string()))?;
            c.alloc_conf = a.clone();
        }
        if let Some(m) = &self.gpu_memory {
            let Some(name) = c.gpu.as_deref() else {
                return Err(SpecError::invalid(
                    "--gpu-memory",
                    "needs the card it measures; allowed: together with --gpu NAME",
                ));
            };
            let g = ditmem_budget::gpu::lookup(name)
                .map_err(|e| SpecError::invalid("cuda.gpu", e.to_string()))?;
            const ALLOWED: &str = "allowed: the bytes torch prints as total_memory, or a size \
                                   such as 39.5GiB, above the card's CUDA context and below 16 TiB";
            let b = ditmem_budget::parse_bytes(m).ok_or_else(|| {
                SpecError::invalid(
                    "--gpu-memory",
                    format!(
                        "'{}' is not a memory size; {ALLOWED}",
                        m.chars().take(60).collect::<String>()
                    ),
                )
            })?;
            if b <= g.context_bytes + (64 << 20) || b >= 16u64 << 40 {
                return Err(SpecError::invalid(
                    "--gpu-memory",
                    format!("{b} bytes is out of range; {ALLOWED}"),
                ));
            }
            c.gpu_memory = Some(b);
        }
        spec.cuda = Some(c);
        Ok(())
    }

    /// The `cpu` section of a `ditmem-cpu` spec: the flags over the spec's own section, and this
    /// machine's values (as the engine reads them) for whatever neither sets. The budget never
    /// reads the host; this is where the host enters a spec, visibly.
    fn fill_cpu(&self, spec: &mut Spec) -> Result<(), SpecError> {
        let flags =
            self.cpu_threads.is_some() || self.bf16_products.is_some() || self.gemm_l2.is_some();
        let torch_cpu = spec.runtime.to_string().starts_with("pytorch:cpu");
        if torch_cpu && self.bf16_products.is_none() && self.gemm_l2.is_none() {
            // pytorch:cpu reads only the threads (torch.get_num_threads(): per-thread scratch);
            // without the flag, the spec's section or the reference's 2.
            if let Some(t) = self.cpu_threads {
                let mut cpu = spec.cpu.unwrap_or(ditmem_budget::CpuSpec::REFERENCE);
                cpu.threads = t;
                spec.cpu = Some(cpu);
            } else if self.runtime.is_some() && spec.cpu.is_some() {
                spec.cpu = None;
            }
            return Ok(());
        }
        if spec.runtime != Runtime::DitmemCpu {
            if flags {
                return Err(SpecError::invalid(
                    "cpu",
                    format!(
                        "--cpu-threads, --bf16-products and --gemm-l2 describe the ditmem-cpu engine's CPU, but the runtime is {}; allowed: these flags only with --runtime ditmem-cpu (--cpu-threads also with pytorch:cpu)",
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

/// An on/off flag's value (`on`, `true`, `yes` / `off`, `false`, `no`); anything else is an
/// error naming `field`.
fn switch(field: &str, value: &str) -> Result<bool, SpecError> {
    match value {
        "on" | "true" | "yes" => Ok(true),
        "off" | "false" | "no" => Ok(false),
        _ => Err(SpecError::invalid(
            field,
            format!("'{value}' is not a switch; allowed: on, off"),
        )),
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

    /// A family preset brings its training defaults whatever the command; the runtime stays the
    /// command's: the engine's for `run`, `compare`, `verify` (`to_spec`, `to_spec_or`),
    /// pytorch:cuda for `estimate`, `plan`, `spec` (`to_gpu_spec`).
    #[test]
    fn a_family_preset_brings_its_defaults_and_the_command_its_runtime() {
        let a = SpecArgs {
            preset: Some("pixart-sigma-1024".into()),
            ..SpecArgs::default()
        };
        let engine = a.to_spec().unwrap();
        assert_eq!(engine.runtime, Runtime::DitmemCpu);
        let w = &engine.workload;
        assert_eq!(
            (w.height, w.width, w.batch, w.microbatch),
            (1024, 1024, 1, 1)
        );
        let gpu = a.to_gpu_spec().unwrap();
        assert!(matches!(
            gpu.runtime,
            Runtime::Pytorch {
                device: TorchDevice::Cuda,
                ..
            }
        ));
        assert_eq!(gpu.workload, engine.workload);
        let verify = a.to_spec_or(Spec::small).unwrap();
        assert_eq!(verify.workload, engine.workload);
        // Without a preset the DiT default stays, per rank: 32 on each of 8 ranks.
        let s = SpecArgs {
            ranks: Some(8),
            ..SpecArgs::default()
        }
        .to_spec()
        .unwrap();
        assert_eq!((s.workload.batch, s.workload.microbatch), (256, 32));
    }

    #[test]
    fn resolutions() {
        assert_eq!(parse_resolution("512").unwrap(), (512, 512));
        assert_eq!(parse_resolution("512x768").unwrap(), (512, 768));
        assert!(parse_resolution("big").is_err());
    }
}
