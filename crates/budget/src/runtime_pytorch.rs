//! PyTorch eager autograd as the executor: what each op of the DiT step saves for backward.
//!
//! Sources of the rules (each rule below names its source):
//! - **[AG]** PyTorch's autograd formulas (`tools/autograd/derivatives.yaml`): a node saves only
//!   what its backward reads — `addmm`/`mm`/`bmm` save both operands, `mul` saves the operand
//!   the other's gradient needs, `add`/`sub`, views and scalar multiplications save nothing,
//!   `native_layer_norm` saves its input plus per-row mean and rstd, `gelu` and `silu` save their
//!   input, `_softmax` saves its **output**, `embedding` saves the indices. A storage is freed as
//!   soon as no saved variable nor live tensor references it.
//! - **[MM]** `at::matmul` on 4-D operands expands and **reshapes to 3-D before `bmm`**; a
//!   permuted q/k/v slice of the fused qkv output cannot be viewed that way, so the reshape
//!   copies and `bmm` saves the copies (q·scale, kᵀ and v each become one new E-sized tensor).
//!   `attn.transpose(1, 2).reshape(b, s, D)` of a contiguous (b, a, s, d) result copies too.
//! - **[AC]** Autocast (`aten/src/ATen/autocast_mode.cpp`): `linear`/`addmm`/`matmul`/`bmm`/
//!   `conv2d`/`scaled_dot_product_attention` run in the low dtype, so each Linear saves an
//!   autocast-**cast copy** of its input and of its weight; casts of fp32 leaf parameters are kept
//!   in the autocast weight cache (`cached_cast`) until the autocast region exits, and stay alive
//!   while a saved variable references them. On CUDA `layer_norm`, `softmax` and `mse_loss` are on
//!   the fp32 list (softmax of bf16 scores saves a fp32 P, and the following `P @ v` saves a bf16
//!   copy of it); the CPU autocast list has no `softmax` entry, so P stays bf16 there. Everything
//!   else follows type promotion: the residual stream stays fp32 (fp32 x + bf16 branch).
//! - **[SDPA]** `scaled_dot_product_attention`: the fused kernels (CPU flash
//!   `_scaled_dot_product_flash_attention_for_cpu`, CUDA flash, memory-efficient, cuDNN) save
//!   q, k, v (views of the qkv output), their output and an fp32 log-sum-exp of b·a·s rows
//!   (memory-efficient pads s to a multiple of 32); their output is laid out (b, s, a, d), so the
//!   transpose + reshape before `proj` is a view. The math backend is composite (scaled q and k,
//!   `matmul`, `softmax`, `matmul`; see [MM]) and since PyTorch 2.5 upcasts fp16/bf16 inputs to
//!   fp32 on CUDA (pytorch/pytorch #128922).
//! - **[CK]** `torch.utils.checkpoint(block, x, c, use_reentrant=False)`: the forward keeps only
//!   the block's inputs; backward recomputes the block under the same autocast state and then
//!   backpropagates it.
//! - **[OPT]** `torch.optim.AdamW(foreach=True)` (`torch/optim/adam.py`, `_multi_tensor_adam`):
//!   `lerp_`, `mul_`, `addcmul_`, `div_`, `add_`, `addcdiv_` are in place; `_foreach_sqrt(exp_avg_sq)`
//!   makes one new state-sized tensor for **every** parameter of the group at once. SGD without
//!   momentum updates in place.
//! - **[CUDA]** The CUDA caching allocator (`c10/cuda/CUDACachingAllocator.cpp`) rounds every
//!   block up to 512 B; requests ≤ 1 MiB come from 2 MiB segments, requests below 10 MiB from
//!   20 MiB segments, larger ones are rounded to 2 MiB. The CUDA context (driver, cuBLAS/cuDNN
//!   workspaces, kernels) is memory the device shows but the allocator does not count.
//!
//! Measured against real PyTorch runs by `bench/torch_peer` (see its README and `grid.py`); the
//! saved-tensor lists were checked with `bench/torch_peer/saved.py` (saved-tensor hooks).

use serde::Serialize;

use crate::graph::{Segment, TensorKind, TensorRole, Tid};
use crate::params::{ParamRole, ParamTensor};
use crate::runtime::{Dims, RuntimeModel};
use crate::spec::{AttentionMode, Dtype, Optimizer, Precision, Prediction, Spec};
use crate::timeline::{Breakdown, Event, Events, Phase, StaticBytes};

/// Where the PyTorch step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TorchDevice {
    Cpu,
    Cuda,
}

impl TorchDevice {
    pub const fn name(self) -> &'static str {
        match self {
            TorchDevice::Cpu => "cpu",
            TorchDevice::Cuda => "cuda",
        }
    }
}

/// Which `scaled_dot_product_attention` kernel runs when the spec's attention is
/// `memory-efficient` (the `materialized` mode is the explicit `softmax(q·kᵀ)·v` of timm's
/// non-fused path, whatever this says).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SdpaBackend {
    /// PyTorch's own choice: CPU flash on the CPU; on CUDA flash for fp16/bf16, memory-efficient
    /// for fp32/fp64.
    Auto,
    Flash,
    Efficient,
    Cudnn,
    Math,
}

impl SdpaBackend {
    pub const ALL: [SdpaBackend; 5] = [
        SdpaBackend::Auto,
        SdpaBackend::Flash,
        SdpaBackend::Efficient,
        SdpaBackend::Cudnn,
        SdpaBackend::Math,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            SdpaBackend::Auto => "auto",
            SdpaBackend::Flash => "flash",
            SdpaBackend::Efficient => "efficient",
            SdpaBackend::Cudnn => "cudnn",
            SdpaBackend::Math => "math",
        }
    }
}

/// The PyTorch runtime on one device with one SDPA backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyTorch {
    pub device: TorchDevice,
    pub sdpa: SdpaBackend,
}

/// Marker appended to the name of a tensor that some op saves for backward.
pub const SAVED: &str = " [saved]";
/// Marker of an autocast weight copy that only the autocast cache holds (until the forward ends).
pub const CACHED: &str = " [autocast cache]";

/// Bytes of a CUDA context with cuBLAS and cuDNN handles loaded, as `nvidia-smi` shows it beside
/// the caching allocator's reserved memory. An order of magnitude, not a measurement of this
/// project: it depends on the driver, the GPU and the loaded kernels (typically 300–600 MiB).
pub const CUDA_CONTEXT_BYTES: u64 = 500 << 20;

const MIB: u64 = 1 << 20;

impl PyTorch {
    /// The instance for a device and backend (a `'static` reference, as `model_for` returns).
    pub fn instance(device: TorchDevice, sdpa: SdpaBackend) -> &'static PyTorch {
        use SdpaBackend as S;
        use TorchDevice as D;
        match (device, sdpa) {
            (D::Cpu, S::Auto) => &PyTorch {
                device: D::Cpu,
                sdpa: S::Auto,
            },
            (D::Cpu, S::Flash) => &PyTorch {
                device: D::Cpu,
                sdpa: S::Flash,
            },
            (D::Cpu, S::Efficient) => &PyTorch {
                device: D::Cpu,
                sdpa: S::Efficient,
            },
            (D::Cpu, S::Cudnn) => &PyTorch {
                device: D::Cpu,
                sdpa: S::Cudnn,
            },
            (D::Cpu, S::Math) => &PyTorch {
                device: D::Cpu,
                sdpa: S::Math,
            },
            (D::Cuda, S::Auto) => &PyTorch {
                device: D::Cuda,
                sdpa: S::Auto,
            },
            (D::Cuda, S::Flash) => &PyTorch {
                device: D::Cuda,
                sdpa: S::Flash,
            },
            (D::Cuda, S::Efficient) => &PyTorch {
                device: D::Cuda,
                sdpa: S::Efficient,
            },
            (D::Cuda, S::Cudnn) => &PyTorch {
                device: D::Cuda,
                sdpa: S::Cudnn,
            },
            (D::Cuda, S::Math) => &PyTorch {
                device: D::Cuda,
                sdpa: S::Math,
            },
        }
    }

    /// The SDPA kernel that really runs for this precision [SDPA]: the CPU has one fused kernel
    /// (flash); CUDA flash needs fp16/bf16, so `auto` picks memory-efficient for fp32.
    pub fn effective_sdpa(&self, precision: Precision) -> SdpaBackend {
        let half = matches!(precision.compute_dtype(), Dtype::Bf16 | Dtype::F16);
        match (self.device, self.sdpa) {
            (_, SdpaBackend::Math) => SdpaBackend::Math,
            (TorchDevice::Cpu, _) => SdpaBackend::Flash,
            (TorchDevice::Cuda, SdpaBackend::Auto) if half => SdpaBackend::Flash,
            (TorchDevice::Cuda, SdpaBackend::Auto) => SdpaBackend::Efficient,
            (TorchDevice::Cuda, SdpaBackend::Flash) if !half => SdpaBackend::Efficient,
            (TorchDevice::Cuda, b) => b,
        }
    }

    /// Bytes the caching allocator hands out for a request [CUDA]: 512 B granularity.
    pub fn cuda_block(bytes: u64) -> u64 {
        bytes.div_ceil(512) * 512
    }

    /// Size of the segment `cudaMalloc`ed for a request that no cached block can serve [CUDA].
    pub fn cuda_segment(bytes: u64) -> u64 {
        let b = Self::cuda_block(bytes);
        if b <= MIB {
            2 * MIB
        } else if b < 10 * MIB {
            20 * MIB
        } else {
            b.div_ceil(2 * MIB) * 2 * MIB
        }
    }
}

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
    dims: &'a Dims,
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
    fn builder<'a>(&'a self, dims: &'a Dims, name: &str) -> Builder<'a> {
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
    pub fn embed(&self, dims: &Dims) -> Segment {
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
    pub fn block(&self, dims: &Dims) -> Segment {
        let mut bl = self.builder(dims, "block");
        let f = dims.precision.accum_dtype();
        let (e, rows, d) = (dims.e(), dims.rows(), dims.d);
        let x = bl.g.input("x", e, f, true);
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
    pub fn final_layer(&self, dims: &Dims) -> Segment {
        let mut bl = self.builder(dims, "final");
        let f = dims.precision.accum_dtype();
        let (e, rows, d) = (dims.e(), dims.rows(), dims.d);
        let x = bl.g.input("x", e, f, true);
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

impl RuntimeModel for PyTorch {
    fn name(&self) -> &'static str {
        "pytorch"
    }

    fn embed_segment(&self, dims: &Dims) -> Segment {
        self.embed(dims)
    }

    fn block_segment(&self, dims: &Dims) -> Segment {
        self.block(dims)
    }

    fn final_segment(&self, dims: &Dims) -> Segment {
        self.final_layer(dims)
    }

    fn keeps_all_outputs(&self) -> bool {
        false
    }

    fn saves(&self, seg: &Segment, t: Tid) -> bool {
        seg.tensors[t].name.ends_with(SAVED)
    }

    fn round(&self, bytes: u64) -> u64 {
        match self.device {
            TorchDevice::Cpu => bytes,
            TorchDevice::Cuda => Self::cuda_block(bytes),
        }
    }
}

/// Bytes by kind inside one segment's simulation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Live {
    /// Saved activations (and the segment's output while it is alive).
    pub activations: u64,
    /// Autocast weight copies.
    pub weight_casts: u64,
    /// In-flight gradients and op scratch.
    pub workspace: u64,
    /// New parameter gradients (the `.grad` buffers this segment creates).
    pub gradients: u64,
}

impl Live {
    pub fn total(&self) -> u64 {
        self.activations + self.weight_casts + self.workspace + self.gradients
    }
}

/// What one segment costs under PyTorch's rules.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SegCost {
    /// The output storage (the next segment's input).
    pub output: u64,
    /// Saved by the tracked graph after the forward (output and inputs excluded).
    pub kept: Live,
    /// Autocast copies that only the cache holds: alive until the forward's autocast exits.
    pub cache_only: u64,
    /// Highest bytes above the start of a tracked forward (output included).
    pub fwd_peak: Live,
    /// Highest bytes above the start of a checkpointed forward (nothing saved; weight copies
    /// held by the autocast cache), output included.
    pub ckpt_peak: Live,
    /// Weight copies a checkpointed forward leaves in the autocast cache.
    pub ckpt_cache: u64,
    /// Worst moment of the backward, segment-local: what is left of the graph, the incoming
    /// gradient, in-flight gradients, scratch and the new parameter gradients.
    pub bwd_peak: Live,
    /// Gradients of the segment's inputs at the end of its backward.
    pub input_grads: u64,
    /// Parameter gradients the segment creates.
    pub param_grads: u64,
}

/// Simulate one segment: forward (tracked and checkpointed) and backward with PyTorch's
/// release rule — a saved storage is freed once the earliest op reading it has run its backward,
/// gradients are freed once consumed [AG]. `extra_grads` are tensors other than the output that
/// receive a gradient from outside (the conditioning vector c of the embed segment).
pub fn simulate(seg: &Segment, grad_in: u64, extra_grads: &[Tid]) -> SegCost {
    let n = seg.tensors.len();
    let storage = |mut t: Tid| -> Tid {
        while seg.tensors[t].kind == TensorKind::View {
            match seg.ops.iter().find(|o| o.output == t) {
                Some(op) => t = op.inputs[0],
                None => break,
            }
        }
        t
    };
    let out_st = storage(seg.output);
    let is_alloc = |t: Tid| seg.tensors[t].kind == TensorKind::Alloc;
    let is_cast = |t: Tid| seg.tensors[t].role == TensorRole::WeightCast;
    let bytes = |t: Tid| seg.tensors[t].bytes();
    let mut saved = vec![false; n];
    let mut cached = vec![false; n];
    let mut last_read = vec![None::<usize>; n];
    let mut first_read = vec![None::<usize>; n];
    for (k, op) in seg.ops.iter().enumerate() {
        let t = op.output;
        if seg.tensors[t].name.ends_with(SAVED) {
            saved[storage(t)] = true;
        }
        if seg.tensors[t].name.ends_with(CACHED) {
            cached[storage(t)] = true;
        }
        for &i in &op.inputs {
            let s = storage(i);
            last_read[s] = Some(last_read[s].map_or(k, |l| l.max(k)));
            first_read[s] = Some(first_read[s].map_or(k, |f| f.min(k)));
        }
    }
    let mut cost = SegCost {
        output: if is_alloc(out_st) { bytes(out_st) } else { 0 },
        ..SegCost::default()
    };
    let add = |l: &mut Live, t: Tid, sign: bool| {
        let slot = if is_cast(t) {
            &mut l.weight_casts
        } else {
            &mut l.activations
        };
        if sign {
            *slot += bytes(t);
        } else {
            *slot -= bytes(t);
        }
    };
    let max_live = |peak: &mut Live, cur: Live, scratch: u64| {
        let mut c = cur;
        c.workspace += scratch;
        if c.total() > peak.total() {
            *peak = c;
        }
    };

    // Forward, tracked (saved storages stay) and checkpointed (only the cache holds anything).
    for tracked in [true, false] {
        let mut live = Live::default();
        let mut peak = Live::default();
        let mut alive = vec![false; n];
        for (k, op) in seg.ops.iter().enumerate() {
            let t = op.output;
            if is_alloc(t) {
                add(&mut live, t, true);
                alive[t] = true;
            }
            if tracked {
                live.activations += op.extra_saved;
            }
            max_live(&mut peak, live, op.fwd_scratch);
            for s in 0..n {
                if alive[s] && s != out_st && last_read[s].unwrap_or(k) <= k {
                    let keep = (tracked && saved[s]) || (is_cast(s) && (saved[s] || cached[s]));
                    if !keep {
                        add(&mut live, s, false);
                        alive[s] = false;
                    }
                }
            }
        }
        if tracked {
            cost.fwd_peak = peak;
            for s in 0..n {
                if alive[s] && s != out_st {
                    if cached[s] && !saved[s] {
                        cost.cache_only += bytes(s);
                    } else {
                        add(&mut cost.kept, s, true);
                    }
                }
            }
            cost.kept.activations += seg.ops.iter().map(|o| o.extra_saved).sum::<u64>();
        } else {
            cost.ckpt_peak = peak;
            cost.ckpt_cache = (0..n).filter(|&s| alive[s] && s != out_st).map(bytes).sum();
        }
    }

    // Backward over the kept graph.
    let mut live = cost.kept;
    live.workspace += grad_in;
    let mut peak = live;
    let mut held = vec![false; n];
    for s in 0..n {
        held[s] = is_alloc(s) && s != out_st && saved[s];
    }
    let mut grad = vec![false; n];
    grad[seg.output] = true;
    for &t in extra_grads {
        grad[t] = true;
    }
    let mut grad_out_pending = true;
    for (k, op) in seg.ops.iter().enumerate().rev() {
        let o = op.output;
        let flows = grad[o] && seg.tensors[o].requires_grad;
        if flows {
            let is_view = seg.tensors[o].kind == TensorKind::View;
            let mut transient = 0;
            for &i in &op.inputs {
                let ti = &seg.tensors[i];
                if !ti.requires_grad {
                    continue;
                }
                match ti.kind {
                    TensorKind::Param { trained: true } => {
                        cost.param_grads += ti.bytes();
                        live.gradients += ti.bytes();
                    }
                    TensorKind::Param { .. } => {}
                    _ if grad[i] => {
                        // Accumulated into the existing buffer; a view's slice is copied in.
                        if !is_view {
                            transient += ti.bytes();
                        }
                    }
                    _ => {
                        grad[i] = true;
                        live.workspace += ti.bytes();
                    }
                }
            }
            max_live(&mut peak, live, transient + op.bwd_scratch);
            // The output's gradient is consumed.
            grad[o] = false;
            if o == seg.output && grad_out_pending {
                live.workspace -= grad_in;
                grad_out_pending = false;
            } else if extra_grads.contains(&o) {
                // An outside gradient: accounted by the caller.
            } else if !matches!(seg.tensors[o].kind, TensorKind::Input { .. }) {
                live.workspace -= seg.tensors[o].bytes();
            }
        }
        // Saved storages whose earliest reader has run its backward are released.
        for s in 0..n {
            if held[s] && first_read[s].is_none_or(|f| f >= k) {
                held[s] = false;
                add(&mut live, s, false);
            }
        }
        // Per-op extras (LayerNorm mean/rstd, the attention log-sum-exp) go with the op's node.
        live.activations = live.activations.saturating_sub(op.extra_saved);
    }
    cost.bwd_peak = peak;
    cost.input_grads = seg
        .tensors
        .iter()
        .enumerate()
        .filter(|(t, d)| {
            grad[*t]
                && matches!(
                    d.kind,
                    TensorKind::Input {
                        requires_grad: true
                    }
                )
        })
        .map(|(_, d)| d.bytes())
        .sum();
    cost
}

/// The runtime a spec names (the CPU default when the spec names another runtime).
pub fn for_spec(spec: &Spec) -> &'static PyTorch {
    match spec.runtime {
        crate::spec::Runtime::Pytorch { device, sdpa } => PyTorch::instance(device, sdpa),
        _ => PyTorch::instance(TorchDevice::Cpu, SdpaBackend::Auto),
    }
}

/// The three segments of a spec under PyTorch's rules.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Costs {
    pub embed: SegCost,
    pub block: SegCost,
    pub final_layer: SegCost,
}

pub fn costs(spec: &Spec) -> Costs {
    let rt = for_spec(spec);
    let dims = Dims::new(spec);
    let f = dims.precision.accum_dtype();
    let x_grad = dims.e() * f.size();
    let embed = rt.embed(&dims);
    let c = embed
        .ops
        .iter()
        .map(|o| o.output)
        .find(|&t| embed.tensors[t].name.starts_with("c = "))
        .map(|t| vec![t])
        .unwrap_or_default();
    let loss_grad = dims.precision.param_dtype().size();
    Costs {
        embed: simulate(&embed, x_grad, &c),
        block: simulate(&rt.block(&dims), x_grad, &[]),
        final_layer: simulate(&rt.final_layer(&dims), loss_grad, &[]),
    }
}

/// Transient bytes of the optimizer step over all trained tensors at once [OPT].
pub fn optimizer_scratch(trained_elems: u64, precision: Precision, optimizer: Optimizer) -> u64 {
    match optimizer {
        // `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`: a new state-sized list.
        Optimizer::AdamW | Optimizer::AdamW8bit => {
            trained_elems * precision.optimizer_dtype().size()
        }
        Optimizer::Sgd => 0,
    }
}

fn with(live: Breakdown, seg: Live) -> Breakdown {
    let mut b = live;
    b.activations += seg.activations;
    b.weight_casts += seg.weight_casts;
    b.workspace += seg.workspace;
    b.gradients += seg.gradients;
    b
}

/// Replay one optimizer step as the peer (`bench/torch_peer/peer.py`) runs it: per microbatch
/// the data, the forward under autocast (weight copies cached until it exits), the fp32 loss,
/// `loss.backward()` (each segment's graph released op by op, checkpointed blocks recomputed
/// first [CK]), then `optimizer.step()` [OPT], the EMA update and `zero_grad(set_to_none=True)`.
pub fn replay(
    spec: &Spec,
    table: &[ParamTensor],
    st: &StaticBytes,
    max_microbatches: u32,
) -> Vec<Event> {
    let c = costs(spec);
    let dims = Dims::new(spec);
    let r = &spec.recipe;
    let p = r.precision;
    let pd = p.param_dtype().size();
    let f = p.accum_dtype().size();
    let x_grad = dims.e() * f;
    let c_bytes = dims.b * dims.d * f;
    let trained: Vec<&ParamTensor> = table
        .iter()
        .filter(|t| t.role == ParamRole::Trained)
        .collect();
    let trained_elems: u64 = trained.iter().map(|t| t.numel()).sum();
    // AdamW keeps a 4-byte `step` tensor per parameter beside m and v (`state['step']`).
    let steps = if r.optimizer == Optimizer::Sgd {
        0
    } else {
        4 * trained.len() as u64
    };
    let base = Breakdown {
        weights: st.weights,
        master_weights: st.master_weights,
        optimizer_state: st.optimizer_state + steps,
        ema: st.ema,
        ..Breakdown::default()
    };
    let mut ev = Events::default();
    ev.push(Phase::Start, "step start".into(), None, 0, false, base);
    let mut live = base;
    let depth = spec.model.depth;
    let w = &spec.workload;
    for mb in 0..w.accumulation.min(max_microbatches.max(1)) {
        let first = mb == 0;
        // x0, noise (the ε target), ᾱ_t, t and y (int64).
        let target = if r.prediction == Prediction::V {
            dims.latent * pd
        } else {
            0
        };
        let kept_data = dims.latent * pd + 8 * dims.b + target;
        live.data = kept_data + dims.latent * pd + dims.b * (pd + 8);
        // Forward.
        let mut cache = 0;
        let e = c.embed;
        ev.push(
            Phase::Forward,
            "embed (inside)".into(),
            None,
            mb,
            true,
            with(live, e.fwd_peak),
        );
        live.activations += e.kept.activations + e.output;
        live.weight_casts += e.kept.weight_casts;
        cache += e.cache_only;
        live.weight_casts += e.cache_only;
        ev.push(Phase::Forward, "embed".into(), None, mb, false, live);
        let b = c.block;
        for i in 0..depth {
            let ck = r.recompute.recomputes_block(i);
            let peak = if ck { b.ckpt_peak } else { b.fwd_peak };
            ev.push(
                Phase::Forward,
                format!("block {i} (inside)"),
                Some(i),
                mb,
                true,
                with(live, peak),
            );
            live.activations += b.output;
            if ck {
                cache += b.ckpt_cache;
                live.weight_casts += b.ckpt_cache;
            } else {
                live.activations += b.kept.activations;
                live.weight_casts += b.kept.weight_casts + b.cache_only;
                cache += b.cache_only;
            }
            ev.push(
                Phase::Forward,
                format!("block {i}"),
                Some(i),
                mb,
                false,
                live,
            );
        }
        let fl = c.final_layer;
        ev.push(
            Phase::Forward,
            "final + loss (inside)".into(),
            None,
            mb,
            true,
            with(live, fl.fwd_peak),
        );
        live.activations += fl.kept.activations + fl.output;
        live.weight_casts += fl.kept.weight_casts + fl.cache_only;
        cache += fl.cache_only;
        ev.push(Phase::Forward, "loss".into(), None, mb, false, live);
        // Autocast exits: copies only the cache held are freed; x0 and ᾱ go with the forward.
        live.weight_casts -= cache;
        live.data = kept_data;

        // Backward: the final layer, then blocks in reverse, then the embedder.
        let back = |live: &mut Breakdown, s: &SegCost, grad_in: u64| -> Breakdown {
            let mut at = *live;
            at.activations -= s.kept.activations;
            at.weight_casts -= s.kept.weight_casts;
            at.workspace -= grad_in;
            let mut peak = s.bwd_peak;
            if !first {
                // The new gradient is added into the existing `.grad` and freed.
                peak.workspace += peak.gradients;
                peak.gradients = 0;
            }
            with(at, peak)
        };
        let inside = back(&mut live, &fl, 0);
        ev.push(
            Phase::Backward,
            "final + loss (inside)".into(),
            None,
            mb,
            true,
            inside,
        );
        live.activations -= fl.kept.activations + fl.output + b.output;
        live.weight_casts -= fl.kept.weight_casts;
        live.workspace += x_grad + c_bytes;
        if first {
            live.gradients += fl.param_grads;
        }
        ev.push(
            Phase::Backward,
            "final + loss".into(),
            None,
            mb,
            false,
            live,
        );
        for i in (0..depth).rev() {
            let ck = r.recompute.recomputes_block(i);
            if ck {
                // Recompute under the same autocast state, with the incoming gradient alive.
                ev.push(
                    Phase::Backward,
                    format!("block {i} recompute (inside)"),
                    Some(i),
                    mb,
                    true,
                    with(live, b.fwd_peak),
                );
                live.activations += b.kept.activations;
                live.weight_casts += b.kept.weight_casts;
            }
            let inside = back(&mut live, &b, x_grad);
            ev.push(
                Phase::Backward,
                format!("block {i} (inside)"),
                Some(i),
                mb,
                true,
                inside,
            );
            live.activations -= b.kept.activations;
            live.weight_casts -= b.kept.weight_casts;
            // The block's input (the previous segment's output) is released with norm1's node.
            live.activations -= if i == 0 { e.output } else { b.output };
            if first {
                live.gradients += b.param_grads;
            }
            ev.push(
                Phase::Backward,
                format!("block {i}"),
                Some(i),
                mb,
                false,
                live,
            );
        }
        let inside = back(&mut live, &e, x_grad);
        ev.push(
            Phase::Backward,
            "embed (inside)".into(),
            None,
            mb,
            true,
            inside,
        );
        live.activations -= e.kept.activations;
        live.weight_casts -= e.kept.weight_casts;
        live.workspace -= x_grad + c_bytes;
        if first {
            live.gradients += e.param_grads;
        }
        live.data = 0;
        ev.push(Phase::Backward, "embed".into(), None, mb, false, live);
    }
    // Optimizer step, EMA, zero_grad.
    if trained_elems > 0 {
        let mut at = live;
        at.workspace += optimizer_scratch(trained_elems, p, r.optimizer);
        ev.push(
            Phase::Optimizer,
            format!("{} (inside)", r.optimizer.name()),
            None,
            0,
            true,
            at,
        );
        if r.ema.enabled && r.ema.dtype != p.param_dtype() {
            // `p.detach().to(ema dtype)` for every parameter before the foreach update.
            let mut at = live;
            at.workspace += trained_elems * r.ema.dtype.size();
            ev.push(Phase::Optimizer, "ema (inside)".into(), None, 0, true, at);
        }
    }
    live.gradients = 0;
    ev.push(Phase::Optimizer, "step end".into(), None, 0, false, live);
    ev.0
}
