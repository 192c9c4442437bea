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
use crate::families::{FamilyModel, VaeOnDevice};
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
    let fm = family(spec).ok().flatten();
    let dtype = match &fm {
        None => vae_dtype(r.precision),
        Some(_) => weight_dtype(spec),
    };
    if r.latents == Latents::Encode {
        vae_runs(spec, fm.as_ref(), dtype, &mut out);
    }
    if r.text_encoders != TextEncoders::Cached {
        if let Some(m) = &fm {
            text_encoder_runs(spec, m, dtype, &mut out);
        }
    }
    out
}

/// The VAE's encoder, and the decoder the script keeps beside it on the device.
fn vae_runs(spec: &Spec, fm: Option<&FamilyModel>, dtype: Dtype, out: &mut Vec<EncoderRun>) {
    let r = &spec.recipe;
    let w = &spec.workload;
    let b = u64::from(w.microbatch);
    let vae = match fm {
        Some(m) => frozen::vae_encoder(m),
        None => original_dit_vae(spec),
    };
    let facts = fm.map(|m| m.family.facts());
    // The scripts that keep the VAE in fp32 whatever the precision (`FamilyFacts::fp32_vae`).
    let fp32_vae = facts.is_some_and(|f| f.fp32_vae);
    let dtype = if fp32_vae && dtype.size() < 4 {
        Dtype::F32
    } else {
        dtype
    };
    let frames = u64::from(w.frames.max(1));
    let pixels = u64::from(w.height) * u64::from(w.width);
    let on_device = facts.map_or(VaeOnDevice::Encoder, |f| f.vae_on_device);
    // train_dreambooth_lora_sana.py:1389-1393 moves the whole AutoencoderDC (its decoder
    // too) to the device to encode, and with --offload (how the export realises offloaded
    // text encoders, :629-631) back to the CPU after each encode.
    let dc_offload =
        on_device == VaeOnDevice::WholeAutoencoderDc && r.text_encoders == TextEncoders::Offloaded;
    let (name, params) = if dc_offload {
        (
            "DC-AE f32c32 encoder + decoder (moved in to encode: --offload)".to_string(),
            vae.params + DCAE_DECODER_PARAMS,
        )
    } else {
        (vae.name.to_string(), vae.params)
    };
    out.push(EncoderRun {
        name,
        class: vae.class,
        params,
        dtype,
        weight_bytes: params * dtype.size(),
        resident: !dc_offload,
        forward_bytes: vae.encode_bytes(b, frames, pixels, dtype.size()),
        // The images, in the VAE's dtype (3 channels).
        input_bytes: b * frames * 3 * pixels * dtype.size(),
        // 136 GMAC per 256² image for the SD VAE encoder (DiT's measurement, scaling with
        // the pixels), assumed for the other VAEs too.
        flops: 2.0 * 136e9 * (pixels * frames * b) as f64 / (256.0 * 256.0),
        conv: true,
    });
    match on_device {
        VaeOnDevice::Encoder => {}
        // The scripts move the whole AutoencoderKL to the device, its decoder too, which the
        // step never runs (train_dreambooth_sd3.py:1167, train_dreambooth_flux.py:1207,
        // train_dreambooth_lora_sd3.py:1237, train_dreambooth_lora_flux.py:1244).
        VaeOnDevice::WholeAutoencoderKl => out.push(EncoderRun::idle_decoder(
            "SD3/Flux VAE decoder (resident, not run)",
            "diffusers.AutoencoderKL",
            VAE16_DECODER_PARAMS,
            dtype,
        )),
        // Sana's AutoencoderDC stays whole on the device between encodes unless --offload
        // (train_dreambooth_lora_sana.py:1389-1393: `vae = vae.to(accelerator.device)`, fp32
        // from :1017); the step never runs its decoder.
        VaeOnDevice::WholeAutoencoderDc if !dc_offload => out.push(EncoderRun::idle_decoder(
            "DC-AE f32c32 decoder (resident, not run)",
            "diffusers.AutoencoderDC",
            DCAE_DECODER_PARAMS,
            dtype,
        )),
        VaeOnDevice::WholeAutoencoderDc => {}
    }
}

/// The family's text encoders, in its order, each on its stream's tokens.
fn text_encoder_runs(spec: &Spec, m: &FamilyModel, dtype: Dtype, out: &mut Vec<EncoderRun>) {
    let r = &spec.recipe;
    let b = u64::from(spec.workload.microbatch);
    let cuda = matches!(&spec.runtime, crate::spec::Runtime::Pytorch { device, .. } if *device == TorchDevice::Cuda);
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

impl EncoderRun {
    /// A VAE decoder the script keeps on the device and the step never runs: its weights only.
    fn idle_decoder(name: &str, class: &'static str, params: u64, dtype: Dtype) -> EncoderRun {
        EncoderRun {
            name: name.to_string(),
            class,
            params,
            dtype,
            weight_bytes: params * dtype.size(),
            resident: true,
            forward_bytes: 0,
            input_bytes: 0,
            flops: 0.0,
            conv: true,
        }
    }
}

/// The decoder (and `post_quant_conv`: none in this VAE) of the SD3 / Flux AutoencoderKL
/// (f8c16: block_out_channels 128-256-512-512, 2 layers per block, 16 latent channels, no
/// quant convs): counted with diffusers 0.42.1 `AutoencoderKL(**config).decoder` (the encoder
/// counts 34,274,208, [`VAE16_ENCODER_PARAMS`]).
pub(crate) const VAE16_DECODER_PARAMS: u64 = 49_545_475;

/// The decoder of Sana's DC-AE f32c32 (`AutoencoderDC` with the `dc-ae-f32c32-sana-1.0`
/// config): counted with diffusers 0.42.1 by `bench/torch_peer/count_frozen.py` (`dc.decoder`;
/// the encoder counts 153,027,104, [`frozen::DCAE_ENCODER_PARAMS`]).
pub(crate) const DCAE_DECODER_PARAMS: u64 = 159_223_171;

/// Bytes of the encoders resident on the device for the whole step.
pub(crate) fn resident_bytes(runs: &[EncoderRun]) -> u64 {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Precision;

    fn sana(text_encoders: TextEncoders, latents: Latents) -> Spec {
        let map =
            serde_json::from_str(crate::families::preset_config("sana-1600m").unwrap()).unwrap();
        let mut s = crate::denoiser::with_family(Spec::default_xl(), "sana-1600m", map).unwrap();
        s.recipe.precision = Precision::Bf16Mixed;
        s.recipe.text_encoders = text_encoders;
        s.recipe.latents = latents;
        s
    }

    #[test]
    fn sanas_dcae_decoder_stays_on_the_device_unless_offloaded() {
        // Encoding every step, Gemma-2 online: the whole AutoencoderDC in fp32, its decoder
        // resident beside the encoder.
        let runs = encoder_runs(&sana(TextEncoders::Online, Latents::Encode));
        let dec = runs.iter().find(|e| e.name.contains("decoder")).unwrap();
        assert_eq!(dec.weight_bytes, 159_223_171 * 4);
        assert!(dec.resident && dec.forward_bytes == 0);
        assert_eq!(
            resident_bytes(&runs),
            (frozen::DCAE_ENCODER_PARAMS + DCAE_DECODER_PARAMS) * 4 + frozen::GEMMA2_2B_PARAMS * 2
        );
        // --offload: the VAE comes in whole to encode and goes back to the CPU.
        let runs = encoder_runs(&sana(TextEncoders::Offloaded, Latents::Encode));
        assert_eq!(runs.iter().filter(|e| e.conv).count(), 1);
        let vae = &runs[0];
        assert!(!vae.resident);
        assert_eq!(
            vae.weight_bytes,
            (153_027_104 + 159_223_171) * 4,
            "encoder and decoder while encoding"
        );
        assert_eq!(resident_bytes(&runs), 0);
        // Cached latents: no VAE in the step.
        let runs = encoder_runs(&sana(TextEncoders::Online, Latents::Cached));
        assert!(runs.iter().all(|e| !e.conv));
    }
}
