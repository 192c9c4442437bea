//! The diffusion objective and the data: DDPM linear betas (1e-4 … 0.02 over 1000 steps),
//! x_t = √ᾱ_t·x₀ + √(1−ᾱ_t)·ε, and the target ε (default) or v = √ᾱ_t·ε − √(1−ᾱ_t)·x₀.
//!
//! A [`Batch`] holds everything random about a training step in f64 (latents, noise, timesteps,
//! labels, which labels are dropped), drawn from a seed per sample, so the same batch gives the
//! same inputs under every precision policy and a batch split into microbatches is exactly the
//! concatenation of its parts. x_t and the target are formed in f64 on the host and then cast.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use ditmem_spec::{Prediction, Spec};

use crate::error::{EngineError, Result};
use crate::model::Dims;
use crate::rng::{derive_seed, SplitMix64};

/// Diffusion steps of DiT's training schedule.
pub(crate) const NUM_TIMESTEPS: usize = 1000;

/// ᾱ_t for the linear beta schedule 1e-4 … 0.02 over [`NUM_TIMESTEPS`] steps.
pub fn alphas_cumprod() -> Vec<f64> {
    let (b0, b1) = (1e-4, 0.02);
    let n = NUM_TIMESTEPS;
    let mut acc = 1.0;
    (0..n)
        .map(|i| {
            let beta = b0 + (b1 - b0) * i as f64 / (n - 1) as f64;
            acc *= 1.0 - beta;
            acc
        })
        .collect()
}

/// The inputs of one optimizer step (or a part of one).
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Samples in the batch.
    pub n: usize,
    /// Elements of one latent: C·F·H·W.
    pub sample_len: usize,
    pub channels: usize,
    /// Latent frames of a video latent (1 for an image: the latents are then (n, C, H, W)).
    pub frames: usize,
    pub height: usize,
    pub width: usize,
    /// Clean latents x₀, (n, C, H, W) row-major.
    pub latents: Vec<f64>,
    /// Noise ε, same layout.
    pub noise: Vec<f64>,
    /// Timesteps in 0..1000.
    pub timesteps: Vec<u32>,
    /// Class labels in 0..K.
    pub labels: Vec<u32>,
    /// Labels replaced by the null class (label dropout for classifier-free guidance).
    pub drop_label: Vec<bool>,
    /// Caption tokens per sample (0 for a model without text).
    pub text_tokens: usize,
    /// Width of one cached text embedding.
    pub text_width: usize,
    /// Cached text embeddings, (n, T, width) row-major (empty without text).
    pub text: Vec<f64>,
    /// Width of one cached pooled text embedding (SD3's CLIP pooled outputs, Flux's CLIP-L; 0
    /// without one).
    pub pooled_width: usize,
    /// Cached pooled text embeddings, (n, pooled_width) row-major.
    pub pooled: Vec<f64>,
}

impl Batch {
    /// Samples `start .. start + len`.
    pub fn slice(&self, start: usize, len: usize) -> Result<Batch> {
        if start + len > self.n || len == 0 {
            return Err(EngineError::bad_input(
                "batch slice",
                format!("{start}..{} is outside 0..{}", start + len, self.n),
            ));
        }
        let e = self.sample_len;
        Ok(Batch {
            n: len,
            latents: self.latents[start * e..(start + len) * e].to_vec(),
            noise: self.noise[start * e..(start + len) * e].to_vec(),
            timesteps: self.timesteps[start..start + len].to_vec(),
            labels: self.labels[start..start + len].to_vec(),
            drop_label: self.drop_label[start..start + len].to_vec(),
            text: self.text[start * self.text_len()..(start + len) * self.text_len()].to_vec(),
            pooled: self.pooled[start * self.pooled_width..(start + len) * self.pooled_width]
                .to_vec(),
            ..self.clone_meta()
        })
    }

    fn clone_meta(&self) -> Batch {
        Batch {
            n: self.n,
            sample_len: self.sample_len,
            channels: self.channels,
            frames: self.frames,
            height: self.height,
            width: self.width,
            latents: Vec::new(),
            noise: Vec::new(),
            timesteps: Vec::new(),
            labels: Vec::new(),
            drop_label: Vec::new(),
            text_tokens: self.text_tokens,
            text_width: self.text_width,
            text: Vec::new(),
            pooled_width: self.pooled_width,
            pooled: Vec::new(),
        }
    }

    /// Text elements per sample: T·width.
    pub(crate) fn text_len(&self) -> usize {
        self.text_tokens * self.text_width
    }

    /// The cached text embeddings as (n·T, width) in `dtype` (made in f64, then cast).
    pub fn text_tensor(&self, dtype: DType, dev: &Device) -> Result<Tensor> {
        let t = Tensor::from_slice(
            &self.text,
            (self.n * self.text_tokens, self.text_width),
            dev,
        )?;
        Ok(t.to_dtype(dtype)?)
    }

    /// The cached pooled text embeddings as (n, pooled_width) in `dtype` (made in f64, then
    /// cast).
    pub fn pooled_tensor(&self, dtype: DType, dev: &Device) -> Result<Tensor> {
        let t = Tensor::from_slice(&self.pooled, (self.n, self.pooled_width), dev)?;
        Ok(t.to_dtype(dtype)?)
    }

    /// Check the batch against the model geometry.
    pub fn check(&self, d: &Dims) -> Result<()> {
        let ok = self.channels == d.in_channels
            && self.frames == d.frames
            && self.height == d.latent_h
            && self.width == d.latent_w
            && self.latents.len() == self.n * self.sample_len
            && self.noise.len() == self.n * self.sample_len
            && self.timesteps.len() == self.n
            && self.labels.len() == self.n
            && self.drop_label.len() == self.n
            && self.text.len() == self.n * self.text_len()
            && self.pooled.len() == self.n * self.pooled_width;
        if !ok {
            return Err(EngineError::bad_input(
                "batch",
                format!(
                    "expected latents of {}×{}×{} with one timestep/label per sample; got {} samples of {}×{}×{}",
                    d.in_channels, d.latent_h, d.latent_w, self.n, self.channels, self.height, self.width
                ),
            ));
        }
        if let Some(t) = self
            .timesteps
            .iter()
            .find(|&&t| t as usize >= NUM_TIMESTEPS)
        {
            return Err(EngineError::bad_input(
                "batch timesteps",
                format!("{t} is not in 0..{NUM_TIMESTEPS}"),
            ));
        }
        if let Some(y) = self.labels.iter().find(|&&y| y as usize >= d.num_classes) {
            return Err(EngineError::bad_input(
                "batch labels",
                format!("{y} is not in 0..{}", d.num_classes),
            ));
        }
        Ok(())
    }

    /// Per sample i with ᾱ = `acp[t_i]`: `√ᾱ·x + sign·√(1−ᾱ)·y` over the sample's elements.
    fn mix(&self, acp: &[f64], x: &[f64], y: &[f64], sign: f64) -> Vec<f64> {
        let e = self.sample_len;
        let mut v = Vec::with_capacity(self.n * e);
        for i in 0..self.n {
            let a = acp[self.timesteps[i] as usize];
            let (sa, sb) = (a.sqrt(), sign * (1.0 - a).sqrt());
            for j in i * e..(i + 1) * e {
                v.push(sa * x[j] + sb * y[j]);
            }
        }
        v
    }

    /// (n, C, H, W) in `dtype`; (n, C, F, H, W) for a video latent.
    fn tensor(&self, v: Vec<f64>, dtype: DType, dev: &Device) -> Result<Tensor> {
        let (n, c, h, w) = (self.n, self.channels, self.height, self.width);
        let t = if self.frames == 1 {
            Tensor::from_vec(v, (n, c, h, w), dev)?
        } else {
            Tensor::from_vec(v, (n, c, self.frames, h, w), dev)?
        };
        Ok(t.to_dtype(dtype)?)
    }

    /// x_t = √ᾱ·x₀ + √(1−ᾱ)·ε, (n, C, H, W) in `dtype`.
    pub fn noisy(&self, acp: &[f64], dtype: DType, dev: &Device) -> Result<Tensor> {
        self.tensor(self.mix(acp, &self.latents, &self.noise, 1.0), dtype, dev)
    }

    /// The regression target (n, C, H, W) in `dtype`: ε, or v = √ᾱ·ε − √(1−ᾱ)·x₀.
    pub fn target(
        &self,
        acp: &[f64],
        prediction: Prediction,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let v = match prediction {
            Prediction::Eps => self.noise.clone(),
            Prediction::V => self.mix(acp, &self.noise, &self.latents, -1.0),
        };
        self.tensor(v, dtype, dev)
    }
}

/// Deterministic synthetic data for a spec: latents ~ N(0, 1)·`latent_scale`, labels uniform over
/// the classes, t uniform over 0..1000, noise N(0, 1), label dropout with the spec's probability.
#[derive(Debug, Clone)]
pub struct SyntheticData {
    pub seed: u64,
    pub latent_scale: f64,
    channels: usize,
    /// Latent frames (1 for images).
    frames: usize,
    height: usize,
    width: usize,
    num_classes: u32,
    class_dropout: f64,
    /// Caption tokens and width of the cached text embeddings (0 without text).
    text_tokens: usize,
    text_width: usize,
    /// Width of the cached pooled text embedding (0 without one).
    pooled_width: usize,
    /// Samples per optimizer step on one rank: microbatch × accumulation.
    pub per_step: usize,
}

impl SyntheticData {
    pub fn new(spec: &Spec, seed: u64) -> Result<Self> {
        let d = Dims::new(spec)?;
        let w = &spec.workload;
        let (text_tokens, text_width, pooled_width) =
            crate::families::Arch::of(spec)?.family().text_inputs();
        Ok(SyntheticData {
            pooled_width,
            text_tokens,
            text_width,
            seed,
            latent_scale: 1.0,
            channels: d.in_channels,
            frames: d.frames,
            height: d.latent_h,
            width: d.latent_w,
            num_classes: spec.model.num_classes,
            class_dropout: spec.model.class_dropout_prob,
            per_step: (w.microbatch as usize) * (w.accumulation as usize),
        })
    }

    /// One sample; the same (seed, index) always gives the same sample.
    fn sample(&self, index: u64, b: &mut Batch) {
        let mut r = SplitMix64::new(derive_seed(self.seed, &[0xDA7A, index]));
        let e = self.sample_len();
        b.latents
            .extend((0..e).map(|_| self.latent_scale * r.normal()));
        b.noise.extend((0..e).map(|_| r.normal()));
        b.timesteps.push(r.below(NUM_TIMESTEPS as u64) as u32);
        b.labels.push(r.below(u64::from(self.num_classes)) as u32);
        b.drop_label.push(r.uniform() < self.class_dropout);
        // Text embeddings ~ N(0, 1), drawn after the DiT's fields (which stay as they were).
        b.text
            .extend((0..self.text_tokens * self.text_width).map(|_| r.normal()));
        // The pooled embedding after the caption (models without one draw nothing).
        b.pooled.extend((0..self.pooled_width).map(|_| r.normal()));
    }

    /// Elements of one latent: C·F·H·W.
    fn sample_len(&self) -> usize {
        self.channels * self.frames * self.height * self.width
    }

    /// Samples `first .. first + n`.
    pub(crate) fn batch_at(&self, first: u64, n: usize) -> Batch {
        let mut b = Batch {
            n,
            sample_len: self.sample_len(),
            channels: self.channels,
            frames: self.frames,
            height: self.height,
            width: self.width,
            // Exact capacities: the batch is part of the measured step, byte for byte.
            latents: Vec::with_capacity(n * self.sample_len()),
            noise: Vec::with_capacity(n * self.sample_len()),
            timesteps: Vec::with_capacity(n),
            labels: Vec::with_capacity(n),
            drop_label: Vec::with_capacity(n),
            text_tokens: self.text_tokens,
            text_width: self.text_width,
            text: Vec::with_capacity(n * self.text_tokens * self.text_width),
            pooled_width: self.pooled_width,
            pooled: Vec::with_capacity(n * self.pooled_width),
        };
        for i in 0..n as u64 {
            self.sample(first + i, &mut b);
        }
        b
    }

    /// The batch of optimizer step `step` (microbatch × accumulation samples).
    pub fn step_batch(&self, step: u64) -> Batch {
        self.batch_at(step * self.per_step as u64, self.per_step)
    }
}

/// Most bytes of latent files `--latents-dir` reads, every file together: 1 GiB. The engine holds
/// every sample it reads (as f64, twice an f32 file's bytes) beside the step; the cap keeps a
/// huge file, `/dev/zero` behind a link or a runaway folder from filling memory before the guard.
pub(crate) const MAX_LATENTS_BYTES: u64 = 1 << 30;

/// Most dimensions of an `.npy` array read as latents (numpy's own limit is 32; a stack of
/// latents has 4 or 5).
pub(crate) const MAX_NPY_DIMS: usize = 8;

/// The latent files of `dir` (`.safetensors` and `.npy`, sorted by name), each checked before
/// it is opened: a regular file (a link to one is fine), and the total at most
/// [`MAX_LATENTS_BYTES`]. A FIFO, socket or device is refused without opening it (a FIFO would
/// block the reader until a writer comes).
pub fn latent_files(dir: &Path) -> Result<Vec<(std::path::PathBuf, u64)>> {
    let derr = |why: String| EngineError::Data {
        path: dir.display().to_string(),
        why,
    };
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| derr(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension()
                .is_some_and(|e| e == "safetensors" || e == "npy")
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(derr("no .safetensors or .npy files".into()));
    }
    let mut total = 0u64;
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        let meta = std::fs::metadata(&f).map_err(|e| derr(format!("{}: {e}", f.display())))?;
        if !meta.file_type().is_file() {
            return Err(derr(format!(
                "{} is {}; allowed: regular files",
                f.display(),
                file_kind(meta.file_type())
            )));
        }
        total = total.saturating_add(meta.len());
        if total > MAX_LATENTS_BYTES {
            return Err(derr(format!(
                "the latent files hold more than {MAX_LATENTS_BYTES} bytes (at {}); allowed: at \
                 most {} MiB of latents",
                f.display(),
                MAX_LATENTS_BYTES >> 20
            )));
        }
        out.push((f, meta.len()));
    }
    Ok(out)
}

fn file_kind(ft: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO (named pipe)"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_char_device() || ft.is_block_device() {
        "a device"
    } else {
        "not a regular file"
    }
}

/// The bytes of a latent file that [`latent_files`] accepted with `len` bytes: opened without
/// blocking (should it have become a FIFO since), checked again on the open file, never more
/// than `len` bytes read.
fn read_checked(path: &Path, len: u64) -> std::result::Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.file_type().is_file() || meta.len() != len {
        return Err(
            "changed while it was read; allowed: regular files that stay as they are".into(),
        );
    }
    let mut bytes = Vec::with_capacity(usize::try_from(len).map_err(|e| e.to_string())?);
    file.take(len)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    Ok(bytes)
}

/// An `.npy` file (format 1.0–3.0, little-endian f16, f32 or f64, C order) as a tensor. Every
/// size in the header is checked before it sizes anything: the element count with checked
/// multiplication, and the data it declares must be exactly the bytes the file holds.
pub(crate) fn parse_npy(bytes: &[u8]) -> std::result::Result<Tensor, String> {
    const MAGIC: &[u8] = b"\x93NUMPY";
    let rest = bytes
        .strip_prefix(MAGIC)
        .ok_or("not an .npy file (no \\x93NUMPY magic)")?;
    let (&major, rest) = rest.split_first().ok_or("truncated header")?;
    let (_, rest) = rest.split_first().ok_or("truncated header")?;
    let (len, rest) = match major {
        1 => {
            let (l, r) = rest.split_at_checked(2).ok_or("truncated header")?;
            (usize::from(u16::from_le_bytes([l[0], l[1]])), r)
        }
        2 | 3 => {
            let (l, r) = rest.split_at_checked(4).ok_or("truncated header")?;
            let n = u32::from_le_bytes([l[0], l[1], l[2], l[3]]);
            (usize::try_from(n).map_err(|e| e.to_string())?, r)
        }
        v => return Err(format!("format version {v}; allowed: 1, 2 or 3")),
    };
    let (header, data) = rest
        .split_at_checked(len)
        .ok_or("header longer than the file")?;
    let header = std::str::from_utf8(header).map_err(|_| "header is not text")?;
    let field = |key: &str| -> Option<&str> {
        let at = header.find(&format!("'{key}'"))?;
        let after = header[at + key.len() + 2..]
            .trim_start()
            .strip_prefix(':')?;
        Some(after.trim_start())
    };
    let descr = field("descr").ok_or("no 'descr' in the header")?;
    let descr = descr
        .strip_prefix('\'')
        .and_then(|d| d.split('\'').next())
        .ok_or("'descr' is not a string")?;
    let dtype = match descr {
        "<f2" | "=f2" | "<e" => DType::F16,
        "<f4" | "=f4" | "<f" => DType::F32,
        "<f8" | "=f8" | "<d" => DType::F64,
        d => {
            return Err(format!(
                "dtype {d:?}; allowed: little-endian float16, float32 or float64 (<f2, <f4, <f8)"
            ))
        }
    };
    match field("fortran_order") {
        Some(f) if f.starts_with("False") => {}
        Some(f) if f.starts_with("True") => {
            return Err("Fortran order; allowed: C order (numpy's default)".into())
        }
        _ => return Err("no 'fortran_order' in the header".into()),
    }
    let shape = field("shape").ok_or("no 'shape' in the header")?;
    let inner = shape
        .strip_prefix('(')
        .and_then(|s| s.split(')').next())
        .ok_or("'shape' is not a tuple")?;
    let mut dims: Vec<usize> = Vec::new();
    for d in inner.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        if dims.len() == MAX_NPY_DIMS {
            return Err(format!("more than {MAX_NPY_DIMS} dimensions"));
        }
        dims.push(
            d.trim_end_matches('L')
                .parse::<usize>()
                .map_err(|_| format!("shape entry {d:?} is not a size"))?,
        );
    }
    let elems = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("shape {dims:?} overflows"))?;
    let need = elems
        .checked_mul(dtype.size_in_bytes())
        .ok_or_else(|| format!("shape {dims:?} overflows"))?;
    if need != data.len() {
        return Err(format!(
            "shape {dims:?} of {descr} needs {need} data bytes but the file holds {}",
            data.len()
        ));
    }
    Tensor::from_raw_buffer(data, dtype, &dims, &Device::Cpu).map_err(|e| e.to_string())
}

/// Read latents (n, C, H, W) from a directory of `.safetensors` (every tensor of every file, f32 or
/// f64 or bf16/f16) or `.npy` files, sorted by file name, and pair them with synthetic noise,
/// timesteps and labels from `data`. Returns every sample found. Each file is checked before it
/// is opened ([`latent_files`]) and every size it declares before it sizes an allocation.
pub fn load_latent_dir(dir: &Path, data: &SyntheticData) -> Result<Batch> {
    let derr = |why: String| EngineError::Data {
        path: dir.display().to_string(),
        why,
    };
    let files = latent_files(dir)?;
    let mut lat: Vec<f64> = Vec::new();
    let sample_len = data.sample_len();
    for (f, len) in &files {
        let bytes = read_checked(f, *len).map_err(|e| derr(format!("{}: {e}", f.display())))?;
        let tensors: Vec<Tensor> = if f.extension().is_some_and(|e| e == "npy") {
            vec![parse_npy(&bytes).map_err(|e| derr(format!("{}: {e}", f.display())))?]
        } else {
            candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
                .map_err(|e| derr(format!("{}: {e}", f.display())))?
                .into_values()
                .collect()
        };
        drop(bytes);
        for t in tensors {
            if t.elem_count() % sample_len != 0 || t.dims().last() != Some(&data.width) {
                return Err(derr(format!(
                    "{}: tensor of shape {:?} is not a stack of {}×{}×{} latents",
                    f.display(),
                    t.dims(),
                    data.channels,
                    data.height,
                    data.width
                )));
            }
            let v: Vec<f64> = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
            lat.extend(v);
        }
    }
    let n = lat.len() / sample_len;
    let mut b = data.batch_at(0, n);
    b.latents = lat;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn npy(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
        let header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend((header.len() as u16).to_le_bytes());
        b.extend(header.as_bytes());
        b.extend(data);
        b
    }

    #[test]
    fn npy_sizes_are_checked_before_they_size_anything() {
        let ok = npy("<f4", "(2, 1)", &[0, 0, 128, 63, 0, 0, 0, 64]);
        let t = parse_npy(&ok).unwrap();
        assert_eq!(t.dims(), &[2, 1]);
        assert_eq!(
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [1.0, 2.0]
        );
        for (bytes, why) in [
            (npy("<f4", "(18446744073709551615,4,4,4)", &[]), "overflows"),
            (npy("<f4", "(4611686018427387904,4)", &[]), "overflows"),
            (
                npy("<f4", "(1000000000,)", &[0; 8]),
                "needs 4000000000 data bytes",
            ),
            (npy("<f4", "(3,)", &[0; 8]), "needs 12 data bytes"),
            (npy(">f4", "(2,)", &[0; 8]), "allowed: little-endian"),
            (npy("<f4", "(1,1,1,1,1,1,1,1,1)", &[0; 4]), "dimensions"),
            (
                b"\x93NUMPY\x01\x00\xff\xff{".to_vec(),
                "longer than the file",
            ),
            (b"\x93NUMPY\x09\x00".to_vec(), "version"),
            (b"not npy".to_vec(), "magic"),
        ] {
            let e = parse_npy(&bytes).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn schedule_endpoints() {
        let a = alphas_cumprod();
        assert_eq!(a.len(), 1000);
        assert!((a[0] - (1.0 - 1e-4)).abs() < 1e-15);
        // Known value of DDPM's ᾱ_999 for this schedule ≈ 4.04e-5.
        assert!(a[999] > 3.9e-5 && a[999] < 4.2e-5, "{}", a[999]);
    }
}
