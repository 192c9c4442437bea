//! The frozen parts of each family's training pipeline: the text encoders and the VAE encoder
//! that turn a caption and an image into what the transformer reads. They hold no gradient and
//! no optimizer state, but when they run inside the step (text encoders `online`, latents
//! `encode`) their weights sit on the device beside the transformer and their no-grad forward
//! adds a transient at the start of each microbatch.
//!
//! Parameter counts: the transformers / diffusers classes the training scripts load, built on
//! the meta device from the published configs by `bench/torch_peer/count_frozen.py` (transformers
//! 5.24, diffusers 0.42.1) — T5-XXL and umT5-XXL encoders (`T5EncoderModel`,
//! `UMT5EncoderModel`), CLIP-L (`CLIPTextModel`; SD3 loads it `WithProjection`), OpenCLIP
//! bigG (`CLIPTextModelWithProjection`), Gemma-2-2B (`Gemma2Model`), the SD VAE and the 16-channel
//! SD3/Flux VAE (`AutoencoderKL`: encoder, plus `quant_conv` where the config has one), Sana's
//! DC-AE f32c32 (`AutoencoderDC` with efficientvit's `dc-ae-f32c32-sana-1.0` config) and Wan
//! 2.1's `AutoencoderKLWan` (encoder and `quant_conv`).
//!
//! Forward transients: see [`EncoderArch::forward_bytes`] and [`VaeEncoder::encode_bytes`].

use super::model::{Dims, FamilyModel};

/// The layer shapes of a text encoder that its no-grad forward's transient follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderArch {
    /// T5 / umT5 encoder (transformers `T5Block`: RMS `T5LayerNorm` in fp32, self-attention with
    /// a relative position bias of (batch, heads, T, T) built once and added to every layer's
    /// scores, gated-GELU feed-forward `wi_0`, `wi_1`, `wo`).
    T5 { d: u64, ff: u64, heads: u64 },
    /// CLIP text transformer (`CLIPEncoderLayer`: LayerNorm, causal self-attention, fc1 → GELU
    /// → fc2). CLIP-L's `quick_gelu` (`x * sigmoid(1.702 * x)`) holds three fc1-sized
    /// temporaries beside fc1's output; bigG's exact GELU one.
    Clip {
        d: u64,
        ff: u64,
        heads: u64,
        quick_gelu: bool,
    },
    /// Gemma-2 decoder as an encoder (`Gemma2DecoderLayer`: RMSNorm, grouped-query attention with
    /// soft-capped scores — transformers runs it `eager`, materialising them — gated MLP).
    Gemma2 {
        d: u64,
        ff: u64,
        heads: u64,
        kv_heads: u64,
        head_dim: u64,
    },
}

/// The scores SDPA materialises on the CPU, where it falls back to the math kernel (a float or
/// causal mask): `elems` scores in the weights' dtype (`elem` bytes) and their fp32 softmax;
/// none on CUDA, whose fused kernels keep them on chip.
fn math_sdpa_scores(cuda: bool, elems: u64, elem: u64) -> u64 {
    if cuda {
        0
    } else {
        elems * (elem + 4)
    }
}

impl EncoderArch {
    /// Bytes the no-grad forward of one layer holds above the weights at its highest point, for
    /// `batch` captions of `tokens` tokens with weights (and activations) of `elem` bytes: the
    /// residual stream and its normed copy, then the larger of the attention (q, k, v and the
    /// scores where they are materialised: eager attention, the T5 position bias, and on the CPU
    /// the math kernel SDPA falls back to for a float mask) and the feed-forward (three
    /// intermediate tensors when gated — both projections and their product — two otherwise).
    /// The largest terms of each layer, read from the transformers modelling code; held
    /// against the CPU peer (`bench/torch_peer/frozen_peak.py`) in
    /// `crates/budget/tests/frozen_encoders.rs`, where the tiny encoders' fixed costs (masks,
    /// bias tables) dominate and the rule is within the error stated there.
    pub fn forward_bytes(&self, batch: u64, tokens: u64, elem: u64, cuda: bool) -> u64 {
        let bt = batch * tokens;
        let tt = batch * tokens * tokens;
        let (stream, attn, ffn) = match *self {
            EncoderArch::T5 { d, ff, heads } => {
                // The position bias (dtype) lives across every layer; on the CPU SDPA's math
                // path materialises the scores and their fp32 softmax beside it.
                let bias = heads * tt * elem;
                let scores = math_sdpa_scores(cuda, heads * tt, elem);
                // T5LayerNorm: `hidden_states.to(float32).pow(2)` — two fp32 copies.
                let norm = 2 * bt * d * 4;
                (
                    2 * bt * d * elem + bias,
                    3 * bt * d * elem + scores + norm,
                    3 * bt * ff * elem,
                )
            }
            EncoderArch::Clip {
                d,
                ff,
                heads,
                quick_gelu,
            } => {
                // SDPA with the causal mask: fused on CUDA, the math path on the CPU. The MLP
                // is the layer's high point (measured: exactly fc1's output and the three
                // `quick_gelu` temporaries, the residual stream already released).
                let scores = math_sdpa_scores(cuda, heads * tt, elem);
                let act = if quick_gelu { 4 } else { 2 };
                (0, 3 * bt * d * elem + scores, act * bt * ff * elem)
            }
            EncoderArch::Gemma2 {
                d,
                ff,
                heads,
                kv_heads,
                head_dim,
            } => {
                // Eager attention on every device: scores, their soft-capped copy and the fp32
                // softmax.
                let scores = heads * tt * (2 * elem + 4);
                let qkv = bt * (heads + 2 * kv_heads) * head_dim * elem;
                (2 * bt * d * elem, qkv + scores, 3 * bt * ff * elem)
            }
        };
        stream + attn.max(ffn)
    }
}

/// One frozen text encoder of a family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextEncoderModel {
    pub name: &'static str,
    /// The transformers class the scripts load.
    pub class: &'static str,
    pub params: u64,
    /// Of which the token (and position) embedding tables: looked up, not multiplied.
    pub embed_params: u64,
    pub arch: EncoderArch,
    /// Which of the family's text streams ([`super::Geometry::text`]) gives its token count.
    pub stream: usize,
}

/// A family's VAE encoder (what `vae.encode` runs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VaeEncoder {
    pub name: &'static str,
    pub class: &'static str,
    pub params: u64,
    /// The no-grad encode's peak above the weights, in elements of the VAE's dtype per input
    /// pixel (per frame, unless the encode is chunked): the slope between two sizes measured by
    /// `bench/torch_peer/vae_peak.py` (CPU, torch 2.15, diffusers 0.42.1, fp32; the fixed part
    /// of the smaller size — oneDNN weight reorders, the mid block — left out).
    pub peak_elems_per_pixel: u64,
    /// Video VAEs that encode a clip in chunks of frames with a cache of the previous ones
    /// (Wan: the first frame, then 4 at a time): the peak stops growing with the frames.
    pub chunked_frames: bool,
}

impl VaeEncoder {
    /// Bytes of one encode of `batch` images (× `frames`) of `pixels` each, in `elem`-byte
    /// activations.
    pub(crate) fn encode_bytes(&self, batch: u64, frames: u64, pixels: u64, elem: u64) -> u64 {
        let frames = if self.chunked_frames { 1 } else { frames };
        batch * frames * pixels * self.peak_elems_per_pixel * elem
    }
}

const T5_XXL: EncoderArch = EncoderArch::T5 {
    d: 4096,
    ff: 10240,
    heads: 64,
};

/// `T5EncoderModel` of google/t5-v1_1-xxl (PixArt, SD3, Flux).
pub const T5_XXL_PARAMS: u64 = 4_762_310_656;
/// `UMT5EncoderModel` of google/umt5-xxl (Wan 2.1).
pub(crate) const UMT5_XXL_PARAMS: u64 = 5_680_910_336;
/// `CLIPTextModel` of openai/clip-vit-large-patch14 (Flux's pooled CLIP-L).
pub const CLIP_L_PARAMS: u64 = 123_060_480;
/// `CLIPTextModelWithProjection` of CLIP-L (SD3's `text_encoder`).
pub(crate) const CLIP_L_PROJ_PARAMS: u64 = 123_650_304;
/// `CLIPTextModelWithProjection` of OpenCLIP ViT-bigG/14 (SD3's `text_encoder_2`).
pub(crate) const CLIP_G_PROJ_PARAMS: u64 = 694_659_840;
/// CLIP-L's token and position embeddings: (49,408 + 77) × 768.
const CLIP_L_EMBED_PARAMS: u64 = 38_004_480;
/// `Gemma2Model` of google/gemma-2-2b-it (Sana).
pub(crate) const GEMMA2_2B_PARAMS: u64 = 2_614_341_888;

/// The SD VAE encoder (f8c4, with `quant_conv`): DiT, PixArt.
pub(crate) const SD_VAE_ENCODER_PARAMS: u64 = 34_163_664;
/// The SD3 / Flux VAE encoder (f8c16, no `quant_conv`).
pub const VAE16_ENCODER_PARAMS: u64 = 34_274_208;
/// Sana's DC-AE f32c32 encoder.
pub const DCAE_ENCODER_PARAMS: u64 = 153_027_104;
/// Wan 2.1's VAE encoder (causal 3-D, f8 × t4, c16, with `quant_conv`).
pub const WAN_VAE_ENCODER_PARAMS: u64 = 53_596_928;

/// The text encoders a family's pipeline runs, in its order.
pub fn text_encoders(m: &FamilyModel) -> Vec<TextEncoderModel> {
    let t5 = |stream| TextEncoderModel {
        name: "T5-XXL encoder",
        class: "T5EncoderModel",
        params: T5_XXL_PARAMS,
        // 32,128 × 4,096.
        embed_params: 131_596_288,
        arch: T5_XXL,
        stream,
    };
    let clip_l = EncoderArch::Clip {
        d: 768,
        ff: 3072,
        heads: 12,
        quick_gelu: true,
    };
    match &m.dims {
        Dims::Dit(_) | Dims::DitDiffusers(_) => Vec::new(),
        Dims::Pixart(_) => vec![t5(0)],
        Dims::Sd3(_) => vec![
            TextEncoderModel {
                name: "CLIP-L",
                class: "CLIPTextModelWithProjection",
                params: CLIP_L_PROJ_PARAMS,
                embed_params: CLIP_L_EMBED_PARAMS,
                arch: clip_l,
                stream: 0,
            },
            TextEncoderModel {
                name: "OpenCLIP bigG",
                class: "CLIPTextModelWithProjection",
                params: CLIP_G_PROJ_PARAMS,
                // (49,408 + 77) × 1,280.
                embed_params: 63_340_800,
                arch: EncoderArch::Clip {
                    d: 1280,
                    ff: 5120,
                    heads: 20,
                    quick_gelu: false,
                },
                stream: 0,
            },
            t5(1),
        ],
        Dims::Flux(_) => vec![
            TextEncoderModel {
                name: "CLIP-L",
                class: "CLIPTextModel",
                params: CLIP_L_PARAMS,
                embed_params: CLIP_L_EMBED_PARAMS,
                arch: clip_l,
                stream: 0,
            },
            t5(1),
        ],
        Dims::Sana(_) => vec![TextEncoderModel {
            name: "Gemma-2-2B",
            class: "Gemma2Model",
            params: GEMMA2_2B_PARAMS,
            // 256,000 × 2,304.
            embed_params: 589_824_000,
            arch: EncoderArch::Gemma2 {
                d: 2304,
                ff: 9216,
                heads: 8,
                kv_heads: 4,
                head_dim: 256,
            },
            stream: 0,
        }],
        Dims::Wan(_) => vec![TextEncoderModel {
            name: "umT5-XXL encoder",
            class: "UMT5EncoderModel",
            params: UMT5_XXL_PARAMS,
            // 256,384 × 4,096.
            embed_params: 1_050_148_864,
            arch: T5_XXL,
            stream: 0,
        }],
    }
}

/// The VAE encoder a family reads latents from.
pub fn vae_encoder(m: &FamilyModel) -> VaeEncoder {
    match &m.dims {
        Dims::Dit(_) | Dims::DitDiffusers(_) | Dims::Pixart(_) => VaeEncoder {
            name: "SD VAE encoder (f8c4)",
            class: "AutoencoderKL",
            params: SD_VAE_ENCODER_PARAMS,
            peak_elems_per_pixel: SD_VAE_PEAK_ELEMS_PER_PIXEL,
            chunked_frames: false,
        },
        Dims::Sd3(_) | Dims::Flux(_) => VaeEncoder {
            name: "SD3/Flux VAE encoder (f8c16)",
            class: "AutoencoderKL",
            params: VAE16_ENCODER_PARAMS,
            peak_elems_per_pixel: SD_VAE_PEAK_ELEMS_PER_PIXEL,
            chunked_frames: false,
        },
        Dims::Sana(_) => VaeEncoder {
            name: "DC-AE f32c32 encoder",
            class: "AutoencoderDC",
            params: DCAE_ENCODER_PARAMS,
            peak_elems_per_pixel: DCAE_PEAK_ELEMS_PER_PIXEL,
            chunked_frames: false,
        },
        Dims::Wan(_) => VaeEncoder {
            name: "Wan-VAE encoder (f8 × t4, c16)",
            class: "AutoencoderKLWan",
            params: WAN_VAE_ENCODER_PARAMS,
            peak_elems_per_pixel: WAN_VAE_PEAK_ELEMS_PER_PIXEL,
            chunked_frames: true,
        },
    }
}

/// The SD VAE encoder and the 16-channel SD3/Flux one (same blocks): 128² → 256², fp32:
/// 42,532,864 → 168,361,984 B, 640 elements per pixel — five 128-channel tensors at full
/// resolution (conv_in's output and a ResnetBlock2D's norm, SiLU and conv outputs).
pub(crate) const SD_VAE_PEAK_ELEMS_PER_PIXEL: u64 = 640;
/// DC-AE f32c32: its first stage is the same 128-channel ResBlock at full resolution; measured
/// 642 elements per pixel at 256² in fp32 (the 128² figure carries a 38 MB weight reorder of
/// oneDNN's CPU convolution, absent on CUDA).
pub(crate) const DCAE_PEAK_ELEMS_PER_PIXEL: u64 = 640;
/// Wan-VAE, per pixel of one frame for a whole clip of ≥ 9 frames (the peak is the same at 9 and
/// 17 frames: 78,382,080 and 78,398,464 B at 64²): 64² → 128², 9 frames, fp32:
/// 78,382,080 → 259,061,760 B, 3,676 elements per pixel.
pub const WAN_VAE_PEAK_ELEMS_PER_PIXEL: u64 = 3676;
