//! The frozen encoders that run inside a spec's step: the VAE encoder when latents are
//! encoded, and a family's text encoders when they are online or offloaded. Each runs without
//! gradient at the start of every microbatch, one after another, before the transformer's
//! forward; what each holds there is its forward transient ([`EncoderRun::forward_bytes`]) and,
//! when it is not resident, its weights.
//!
//! Dtypes: the original DiT's `train.py` encodes with an fp32 VAE outside autocast
//! ([`crate::precision_rules::vae_dtype`]); diffusers' training scripts move the VAE and the text
//! encoders to the device in `weight_dtype` (`vae.to(accelerator.device, dtype=weight_dtype)`,
//! `text_encoder_one.to(accelerator.device, dtype=weight_dtype)`: bf16 or fp16 under mixed
//! precision, fp32 otherwise).

use serde::Serialize;

use crate::denoiser::{family, text_tokens};
use crate::families::frozen::VAE16_ENCODER_PARAMS;
use crate::families::frozen::{self, VaeEncoder};
use crate::precision_rules::vae_dtype;
use crate::spec::{Dtype, Latents, Spec, TextEncoders, TorchDevice};

/// One frozen encoder of the step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EncoderRun {
    pub name: String,
    /// The class the scripts load (transformers or diffusers).
    pub class: &'static str,
    pub params: u64,
    pub dtype: Dtype,
    pub weight_bytes: u64,
    /// On the device for the whole step (false: offloaded, there only while it encodes).
    pub resident: bool,
    /// Its no-grad forward's transient above the weights, per microbatch.
    pub forward_bytes: u64,
    /// Input bytes the encode reads (the images of a microbatch for the VAE).
    pub input_bytes: u64,
    /// Floating-point operations of one microbatch's encode.
    pub flops: f64,
    /// Convolutions (a VAE: cuDNN, TF32 by default in fp32) rather than linears (matmuls).
    #[serde(skip)]
    pub conv: bool,
}

impl EncoderRun {
    /// What the encoder adds on the device while it encodes, beyond what is resident.
    pub(crate) fn while_encoding(&self) -> u64 {
        self.forward_bytes + self.input_bytes + if self.resident { 0 } else { self.weight_bytes }
    }
}

/// The encoders that run inside the step, in the order a microbatch runs them (the VAE, then
/// the text encoders in the family's order). Empty when latents and captions are cached.
pub(crate) fn encoder_runs(spec: &Spec) -> Vec<EncoderRun> {
    let mut out = Vec::new();
    let r = &spec.recipe;
    if r.latents == Latents::Cached && r.text_encoders == TextEncoders::Cached {
        // Nothing runs: the planner asks this for every point it evaluates, so the model's
        // config is not read again.
        return out;
    }
    let w = &spec.workload;
    let b = u64::from(w.microbatch);
    let fm = family(spec).ok().flatten();
    let cuda = matches!(&spec.runtime, crate::spec::Runtime::Pytorch { device, .. } if *device == TorchDevice::Cuda);
    let dtype = match &fm {
        None => vae_dtype(r.precision),
        Some(_) => weight_dtype(spec),
    };
    if r.latents == Latents::Encode {
        let vae = match &fm {
            Some(m) => frozen::vae_encoder(m),
            None => original_dit_vae(spec),
        };
        // The scripts that keep the VAE in fp32 whatever the precision:
        // train_dreambooth_sd3.py:1167 and train_dreambooth_lora_sd3.py:1237
        // (`vae.to(accelerator.device, dtype=torch.float32)`), train_dreambooth_lora_sana.py:1017.
        let fp32_vae = matches!(
            fm.as_ref().map(|m| m.family),
            Some(crate::families::Family::Sd3 | crate::families::Family::Sana)
        );
        let dtype = if fp32_vae && dtype.size() < 4 {
            Dtype::F32
        } else {
            dtype
        };
        let frames = u64::from(w.frames.max(1));
        let pixels = u64::from(w.height) * u64::from(w.width);
        out.push(EncoderRun {
            name: vae.name.to_string(),
            class: vae.class,
            params: vae.params,
            dtype,
            weight_bytes: vae.params * dtype.size(),
            resident: true,
            forward_bytes: vae.encode_bytes(b, frames, pixels, dtype.size()),
            // The images, in the VAE's dtype (3 channels).
            input_bytes: b * frames * 3 * pixels * dtype.size(),
            // 136 GMAC per 256² image for the SD VAE encoder (DiT's measurement, scaling with
            // the pixels), assumed for the other VAEs too.
            flops: 2.0 * 136e9 * (pixels * frames * b) as f64 / (256.0 * 256.0),
            conv: true,
        });
        // The scripts move the whole AutoencoderKL to the device, its decoder too, which the
        // step never runs (train_dreambooth_sd3.py:1167, train_dreambooth_flux.py:1207,
        // train_dreambooth_lora_sd3.py:1237, train_dreambooth_lora_flux.py:1244).
        if matches!(
            fm.as_ref().map(|m| m.family),
            Some(crate::families::Family::Sd3 | crate::families::Family::Flux)
        ) {
            out.push(EncoderRun {
                name: "SD3/Flux VAE decoder (resident, not run)".to_string(),
                class: "diffusers.AutoencoderKL",
                params: VAE16_DECODER_PARAMS,
                dtype,
                weight_bytes: VAE16_DECODER_PARAMS * dtype.size(),
                resident: true,
                forward_bytes: 0,
                input_bytes: 0,
                flops: 0.0,
                conv: true,
            });
        }
    }
    if r.text_encoders != TextEncoders::Cached {
        if let Some(m) = &fm {
            let tokens = text_tokens(spec, &m.geometry());
            for e in frozen::text_encoders(m) {
                let t = tokens.get(e.stream).copied().unwrap_or(0);
                out.push(EncoderRun {
                    name: e.name.to_string(),
                    class: e.class,
                    params: e.params,
                    dtype,
                    weight_bytes: e.params * dtype.size(),
                    resident: r.text_encoders == TextEncoders::Online,
                    forward_bytes: e.arch.forward_bytes(b, t, dtype.size(), cuda),
                    // Token ids (int64).
                    input_bytes: b * t * 8,
                    // Two FLOPs per multiplied weight per token.
                    flops: 2.0 * (e.params - e.embed_params) as f64 * (b * t) as f64,
                    conv: false,
                });
            }
        }
    }
    out
}

/// The decoder (and `post_quant_conv`: none in this VAE) of the SD3 / Flux AutoencoderKL
/// (f8c16: block_out_channels 128-256-512-512, 2 layers per block, 16 latent channels, no
/// quant convs): counted with diffusers 0.42.1 `AutoencoderKL(**config).decoder` (the encoder
/// counts 34,274,208, [`VAE16_ENCODER_PARAMS`]).
pub const VAE16_DECODER_PARAMS: u64 = 49_545_475;

/// Bytes of the encoders resident on the device for the whole step.
pub fn resident_bytes(runs: &[EncoderRun]) -> u64 {
    runs.iter()
        .filter(|e| e.resident)
        .map(|e| e.weight_bytes)
        .sum()
}

/// diffusers' `weight_dtype`: the compute dtype of mixed precision, the parameters' otherwise.
fn weight_dtype(spec: &Spec) -> Dtype {
    spec.recipe.precision.compute_dtype()
}

/// The VAE of the original DiT: SD's (4 latent channels) or, for a 16-channel model, the
/// SD3/Flux layout.
fn original_dit_vae(spec: &Spec) -> VaeEncoder {
    if spec.model.in_channels == 16 {
        VaeEncoder {
            name: "SD3/Flux VAE encoder (f8c16)",
            class: "AutoencoderKL",
            params: VAE16_ENCODER_PARAMS,
            peak_elems_per_pixel: frozen::SD_VAE_PEAK_ELEMS_PER_PIXEL,
            chunked_frames: false,
        }
    } else {
        VaeEncoder {
            name: "SD VAE encoder (f8c4)",
            class: "AutoencoderKL",
            params: frozen::SD_VAE_ENCODER_PARAMS,
            peak_elems_per_pixel: frozen::SD_VAE_PEAK_ELEMS_PER_PIXEL,
            chunked_frames: false,
        }
    }
}
