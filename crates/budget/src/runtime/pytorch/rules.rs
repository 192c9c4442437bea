//! The PyTorch rules: the three segments of the DiT step op by op as eager PyTorch runs them
//! (timm's `DiT` blocks, `facebookresearch/DiT` `models.py`), each op marked with what it saves
//! for backward (the rule sources [AG], [MM], [AC], [SDPA] are listed in the folder's `mod.rs`).

use crate::runtime::pytorch::device::PyTorch;
use crate::runtime::shape::Shape;
use crate::segment::{Segment, Tid};
use crate::spec::Dtype;

pub(crate) use crate::runtime::pytorch::ops::CACHED;
pub(crate) use crate::runtime::pytorch::ops::GRAD_VIEWS;
pub(crate) use crate::runtime::pytorch::ops::LEFT_UNSAVED;
pub(crate) use crate::runtime::pytorch::ops::MATMUL;
pub(crate) use crate::runtime::pytorch::ops::SAVED;
use crate::runtime::pytorch::ops::{promote, save, Attn, Builder};

impl PyTorch {
    fn builder<'a>(&'a self, dims: &Shape, name: &str) -> Builder<'a> {
        let mut bl = Builder::new(self, dims.precision, dims.attention, name);
        bl.threads = u64::from(dims.cpu.threads);
        bl
    }

    /// The builder of a segment over the residual stream: its inputs `x` (the stream) and the
    /// conditioning `c`, both in the accumulation dtype.
    fn stream_builder<'a>(&'a self, dims: &Shape, name: &str) -> (Builder<'a>, Tid, Tid) {
        let mut bl = self.builder(dims, name);
        let f = dims.precision.accum_dtype();
        let x = bl.g.input("x", dims.e(), f, true);
        bl.g.stream_in = vec![x];
        let c = bl.g.input("c", dims.b * dims.d, f, true);
        (bl, x, c)
    }
}

/// Attention core of one DiT block from the fused qkv output (q, k, v are views of it);
/// returns proj's input.
fn attention(bl: &mut Builder, dims: &Shape, qkv: Tid) -> Tid {
    let e = dims.e();
    let q = bl.g.view("q (view of qkv)", qkv, e);
    let k = bl.g.view("k (view of qkv)", qkv, e);
    let v = bl.g.view("v (view of qkv)", qkv, e);
    let at = Attn {
        b: dims.b,
        heads: dims.heads,
        sq: dims.s,
        skv: dims.s,
        dh: dims.d / dims.heads.max(1),
    };
    bl.attention(q, k, v, at)
}

impl PyTorch {
    /// Input side: noising (no grad), PatchEmbed, timestep MLP, label table; output x, and c
    /// (saved by every block's SiLU) kept beside it.
    pub(crate) fn embed(&self, dims: &Shape) -> Segment {
        let mut bl = self.builder(dims, "embed");
        let f = dims.precision.param_dtype();
        let (b, d) = (dims.b, dims.d);
        let n = dims.latent;
        // Noising without grad: ᾱ gathered per sample, x_t = √ᾱ·x0 + √(1−ᾱ)·ε. The data
        // (x0, noise, t, y, ᾱ) are counted by the step replay as `data`.
        let x0 = bl.g.input("x0", n, f, false);
        let eps = bl.g.input("noise", n, f, false);
        let ab = bl.g.input("ᾱ_t", b, f, false);
        let sa = bl.g.op("√ᾱ", &[ab], b, f);
        let a = bl.g.op("√ᾱ·x0", &[x0, sa], n, f);
        let om = bl.g.op("1−ᾱ", &[ab], b, f);
        let sb = bl.g.op("√(1−ᾱ)", &[om], b, f);
        let bn = bl.g.op("√(1−ᾱ)·ε", &[eps, sb], n, f);
        let xt = bl.g.op("x_t", &[a, bn], n, f);
        // PatchEmbed: conv2d saves its (cast) input and weight [AG][AC]; flatten + transpose are
        // views; `+ pos_embed` (frozen, fp32) makes the residual stream.
        let w = bl.weight("x_embedder.proj.weight", d * dims.c_in * dims.patch2);
        let bias = bl.cached_weight("x_embedder.proj.bias", d);
        let xin = bl.cast_low("x_embedder input", xt);
        save(&mut bl.g, xin);
        let low = bl.low();
        let conv = bl.g.op("x_embedder conv", &[xin, w, bias], dims.e(), low);
        let pos = bl.g.param("pos_embed", dims.s * d, f, false);
        let x =
            bl.g.op("+pos_embed", &[conv, pos], dims.e(), promote(low, f));
        // Timestep frequencies (no grad), then Linear → SiLU → Linear.
        let half = dims.freq / 2;
        let t = bl.g.input("t", b, Dtype::F32, false);
        let fr = bl.g.op("freqs", &[], half, Dtype::F32);
        let args = bl.g.op("t·freqs", &[t, fr], b * half, Dtype::F32);
        let cos = bl.g.op("cos", &[args], b * half, Dtype::F32);
        let sin = bl.g.op("sin", &[args], b * half, Dtype::F32);
        let tf =
            bl.g.op("cat[cos,sin]", &[cos, sin], b * dims.freq, Dtype::F32);
        let tf = bl.g.cast("t_freq →param dtype", tf, f);
        let h = bl.linear("t_embedder.mlp.0", tf, b, d, dims.freq);
        save(&mut bl.g, h);
        let hd = bl.g.dtype(h);
        let h = bl.g.op("t silu", &[h], b * d, hd);
        let te = bl.linear("t_embedder.mlp.2", h, b, d, d);
        // Label embedding (not on the autocast list): saves the indices [AG].
        let table = bl.g.param(
            "y_embedder.embedding_table.weight",
            dims.label_rows * d,
            f,
            true,
        );
        let ye = bl.g.op("label rows", &[table], b * d, f);
        let tdt = bl.g.dtype(te);
        let c =
            bl.g.op("c = t_emb + y_emb", &[te, ye], b * d, promote(tdt, f));
        save(&mut bl.g, c);
        bl.g.output = x;
        bl.g
    }

    /// One adaLN-Zero block, op by op as eager PyTorch runs it.
    pub(crate) fn block(&self, dims: &Shape) -> Segment {
        let (mut bl, x, c) = self.stream_builder(dims, "block");
        let f = dims.precision.accum_dtype();
        let (e, rows, d) = (dims.e(), dims.rows(), dims.d);
        let m = bl.ada_ln("adaLN_modulation.1", c, 6, dims.b, d);
        let (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) =
            (m[0], m[1], m[2], m[3], m[4], m[5]);

        let n1 = bl.layer_norm("norm1", x, rows);
        let h = bl.modulate("modulate1", n1, shift_msa, scale_msa, dims.b * d);
        let qkv = bl.linear("attn.qkv", h, rows, 3 * d, d);
        let o = attention(&mut bl, dims, qkv);
        let p = bl.linear("attn.proj", o, rows, d, d);
        // gate·proj saves both operands; the residual add saves nothing [AG].
        save(&mut bl.g, p);
        save(&mut bl.g, gate_msa);
        let gdt = promote(bl.g.dtype(p), bl.g.dtype(gate_msa));
        let gp = bl.g.op("gate_msa·proj", &[gate_msa, p], e, gdt);
        let x1 = bl.g.op("x + attn", &[x, gp], e, promote(f, gdt));

        let n2 = bl.layer_norm("norm2", x1, rows);
        let h2 = bl.modulate("modulate2", n2, shift_mlp, scale_mlp, dims.b * d);
        let f1 = bl.linear("mlp.fc1", h2, rows, dims.mlp, d);
        // GELU(tanh) saves its input [AG]; its output is fc2's saved input.
        save(&mut bl.g, f1);
        let low = bl.low();
        let act = bl.g.op("gelu(tanh)", &[f1], rows * dims.mlp, low);
        let f2 = bl.linear("mlp.fc2", act, rows, d, dims.mlp);
        save(&mut bl.g, f2);
        save(&mut bl.g, gate_mlp);
        let gdt = promote(bl.g.dtype(f2), bl.g.dtype(gate_mlp));
        let gm = bl.g.op("gate_mlp·fc2", &[gate_mlp, f2], e, gdt);
        bl.g.op("x + mlp", &[x1, gm], e, promote(f, gdt));
        bl.g
    }

    /// Final layer, unpatchify and the fp32 MSE loss on the ε channels.
    pub(crate) fn final_layer(&self, dims: &Shape) -> Segment {
        let (mut bl, x, c) = self.stream_builder(dims, "final");
        let (rows, d) = (dims.rows(), dims.d);
        let m = bl.ada_ln("final_layer.adaLN_modulation.1", c, 2, dims.b, d);
        let n = bl.layer_norm("final norm", x, rows);
        let h = bl.modulate("final modulate", n, m[0], m[1], dims.b * d);
        let out = rows * dims.patch2 * dims.c_out;
        let y = bl.linear("final_layer.linear", h, rows, dims.patch2 * dims.c_out, d);
        // unpatchify: reshape + einsum permutation are views, the last reshape copies.
        let ydt = bl.g.dtype(y);
        let img = bl.g.op("unpatchify", &[y], out, ydt);
        let lat = dims.latent;
        let pred = bl.g.view("ε channels", img, lat);
        // The loss runs after autocast in the parameter dtype: `.to()` copies a low-precision
        // prediction, and mse_loss saves input and target [AG]; its forward makes one
        // elementwise buffer before the mean.
        let pf = dims.precision.param_dtype();
        let pred = bl.g.cast("prediction →param dtype", pred, pf);
        save(&mut bl.g, pred);
        let target = bl.g.input("target", lat, pf, false);
        let loss = bl.g.op("mse_loss", &[pred, target], 1, pf);
        bl.g.annotate(loss, 0, lat * pf.size(), 0);
        bl.g
    }
}
