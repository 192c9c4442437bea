//! The PyTorch rules: the three segments of the DiT step op by op as eager PyTorch runs them
//! (timm's `DiT` blocks, `facebookresearch/DiT` `models.py`), each op marked with what it saves
//! for backward (the rule sources [AG], [MM], [AC], [SDPA] are listed in the folder's `mod.rs`).

use crate::runtime::pytorch::device::PyTorch;
use crate::runtime::shape::Shape;
use crate::segment::{Segment, Tid};
use crate::spec::{AttentionMode, Dtype, SdpaBackend, TorchDevice};

/// Marker appended to the name of a tensor that some op saves for backward.
pub const SAVED: &str = " [saved]";
/// Marker of an autocast weight copy that only the autocast cache holds (until the forward ends).
pub const CACHED: &str = " [autocast cache]";

/// Dtype of an elementwise result under type promotion (the wider float wins).
fn promote(a: Dtype, b: Dtype) -> Dtype {
    if a.size() >= b.size() {
        a
    } else {
        b
    }
}

/// Mark `t` as saved for backward by some op.
fn save(g: &mut Segment, t: Tid) {
    let name = &mut g.tensors[t].name;
    if !name.ends_with(SAVED) {
        name.push_str(SAVED);
    }
}

/// One forward graph under construction, with the precision rules of the spec.
struct Builder<'a> {
    rt: &'a PyTorch,
    dims: &'a Shape,
    g: Segment,
}

impl Builder<'_> {
    /// Whether autocast is on (mixed precision with fp32 master weights) [AC].
    fn autocast(&self) -> bool {
        self.dims.precision.is_mixed()
    }

    /// Dtype the parameters are stored in.
    fn param_dtype(&self) -> Dtype {
        self.dims.precision.param_dtype()
    }

    /// Dtype of matmul / conv / SDPA outputs.
    fn low(&self) -> Dtype {
        self.dims.precision.compute_dtype()
    }

    /// The tensor an autocast-listed op reads: itself, or a new cast copy [AC].
    fn cast_low(&mut self, name: &str, x: Tid) -> Tid {
        let low = self.low();
        self.g.cast(&format!("{name} →{low}"), x, low)
    }

    /// A trained parameter and, under autocast, its cached low-precision copy [AC]. The copy is
    /// marked saved: the autocast cache holds it for the rest of the forward, and the op that
    /// reads it keeps it for backward.
    fn weight(&mut self, name: &str, elems: u64) -> Tid {
        let pd = self.param_dtype();
        let p = self.g.param(name, elems, pd, true);
        let c = self.cast_low(name, p);
        save(&mut self.g, c);
        c
    }

    /// A parameter whose autocast copy only the cache holds (a bias: `addmm` does not save it).
    fn cached_weight(&mut self, name: &str, elems: u64) -> Tid {
        let pd = self.param_dtype();
        let p = self.g.param(name, elems, pd, true);
        let c = self.cast_low(name, p);
        if c != p {
            self.g.tensors[c].name.push_str(CACHED);
        }
        c
    }

    /// `F.linear(x, W, b)`: `addmm` on the 2-D view of x saves the (cast) input and the (cast)
    /// weight [AG][AC]; the output is in the compute dtype and is not saved by this op.
    fn linear(&mut self, name: &str, x: Tid, rows: u64, out: u64, inp: u64) -> Tid {
        let w = self.weight(&format!("{name}.weight"), out * inp);
        let b = self.cached_weight(&format!("{name}.bias"), out);
        let xin = self.cast_low(&format!("{name} input"), x);
        save(&mut self.g, xin);
        let low = self.low();
        self.g.op(name, &[xin, w, b], rows * out, low)
    }

    /// `LayerNorm(D, elementwise_affine=False)`: saves its input and fp32 mean + rstd per row
    /// [AG] (the input's dtype on the CPU kernel, fp32 accumulation on CUDA); the output keeps
    /// the input's dtype (fp32 under autocast: the residual stream is fp32 and CUDA lists
    /// `layer_norm` as fp32) [AC].
    fn layer_norm(&mut self, name: &str, x: Tid, rows: u64) -> Tid {
        save(&mut self.g, x);
        let dt = self.g.dtype(x);
        let stat = match (self.rt.device, dt) {
            (TorchDevice::Cpu, d) => d.size(),
            (TorchDevice::Cuda, Dtype::F64) => 8,
            (TorchDevice::Cuda, _) => 4,
        };
        let n = self.g.elems(x);
        let y = self.g.op(name, &[x], n, dt);
        self.g.annotate(y, 2 * rows * stat, 0, 0);
        y
    }

    /// `x·(1 + scale[:, None]) + shift[:, None]`: `1 + scale` is a new (b, 1, D) tensor; the mul
    /// saves both operands (both need a gradient); the add saves nothing [AG].
    fn modulate(&mut self, name: &str, xn: Tid, shift: Tid, scale: Tid) -> Tid {
        let bd = self.dims.b * self.dims.d;
        let sdt = self.g.dtype(scale);
        let one_plus = self.g.op(&format!("{name} 1+scale"), &[scale], bd, sdt);
        save(&mut self.g, one_plus);
        save(&mut self.g, xn);
        let dt = promote(self.g.dtype(xn), sdt);
        let n = self.g.elems(xn);
        let mul = self
            .g
            .op(&format!("{name} ·(1+scale)"), &[xn, one_plus], n, dt);
        let dt2 = promote(dt, self.g.dtype(shift));
        self.g.op(&format!("{name} +shift"), &[mul, shift], n, dt2)
    }

    /// `Linear(SiLU(c))` chunked into `k` views of (b, D): SiLU saves c [AG].
    fn ada_ln(&mut self, name: &str, c: Tid, k: u64) -> Vec<Tid> {
        let (b, d) = (self.dims.b, self.dims.d);
        save(&mut self.g, c);
        let cdt = self.g.dtype(c);
        let silu = self.g.op(&format!("{name} silu(c)"), &[c], b * d, cdt);
        let m = self.linear(name, silu, b, k * d, d);
        (0..k)
            .map(|i| self.g.view(&format!("{name} chunk {i}"), m, b * d))
            .collect()
    }

    /// Attention core of one block from the fused qkv output; returns proj's input.
    fn attention(&mut self, qkv: Tid) -> Tid {
        let d = self.dims;
        let (e, a) = (d.e(), d.a());
        let low = self.low();
        let rows = d.b * d.heads * d.s;
        let q = self.g.view("q (view of qkv)", qkv, e);
        let k = self.g.view("k (view of qkv)", qkv, e);
        let v = self.g.view("v (view of qkv)", qkv, e);
        if d.attention == AttentionMode::MemoryEfficient {
            match self.rt.effective_sdpa(d.precision) {
                SdpaBackend::Math => return self.sdpa_math(q, k, v),
                backend => {
                    // [SDPA] q, k, v views (so the whole qkv storage) + output + fp32 lse.
                    for t in [q, k, v] {
                        save(&mut self.g, t);
                    }
                    let lse_rows = if backend == SdpaBackend::Efficient {
                        d.b * d.heads * d.s.div_ceil(32) * 32
                    } else {
                        rows
                    };
                    let o = self.g.op("sdpa out", &[q, k, v], e, low);
                    save(&mut self.g, o);
                    // CPU flash keeps per-thread blocks of scores; CUDA kernels tile in SRAM.
                    self.g.annotate(o, lse_rows * 4, 0, 0);
                    // Output layout (b, s, a, d): transpose(1, 2).reshape is a view.
                    return self.g.view("attn out (b, s, D) view", o, e);
                }
            }
        }
        // timm's explicit path: q·scale, (q @ kᵀ), softmax, (P @ v) [MM][AG][AC].
        let qs = self.g.op("q·scale", &[q], e, low);
        let qc = self.g.op("q·scale reshaped for bmm", &[qs], e, low);
        let kc = self.g.op("kᵀ reshaped for bmm", &[k], e, low);
        save(&mut self.g, qc);
        save(&mut self.g, kc);
        let scores = self.g.op("scores q·kᵀ", &[qc, kc], a, low);
        let p_dt = if self.autocast() && self.rt.device == TorchDevice::Cuda {
            // softmax is on CUDA autocast's fp32 list [AC].
            Dtype::F32
        } else {
            low
        };
        let p = self.g.op("softmax P", &[scores], a, p_dt);
        save(&mut self.g, p);
        let pc = self.cast_low("P", p);
        save(&mut self.g, pc);
        let vc = self.g.op("v reshaped for bmm", &[v], e, low);
        save(&mut self.g, vc);
        let o = self.g.op("P·v", &[pc, vc], e, low);
        // (b, a, s, d) → transpose(1, 2).reshape(b, s, D) copies [MM].
        self.g.op("attn out (b, s, D) copy", &[o], e, low)
    }

    /// The SDPA math backend: composite ops; fp16/bf16 inputs are upcast to fp32 on CUDA since
    /// PyTorch 2.5 [SDPA]; q and k are both scaled by √scale [SDPA][MM].
    fn sdpa_math(&mut self, q: Tid, k: Tid, v: Tid) -> Tid {
        let d = self.dims;
        let (e, a) = (d.e(), d.a());
        let low = self.low();
        let upcast = self.rt.device == TorchDevice::Cuda && matches!(low, Dtype::Bf16 | Dtype::F16);
        let wd = if upcast { Dtype::F32 } else { low };
        let (q, k, v) = if upcast {
            (
                self.g.cast("q →f32", q, wd),
                self.g.cast("k →f32", k, wd),
                self.g.cast("v →f32", v, wd),
            )
        } else {
            (q, k, v)
        };
        let qs = self.g.op("q·√scale", &[q], e, wd);
        let ks = self.g.op("k·√scale", &[k], e, wd);
        let qc = self.g.op("q reshaped for bmm", &[qs], e, wd);
        let kc = self.g.op("kᵀ reshaped for bmm", &[ks], e, wd);
        save(&mut self.g, qc);
        save(&mut self.g, kc);
        let scores = self.g.op("scores", &[qc, kc], a, wd);
        let p = self.g.op("softmax P", &[scores], a, wd);
        save(&mut self.g, p);
        let vc = self.g.op("v reshaped for bmm", &[v], e, wd);
        save(&mut self.g, vc);
        let o = self.g.op("P·v", &[p, vc], e, wd);
        let o = self.g.cast(&format!("sdpa out →{low}"), o, low);
        self.g.op("attn out (b, s, D) copy", &[o], e, low)
    }
}

impl PyTorch {
    fn builder<'a>(&'a self, dims: &'a Shape, name: &str) -> Builder<'a> {
        Builder {
            rt: self,
            dims,
            g: Segment::new(name),
        }
    }
}

impl PyTorch {
    /// Input side: noising (no grad), PatchEmbed, timestep MLP, label table; output x, and c
    /// (saved by every block's SiLU) kept beside it.
    pub fn embed(&self, dims: &Shape) -> Segment {
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
    pub fn block(&self, dims: &Shape) -> Segment {
        let mut bl = self.builder(dims, "block");
        let f = dims.precision.accum_dtype();
        let (e, rows, d) = (dims.e(), dims.rows(), dims.d);
        let x = bl.g.input("x", e, f, true);
        bl.g.stream_in = vec![x];
        let c = bl.g.input("c", dims.b * d, f, true);
        let m = bl.ada_ln("adaLN_modulation.1", c, 6);
        let (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) =
            (m[0], m[1], m[2], m[3], m[4], m[5]);

        let n1 = bl.layer_norm("norm1", x, rows);
        let h = bl.modulate("modulate1", n1, shift_msa, scale_msa);
        let qkv = bl.linear("attn.qkv", h, rows, 3 * d, d);
        let o = bl.attention(qkv);
        let p = bl.linear("attn.proj", o, rows, d, d);
        // gate·proj saves both operands; the residual add saves nothing [AG].
        save(&mut bl.g, p);
        save(&mut bl.g, gate_msa);
        let gdt = promote(bl.g.dtype(p), bl.g.dtype(gate_msa));
        let gp = bl.g.op("gate_msa·proj", &[gate_msa, p], e, gdt);
        let x1 = bl.g.op("x + attn", &[x, gp], e, promote(f, gdt));

        let n2 = bl.layer_norm("norm2", x1, rows);
        let h2 = bl.modulate("modulate2", n2, shift_mlp, scale_mlp);
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
    pub fn final_layer(&self, dims: &Shape) -> Segment {
        let mut bl = self.builder(dims, "final");
        let f = dims.precision.accum_dtype();
        let (e, rows, d) = (dims.e(), dims.rows(), dims.d);
        let x = bl.g.input("x", e, f, true);
        bl.g.stream_in = vec![x];
        let c = bl.g.input("c", dims.b * d, f, true);
        let m = bl.ada_ln("final_layer.adaLN_modulation.1", c, 2);
        let n = bl.layer_norm("final norm", x, rows);
        let h = bl.modulate("final modulate", n, m[0], m[1]);
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
