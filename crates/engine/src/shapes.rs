//! The parameter and dimension vocabulary the model and every family share: a parameter's
//! shape and init ([`ParamShape`], [`Init`]) and the dimensions derived from a spec ([`Dims`];
//! `Dims::new`, which asks the family, is in `model.rs`). A leaf: it uses no other file of the
//! crate, so `model.rs` can dispatch to the families' `params.rs` and they can name these types
//! without an import circle.

/// How a parameter is initialised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Uniform(±√(6/(fan_in+fan_out))) with fan_out = `shape[0]`, fan_in = the rest.
    XavierUniform,
    /// Normal(0, std).
    Normal(f64),
    /// Uniform(±bound).
    Uniform(f64),
    Zeros,
    /// All ones (a norm's weight).
    Ones,
    /// Wan's 3-D RoPE buffer (`rope.freqs_cos` / `freqs_sin`, (max_len, d_h)).
    Rope3d {
        cos: bool,
    },
    /// The fixed 2-D sin-cos position table.
    SinCos2d {
        rows: usize,
        cols: usize,
    },
}

/// One parameter of the model as the spec defines it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamShape {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
    /// Whether the optimizer updates it (false for `pos_embed` and for the base under LoRA).
    pub trainable: bool,
}

impl ParamShape {
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// Dimensions derived from a spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub depth: usize,
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub mlp_hidden: usize,
    pub patch: usize,
    pub in_channels: usize,
    pub out_channels: usize,
    pub num_classes: usize,
    pub label_rows: usize,
    pub freq: usize,
    pub latent_h: usize,
    pub latent_w: usize,
    pub rows: usize,
    pub cols: usize,
    pub tokens: usize,
    /// Latent frames of a video model (1 for images); `tokens` counts every frame's.
    pub frames: usize,
}

impl Dims {
    /// Features of one patch at the input: C·p·p.
    pub fn patch_in(&self) -> usize {
        self.in_channels * self.patch * self.patch
    }

    /// Features of one patch at the output: p·p·C_out.
    pub(crate) fn patch_out(&self) -> usize {
        self.out_channels * self.patch * self.patch
    }
}

/// A family's parameter inventory as it is written down: tensors in the order they are added,
/// trainable (a LoRA plan then freezes the base: `families::lora::adapt`).
#[derive(Debug, Default)]
pub(crate) struct Inventory {
    pub(crate) shapes: Vec<ParamShape>,
}

impl Inventory {
    /// One trained tensor.
    pub(crate) fn tensor(&mut self, name: String, shape: Vec<usize>, init: Init) {
        self.shapes.push(ParamShape {
            name,
            shape,
            init,
            trainable: true,
        });
    }

    /// A linear `prefix`: its weight (out, in) drawn by `w`, its bias (out) zero.
    pub(crate) fn linear(&mut self, prefix: &str, out: usize, inp: usize, w: Init) {
        self.layer(prefix, vec![out, inp], w, true);
    }

    /// A layer `prefix` with a weight of any `shape` (a conv's (out, in, k…)) drawn by `w`, and
    /// a zero bias (`shape[0]`) when it has one.
    pub(crate) fn layer(&mut self, prefix: &str, shape: Vec<usize>, w: Init, bias: bool) {
        let out = shape.first().copied().unwrap_or(0);
        self.tensor(format!("{prefix}.weight"), shape, w);
        if bias {
            self.tensor(format!("{prefix}.bias"), vec![out], Init::Zeros);
        }
    }

    /// The fixed 2-D sin-cos position table `name` of a `rows` × `cols` grid, `width` features
    /// a position (frozen; a diffusers family's non-persistent buffer).
    pub(crate) fn sincos_table(&mut self, name: &str, (rows, cols): (usize, usize), width: usize) {
        self.shapes.push(ParamShape {
            name: name.into(),
            shape: vec![rows * cols, width],
            init: Init::SinCos2d { rows, cols },
            trainable: false,
        });
    }
}
