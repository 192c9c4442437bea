//! [`Spec::validate`]: every field checked, the error naming the first field that is wrong and
//! what is allowed.

use crate::error::SpecError;
use crate::limits::*;
use crate::precision::Dtype;
use crate::recipe::*;
use crate::runtime::{Runtime, TorchDevice};
use crate::spec::Spec;

impl Spec {
    /// Check every field; the error names the first field that is wrong and what is allowed.
    ///
    /// Besides what makes a spec meaningful, the sizes are capped ([`LIMITS`]) generously above
    /// any real model, so that `estimate` and `plan` of any spec that passes stay within a
    /// bounded time and memory (the README states them).
    pub fn validate(&self) -> Result<(), SpecError> {
        let m = &self.model;
        // A diffusers model's own fields are checked by its family reader, and the fields below
        // are derived from it (`denoiser::resolve`), so only what the spec itself says is checked.
        let dit = m.diffusers.is_none();
        if dit {
            self.validate_dit_model()?;
            if !m.keep_blocks.is_empty() {
                return Err(SpecError::invalid(
                    "model.keep_blocks",
                    format!(
                        "{:?} on the original DiT; allowed: an empty list (set model.depth)",
                        m.keep_blocks
                    ),
                ));
            }
        }
        self.validate_workload(dit)?;
        if let Some(b) = self.cuda.as_ref().and_then(|c| c.gpu_memory) {
            // Above any CUDA context and the allocator's smallest segment, below 16 TiB.
            if !(1u64 << 30..16u64 << 40).contains(&b) {
                return Err(SpecError::invalid(
                    "cuda.gpu_memory",
                    format!("{b} bytes is out of range; allowed: 1 GiB to 16 TiB (total_memory)"),
                ));
            }
        }
        self.validate_recipe()
    }

    fn validate_dit_model(&self) -> Result<(), SpecError> {
        let m = &self.model;
        in_range("model.depth", m.depth, MAX_DEPTH)?;
        in_range("model.hidden", m.hidden, MAX_HIDDEN)?;
        in_range("model.heads", m.heads, MAX_HIDDEN)?;
        in_range("model.patch", m.patch, MAX_PATCH)?;
        in_range("model.in_channels", m.in_channels, MAX_CHANNELS)?;
        in_range("model.mlp_ratio", m.mlp_ratio, MAX_MLP_RATIO)?;
        in_range("model.num_classes", m.num_classes, MAX_NUM_CLASSES)?;
        in_range("model.freq_embed", m.freq_embed, MAX_FREQ_EMBED)?;
        if !m.hidden.is_multiple_of(m.heads) {
            return Err(SpecError::invalid(
                "model.heads",
                format!(
                    "{} does not divide model.hidden = {}; allowed: a divisor of the hidden size",
                    m.heads, m.hidden
                ),
            ));
        }
        if !m.freq_embed.is_multiple_of(2) {
            return Err(SpecError::invalid(
                "model.freq_embed",
                format!(
                    "{} is odd; allowed: an even number (cos and sin halves)",
                    m.freq_embed
                ),
            ));
        }
        probability("model.class_dropout_prob", m.class_dropout_prob)?;
        probability("model.attn_dropout", m.attn_dropout)?;
        probability("model.mlp_dropout", m.mlp_dropout)?;
        let block_params =
            (10 + 2 * u128::from(m.mlp_ratio)) * u128::from(m.hidden) * u128::from(m.hidden);
        if u128::from(m.depth) * block_params > MAX_TENSOR_ELEMS {
            return Err(SpecError::invalid(
                "model.hidden",
                format!(
                    "depth {} × hidden {} gives about {} parameters; allowed: at most {MAX_TENSOR_ELEMS}",
                    m.depth,
                    m.hidden,
                    u128::from(m.depth) * block_params
                ),
            ));
        }
        let w = &self.workload;
        if w.frames != 1 {
            return Err(SpecError::invalid(
                "workload.frames",
                format!(
                    "{} for the original DiT (an image model); allowed: 1, or a video model in model.diffusers",
                    w.frames
                ),
            ));
        }
        if w.text_tokens.is_some() {
            return Err(SpecError::invalid(
                "workload.text_tokens",
                "is given for the original DiT (class-conditional, no text encoder); allowed: only with a \
                 text-conditioned model in model.diffusers",
            ));
        }
        if w.latent_channels != m.in_channels {
            return Err(SpecError::invalid(
                "workload.latent_channels",
                format!(
                    "{} differs from model.in_channels = {}; allowed: the channels the denoiser reads",
                    w.latent_channels, m.in_channels
                ),
            ));
        }
        Ok(())
    }

    fn validate_workload(&self, dit: bool) -> Result<(), SpecError> {
        let m = &self.model;
        let w = &self.workload;
        in_range("workload.height", w.height, MAX_SIDE)?;
        in_range("workload.width", w.width, MAX_SIDE)?;
        in_range("workload.vae_factor", w.vae_factor, MAX_VAE_FACTOR)?;
        in_range("workload.latent_channels", w.latent_channels, MAX_CHANNELS)?;
        positive("workload.batch", w.batch)?;
        in_range("workload.microbatch", w.microbatch, MAX_MICROBATCH)?;
        in_range("workload.accumulation", w.accumulation, MAX_ACCUMULATION)?;
        in_range("workload.ranks", w.ranks, MAX_RANKS)?;
        in_range("workload.frames", w.frames, MAX_FRAMES)?;
        in_range(
            "workload.vae_temporal_factor",
            w.vae_temporal_factor,
            MAX_VAE_FACTOR,
        )?;
        if let Some(tt) = &w.text_tokens {
            if tt.is_empty() || tt.len() > MAX_TEXT_ENCODERS {
                return Err(SpecError::invalid(
                    "workload.text_tokens",
                    format!(
                        "lists {} encoders; allowed: 1..={MAX_TEXT_ENCODERS} token counts, one per text encoder",
                        tt.len()
                    ),
                ));
            }
            for &t in tt {
                in_range("workload.text_tokens", t, MAX_TEXT_TOKENS)?;
            }
        }
        if !dit && [m.depth, m.hidden, m.heads, m.patch, m.in_channels].contains(&0) {
            // Not resolved yet (`denoiser::resolve` derives these): the geometry below needs
            // the family's patch, blocks and widths.
            return Ok(());
        }
        let product = u64::from(w.microbatch) * u64::from(w.accumulation) * u64::from(w.ranks);
        if product != u64::from(w.batch) {
            return Err(SpecError::invalid(
                "workload.batch",
                format!(
                    "{} ≠ microbatch × accumulation × ranks = {} × {} × {} = {product}; allowed: batch equal to that product",
                    w.batch, w.microbatch, w.accumulation, w.ranks
                ),
            ));
        }
        let grid = self.token_grid()?;
        let tokens = self.tokens()?;
        if tokens > MAX_TOKENS {
            return Err(SpecError::invalid(
                "workload.height",
                format!(
                    "{}×{} gives {tokens} tokens per image (patch {}, vae_factor {}); allowed: \
                     1..={MAX_TOKENS} tokens per image",
                    w.height, w.width, m.patch, w.vae_factor
                ),
            ));
        }
        // The latents of the step's batch on one rank (f64 latents and noise in the engine).
        let per_rank = u128::from(w.microbatch) * u128::from(w.accumulation);
        let latents = per_rank
            * u128::from(w.latent_channels)
            * u128::from(grid.latent_h)
            * u128::from(grid.latent_w);
        if latents > MAX_TENSOR_ELEMS {
            return Err(SpecError::invalid(
                "workload.batch",
                format!(
                    "{per_rank} images per rank of {}×{}×{} latents are {latents} elements; \
                     allowed: at most {MAX_TENSOR_ELEMS} (lower the batch or the resolution)",
                    w.latent_channels, grid.latent_h, grid.latent_w
                ),
            ));
        }
        // Byte counts are u64: keep the largest tensor of the step (the attention probabilities,
        // microbatch · heads · tokens²) far from overflow.
        let attn = u128::from(w.microbatch)
            * u128::from(m.heads)
            * u128::from(tokens)
            * u128::from(tokens);
        let act = u128::from(w.microbatch)
            * u128::from(tokens)
            * u128::from(m.hidden)
            * u128::from(m.mlp_ratio);
        if attn.max(act) > MAX_TENSOR_ELEMS {
            return Err(SpecError::invalid(
                "workload.height",
                format!(
                    "{}×{} gives {tokens} tokens per image, a b·heads·tokens² tensor of {attn} elements; \
                     allowed: at most {MAX_TENSOR_ELEMS} elements per tensor (lower the resolution or the microbatch)",
                    w.height, w.width
                ),
            ));
        }

        Ok(())
    }

    fn validate_recipe(&self) -> Result<(), SpecError> {
        let w = &self.workload;
        let r = &self.recipe;
        if r.paged_optimizer {
            let cuda = matches!(
                self.runtime,
                Runtime::Pytorch {
                    device: TorchDevice::Cuda,
                    ..
                }
            );
            if r.optimizer != Optimizer::AdamW8bit || !cuda || r.zero_stage > 0 {
                return Err(SpecError::invalid(
                    "recipe.paged_optimizer",
                    format!(
                        "is on with {} on {}{}; allowed: adamw-8bit on pytorch:cuda without ZeRO \
                         (bitsandbytes' PagedAdamW8bit pages CUDA managed memory)",
                        r.optimizer.name(),
                        self.runtime,
                        if r.zero_stage > 0 { " under ZeRO" } else { "" }
                    ),
                ));
            }
        }
        self.validate_recompute_and_lora()?;
        r.validate_lora_dtype(self.runtime, w.ranks)?;
        if !r.base_quant.is_none() && r.lora.is_none() {
            return Err(SpecError::invalid(
                "recipe.base_quant",
                format!(
                    "{} without LoRA: only a frozen base can be stored quantized; allowed: none, or a LoRA rank",
                    r.base_quant.name()
                ),
            ));
        }
        if r.zero_stage > 3 {
            return Err(SpecError::invalid(
                "recipe.zero_stage",
                format!("{} is not a ZeRO stage; allowed: 0, 1, 2, 3", r.zero_stage),
            ));
        }
        if r.zero_stage > 0 && w.ranks == 1 {
            return Err(SpecError::invalid(
                "recipe.zero_stage",
                format!(
                    "{} with one rank: ZeRO shards across ranks, with one it only adds overhead; \
                     allowed: 0 with one rank, 1–3 with workload.ranks > 1",
                    r.zero_stage
                ),
            ));
        }
        crate::sharder::validate(
            r.zero_stage,
            r.sharder,
            r.offload,
            r.gradient_as_bucket_view,
        )?;
        if r.ema.enabled && !(r.ema.decay > 0.0 && r.ema.decay < 1.0) {
            return Err(SpecError::invalid(
                "recipe.ema.decay",
                format!("{} is out of range; allowed: 0 < decay < 1", r.ema.decay),
            ));
        }
        if matches!(r.ema.dtype, Dtype::U8) {
            return Err(SpecError::invalid(
                "recipe.ema.dtype",
                "u8 cannot hold weights; allowed: f64, f32, bf16, f16",
            ));
        }
        self.validate_device_sections()
    }

    /// `recipe.recompute`'s block list and LoRA's rank and targets, against the model's depth and
    /// hidden size.
    fn validate_recompute_and_lora(&self) -> Result<(), SpecError> {
        let m = &self.model;
        let r = &self.recipe;
        // A diffusers model not yet resolved has no depth or hidden size to check against.
        let sized = m.diffusers.is_none() || (m.depth > 0 && m.hidden > 0);
        if let Recompute::Blocks(blocks) = &r.recompute {
            // Parsed lists are sorted and deduplicated; the replays look blocks up by bisection.
            if blocks.is_empty() || !blocks.windows(2).all(|p| p[0] < p[1]) {
                return Err(SpecError::invalid(
                    "recipe.recompute",
                    "lists no block, or blocks out of order or twice; allowed: blocks:I,J,… \
                     (increasing, each once)",
                ));
            }
            if let Some(bad) = blocks.iter().find(|&&b| sized && b >= m.depth) {
                return Err(SpecError::invalid(
                    "recipe.recompute",
                    format!(
                        "block {bad} does not exist; allowed: block indices 0..={}",
                        m.depth - 1
                    ),
                ));
            }
        }
        if let Some(lora) = &r.lora {
            if lora.rank == 0 || (sized && lora.rank > m.hidden) {
                return Err(SpecError::invalid(
                    "recipe.lora.rank",
                    format!(
                        "{} is out of range; allowed: 1..={} (the hidden size)",
                        lora.rank, m.hidden
                    ),
                ));
            }
            if lora.targets.is_empty() {
                return Err(SpecError::invalid(
                    "recipe.lora.targets",
                    "is empty; allowed: one or more of qkv, proj, fc1, fc2, adaln",
                ));
            }
        }
        Ok(())
    }

    /// The `cuda` and `cpu` sections: each only with a runtime that reads it.
    fn validate_device_sections(&self) -> Result<(), SpecError> {
        if self.cuda.is_some()
            && !matches!(
                self.runtime,
                Runtime::Pytorch {
                    device: TorchDevice::Cuda,
                    ..
                }
            )
        {
            return Err(SpecError::invalid(
                "cuda",
                format!(
                    "describes a CUDA device, but the runtime is {}; allowed: a cuda section only with runtime = \"pytorch:cuda\"",
                    self.runtime
                ),
            ));
        }
        if let Some(cpu) = &self.cpu {
            // pytorch:cpu reads its `threads` (torch's intra-op threads: per-thread scratch).
            let torch_cpu = matches!(
                self.runtime,
                Runtime::Pytorch {
                    device: TorchDevice::Cpu,
                    ..
                }
            );
            if self.runtime != Runtime::DitmemCpu && !torch_cpu {
                return Err(SpecError::invalid(
                    "cpu",
                    format!(
                        "describes the CPU of the ditmem-cpu engine or of pytorch:cpu, but the runtime is {}; allowed: a cpu section only with runtime = \"ditmem-cpu\" or \"pytorch:cpu\"",
                        self.runtime
                    ),
                ));
            }
            cpu.validate()?;
        }
        Ok(())
    }
}

fn in_range(field: &'static str, v: u32, max: u32) -> Result<(), SpecError> {
    if v == 0 || v > max {
        Err(SpecError::invalid(
            field,
            format!("{v} is out of range; allowed: 1..={max}"),
        ))
    } else {
        Ok(())
    }
}

fn positive(field: &'static str, v: u32) -> Result<(), SpecError> {
    if v == 0 {
        Err(SpecError::invalid(
            field,
            "is 0; allowed: a positive integer",
        ))
    } else {
        Ok(())
    }
}

fn probability(field: &'static str, p: f64) -> Result<(), SpecError> {
    if (0.0..1.0).contains(&p) {
        Ok(())
    } else {
        Err(SpecError::invalid(
            field,
            format!("{p} is out of range; allowed: 0 ≤ p < 1"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_that_would_overflow_byte_counts_are_refused() {
        let mut s = Spec::default_xl();
        s.workload.height = 1 << 20;
        s.workload.width = 1 << 20;
        assert_eq!(s.validate().unwrap_err().field(), Some("workload.height"));
        let mut s = Spec::default_xl();
        s.model.hidden = 1 << 24;
        s.model.heads = 1;
        assert_eq!(s.validate().unwrap_err().field(), Some("model.hidden"));
        assert!(Spec::default_xl().validate().is_ok());
        assert!(Spec::small().validate().is_ok());
    }

    #[test]
    fn zero_needs_more_than_one_rank() {
        let mut s = Spec::default_xl();
        s.recipe.zero_stage = 2;
        assert_eq!(s.validate().unwrap_err().field(), Some("recipe.zero_stage"));
        s.workload.ranks = 4;
        s.workload.microbatch = 8;
        assert!(s.validate().is_ok());
    }

    #[test]
    fn sizes_above_the_caps_are_refused_with_field_and_range() {
        type Set = fn(&mut Spec, u32);
        let cases: [(&str, u32, Set); 6] = [
            ("model.depth", MAX_DEPTH, |s, v| s.model.depth = v),
            ("model.mlp_ratio", MAX_MLP_RATIO, |s, v| {
                s.model.mlp_ratio = v
            }),
            ("model.freq_embed", MAX_FREQ_EMBED, |s, v| {
                s.model.freq_embed = v
            }),
            ("model.num_classes", MAX_NUM_CLASSES, |s, v| {
                s.model.num_classes = v
            }),
            ("workload.ranks", MAX_RANKS, |s, v| {
                s.workload.ranks = v;
                s.workload.batch = s.workload.microbatch.saturating_mul(v);
            }),
            ("workload.accumulation", MAX_ACCUMULATION, |s, v| {
                s.workload.microbatch = 1;
                s.workload.accumulation = v;
                s.workload.batch = v;
            }),
        ];
        for (field, max, set) in cases {
            let mut s = Spec::small();
            set(&mut s, max);
            assert!(s.validate().is_ok(), "{field} = {max} is allowed");
            for bad in [max + 1, u32::MAX] {
                let mut s = Spec::small();
                set(&mut s, bad);
                let e = s.validate().unwrap_err();
                assert_eq!(e.field(), Some(field), "{field} = {bad}: {e}");
                assert!(e.to_string().contains(&format!("1..={max}")), "{e}");
            }
        }
        // 16,777,216 blocks (issue 19) and tokens past the cap.
        let mut s = Spec::default_xl();
        s.model.depth = 16_777_216;
        assert_eq!(s.validate().unwrap_err().field(), Some("model.depth"));
        let mut s = Spec::small();
        s.workload.height = 16400;
        s.workload.width = 16400;
        s.workload.microbatch = 1;
        s.workload.batch = 1;
        let e = s.validate().unwrap_err();
        assert!(e.to_string().contains("tokens per image"), "{e}");
        let mut s = Spec::small();
        s.recipe.recompute = Recompute::Blocks(vec![1, 0]);
        assert_eq!(s.validate().unwrap_err().field(), Some("recipe.recompute"));
    }
}
