//! The DiT of the spec (facebookresearch/DiT `models.py`): parameter inventory with the PyTorch
//! names, deterministic initialisation, and the pieces of the forward pass outside the blocks
//! (patch embedding, fixed 2-D sin-cos positions, timestep and label embedders, final layer).
//!
//! [`param_shapes`] lists every parameter (name, shape, init, trainable) from the spec alone; the
//! trainer creates its tensors from that list, so the count test never allocates a big model.
//!
//! Initialisation (all drawn in f64 from `seed` and the parameter name, then cast, so every
//! precision policy starts from the same weights):
//! - linears: xavier-uniform, bias 0 (as DiT);
//! - `x_embedder.proj.weight`: xavier-uniform over the flattened (D, C·p·p) view (as DiT);
//! - `y_embedder.embedding_table.weight` and the timestep MLP weights: normal(0, 0.02) (as DiT);
//! - `pos_embed`: the fixed 2-D sin-cos table (frozen);
//! - adaLN modulation and `final_layer.linear` weights: DiT zero-initialises them, which makes
//!   most gradients exactly zero at step 0. Here they get normal(0, 0.02) instead (biases stay 0)
//!   so gradient verification is meaningful; shapes and counts are unchanged.
//! - LoRA: `lora_a` uniform(±1/√in), `lora_b` zero.

use candle_core::{DType, Device, Tensor};
use ditmem_spec::Spec;

use crate::error::{EngineError, Result};
use crate::rng::{seed_from_str, SplitMix64};
pub(crate) use crate::shapes::ParamShape;
pub use crate::shapes::{Dims, Init};

impl Dims {
    pub fn new(spec: &Spec) -> Result<Dims> {
        Ok(Dims::with_arch(spec)?.0)
    }

    /// The dims of `spec` and its model: the spec's own fields, and what a family's config says
    /// beyond them ([`crate::families::EngineFamily`]: output channels, frames, the MLP width).
    pub(crate) fn with_arch(spec: &Spec) -> Result<(Dims, crate::families::Arch)> {
        spec.validate()?;
        let m = &spec.model;
        let grid = spec.token_grid()?;
        let arch = crate::families::Arch::of(spec)?;
        let u = |v: u32| v as usize;
        let family = arch.family();
        let frames = family.frames();
        let dims = Dims {
            depth: u(m.depth),
            hidden: u(m.hidden),
            heads: u(m.heads),
            head_dim: u(m.head_dim()),
            mlp_hidden: family.mlp_hidden().unwrap_or(u(m.mlp_hidden())),
            patch: u(m.patch),
            in_channels: u(m.in_channels),
            out_channels: family.out_channels(spec),
            num_classes: u(m.num_classes),
            label_rows: u(m.label_rows()),
            freq: u(m.freq_embed),
            latent_h: u(grid.latent_h),
            latent_w: u(grid.latent_w),
            rows: u(grid.rows),
            cols: u(grid.cols),
            tokens: u(grid.rows) * u(grid.cols) * frames,
            frames,
        };
        Ok((dims, arch))
    }
}

/// Every parameter of the spec's model, in a fixed order (the DiT's: embedders, blocks, final
/// layer; a family's: the budget's table order), from the family ([`crate::families::EngineFamily`]).
pub fn param_shapes(spec: &Spec) -> Result<Vec<ParamShape>> {
    let (d, arch) = Dims::with_arch(spec)?;
    Ok(arch.family().param_shapes(spec, &d))
}

/// Total parameter count, including the frozen `pos_embed` (the number DiT's `train.py` logs;
/// for a family, its non-persistent position buffer too).
pub fn param_count(spec: &Spec) -> Result<u64> {
    Ok(param_shapes(spec)?.iter().map(ParamShape::numel).sum())
}

/// Parameters the optimizer updates.
pub fn trainable_count(spec: &Spec) -> Result<u64> {
    Ok(param_shapes(spec)?
        .iter()
        .filter(|p| p.trainable)
        .map(ParamShape::numel)
        .sum())
}

/// Initial values of one parameter in f64, deterministic from `seed` and its name.
pub(crate) fn init_values(p: &ParamShape, seed: u64) -> Result<Vec<f64>> {
    let n = p.numel() as usize;
    let mut rng = SplitMix64::new(seed_from_str(seed, &p.name));
    Ok(match p.init {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Rope3d { cos } => {
            crate::families::wan::params::rope_buffer(p.shape[1], p.shape[0], cos)
        }
        Init::Normal(std) => (0..n).map(|_| std * rng.normal()).collect(),
        Init::Uniform(b) => (0..n).map(|_| b * (2.0 * rng.uniform() - 1.0)).collect(),
        Init::XavierUniform => {
            let fan_out = p.shape[0] as f64;
            let fan_in = p.shape[1..].iter().product::<usize>() as f64;
            let b = (6.0 / (fan_in + fan_out)).sqrt();
            (0..n).map(|_| b * (2.0 * rng.uniform() - 1.0)).collect()
        }
        Init::SinCos2d { rows, cols } => sincos_2d(p.shape[1], rows, cols)?,
    })
}

/// The MAE/DiT 2-D sin-cos table, (rows·cols, dim) row-major: for the token at (r, c) the features
/// are [sin(c·ω), cos(c·ω), sin(r·ω), cos(r·ω)] with ω_k = 10000^(−k/(dim/4)).
pub(crate) fn sincos_2d(dim: usize, rows: usize, cols: usize) -> Result<Vec<f64>> {
    if !dim.is_multiple_of(4) {
        return Err(EngineError::unsupported(
            format!("model.hidden = {dim}"),
            "the 2-D sin-cos position table needs a hidden size divisible by 4",
        ));
    }
    let q = dim / 4;
    let omega: Vec<f64> = (0..q)
        .map(|k| 1.0 / 10000f64.powf(k as f64 / q as f64))
        .collect();
    let mut out = Vec::with_capacity(rows * cols * dim);
    for r in 0..rows {
        for c in 0..cols {
            for pos in [c as f64, r as f64] {
                out.extend(omega.iter().map(|w| (pos * w).sin()));
                out.extend(omega.iter().map(|w| (pos * w).cos()));
            }
        }
    }
    Ok(out)
}

/// The sinusoidal timestep features (b, F): cat[cos(t·f), sin(t·f)], f_k = e^(−ln(10000)·k/(F/2)).
pub fn timestep_features(t: &[u32], freq: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    let values: Vec<f64> = t.iter().map(|&ti| f64::from(ti)).collect();
    sinusoid_features(&values, freq, dtype, dev)
}

/// [`timestep_features`] of any values (diffusers' `Timesteps(256, flip_sin_to_cos=True,
/// downscale_freq_shift=0)`, which PixArt-α also applies to the image resolution and aspect
/// ratio: `PixArtAlphaCombinedTimestepSizeEmbeddings.additional_condition_proj`).
pub fn sinusoid_features(t: &[f64], freq: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    let half = freq / 2;
    let mut v = Vec::with_capacity(t.len() * freq);
    for &ti in t {
        let args: Vec<f64> = (0..half)
            .map(|k| {
                let a = ti * (-(10000f64.ln()) * k as f64 / half as f64).exp();
                if crate::mutation::active(crate::mutation::Mutation::TimestepEmbeddingBf16) {
                    ::half::bf16::from_f64(a).to_f64()
                } else {
                    a
                }
            })
            .collect();
        v.extend(args.iter().map(|a| a.cos()));
        v.extend(args.iter().map(|a| a.sin()));
    }
    Ok(Tensor::from_vec(v, (t.len(), freq), dev)?.to_dtype(dtype)?)
}

/// (b, C, H, W) → (b·T, C·p·p) with features ordered (c, py, px) like a flattened conv weight.
/// One contiguous copy.
pub fn patchify(x: &Tensor, d: &Dims) -> Result<Tensor> {
    let b = x.dim(0)?;
    let p = d.patch;
    let x = x.reshape(vec![b, d.in_channels, d.rows, p, d.cols, p])?;
    // → (b, rows, cols, C, py, px)
    let x = x.permute(vec![0, 2, 4, 1, 3, 5])?.contiguous()?;
    Ok(x.reshape((b * d.tokens, d.patch_in()))?)
}

/// (b·T, p·p·C_out) with features ordered (py, px, c) → (b, C_out, H, W). One contiguous copy.
pub fn unpatchify(x: &Tensor, b: usize, d: &Dims) -> Result<Tensor> {
    let p = d.patch;
    let x = x.reshape(vec![b, d.rows, d.cols, p, p, d.out_channels])?;
    // → (b, C_out, rows, py, cols, px)
    let x = x.permute(vec![0, 5, 1, 3, 2, 4])?.contiguous()?;
    Ok(x.reshape((b, d.out_channels, d.latent_h, d.latent_w))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patchify_roundtrip_order() {
        let spec = {
            let mut s = Spec::default_xl();
            s.model.depth = 1;
            s.model.hidden = 8;
            s.model.heads = 2;
            s.workload.height = 32;
            s.workload.width = 48;
            s.model.learn_sigma = false;
            s
        };
        let d = Dims::new(&spec).unwrap();
        let dev = Device::Cpu;
        let n = 2 * 4 * 4 * 6;
        let x = Tensor::arange(0f32, n as f32, &dev)
            .unwrap()
            .reshape((2, 4, 4, 6))
            .unwrap();
        let p = patchify(&x, &d).unwrap();
        assert_eq!(p.dims(), &[2 * 2 * 3, 16]);
        // token 0 of image 0, feature (c=1, py=0, px=1) = x[0,1,0,1]
        let v: Vec<f32> = p.get(0).unwrap().to_vec1().unwrap();
        assert_eq!(
            v[4 + 1],
            x.get(0)
                .unwrap()
                .get(1)
                .unwrap()
                .get(0)
                .unwrap()
                .get(1)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        );
        // unpatchify with features reordered (py, px, c) inverts patchify.
        let q = p
            .reshape((12, 4, 2, 2))
            .unwrap()
            .permute((0, 2, 3, 1))
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((12, 16))
            .unwrap();
        let back = unpatchify(&q, 2, &d).unwrap();
        let diff: f32 = (back - &x)
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        assert_eq!(diff, 0.0);
    }
}
