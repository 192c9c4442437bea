//! The ops of eager PyTorch as graph builders: each adds what the op allocates to a [`Segment`]
//! and marks what its autograd node saves for backward (the rule sources [AG], [MM], [AC],
//! [SDPA] are listed in the folder's `mod.rs`). The DiT's rules (`rules.rs`) and every family's
//! (`families/`) are written with them.

mod attn;
mod cpu_scratch;
mod cross;
mod joint;
mod sana;

pub(crate) use attn::Attn;
pub(crate) use cpu_scratch::{cpu_flash_scratch, cpu_gemm_scratch};

use crate::runtime::pytorch::device::PyTorch;
use crate::segment::{Segment, Tid};
use crate::spec::{AttentionMode, Dtype, Precision, SdpaBackend, TorchDevice};

/// Marker appended to the name of a tensor that some op saves for backward.
pub(crate) const SAVED: &str = " [saved]";
/// Marker of an autocast weight copy that only the autocast cache holds (until the forward ends).
pub(crate) const CACHED: &str = " [autocast cache]";
/// Marker on the name of a matmul (a linear's `addmm`/`mm` on the 2-D view of its input): the
/// input's gradient it makes is a reshape view of its 2-D result, which autograd's
/// `InputBuffer` cannot add a second gradient into in place (see
/// [`crate::runtime::pytorch::allocator::simulate`]).
pub(crate) const MATMUL: &str = " [matmul]";
/// Marker on the name of a matmul whose right operand (a weight) needs no gradient: its node
/// saves only what `mat1`'s gradient reads (`grad.mm(mat2.t())`), not its left operand [AG]
/// (`tools/autograd/derivatives.yaml` `addmm`/`mm`: `self` is saved for `mat2`'s gradient only).
/// A frozen base layer under LoRA reads its input this way; the release rule
/// ([`crate::runtime::pytorch::allocator::simulate`]) does not count it as a saver.
pub(crate) const LEFT_UNSAVED: &str = " [matmul, weight frozen]";
/// Marks a concatenation (`torch.cat`) whose backward hands its inputs slices of its own
/// gradient (`CatBackward0`: `cat_tensors_backward` returns `grad.narrow(dim, …)` views,
/// `tools/autograd/derivatives.yaml`, torch 2.15): the inputs' gradients are no new buffers,
/// and the concatenation's gradient stays allocated until the last of them is consumed
/// (`allocator.rs`). Used where the segment itself made every input.
pub(crate) const GRAD_VIEWS: &str = " (cat: input gradients are views)";

/// Dtype of an elementwise result under type promotion (the wider float wins).
pub(crate) fn promote(a: Dtype, b: Dtype) -> Dtype {
    if a.size() >= b.size() {
        a
    } else {
        b
    }
}

/// Mark `t` as saved for backward by some op.
pub(crate) fn save(g: &mut Segment, t: Tid) {
    let name = &mut g.tensors[t].name;
    if !name.ends_with(SAVED) {
        name.push_str(SAVED);
    }
}

/// LoRA on some linears: rank and the PEFT `target_modules` names.
#[derive(Debug, Clone)]
pub(crate) struct LoraOn {
    pub rank: u64,
    pub modules: Vec<String>,
    /// The adapters' dtype ([`crate::spec::Recipe::trained_dtype`]): fp32, or the weight dtype
    /// under `lora.dtype = "weight"` (then autocast's casts and PEFT's input cast are no-ops).
    pub dtype: Dtype,
}

/// The shape of one `F.linear(x, W[, b])`: `rows` of x (its leading dimensions folded), the
/// weight's `out × inp` features, and whether the module has a bias. Every linear builder takes
/// one ([`Builder::linear_opt`] and its variants differ only in what autograd saves).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lin {
    pub rows: u64,
    pub out: u64,
    pub inp: u64,
    pub bias: bool,
}

impl Lin {
    pub(crate) fn new(rows: u64, out: u64, inp: u64, bias: bool) -> Lin {
        Lin {
            rows,
            out,
            inp,
            bias,
        }
    }

    /// `(rows, out, inp, r)`: the shape of rank-`r` LoRA adapters on this linear.
    pub(crate) fn with_rank(self, r: u64) -> (u64, u64, u64, u64) {
        (self.rows, self.out, self.inp, r)
    }
}

/// One forward graph under construction, with the precision rules of the spec.
pub(crate) struct Builder<'a> {
    pub rt: &'a PyTorch,
    pub precision: Precision,
    pub attention: AttentionMode,
    /// LoRA on a diffusers model's linears (the original DiT's rules take none).
    pub lora: Option<LoraOn>,
    /// Threads of PyTorch's intra-op pool (`torch.get_num_threads()`): the CPU flash attention
    /// allocates a scratch per thread ([`cpu_flash_scratch`]). The spec's `cpu.threads`.
    pub threads: u64,
    pub g: Segment,
}

impl<'a> Builder<'a> {
    pub(crate) fn new(
        rt: &'a PyTorch,
        precision: Precision,
        attention: AttentionMode,
        name: &str,
    ) -> Self {
        Builder {
            rt,
            precision,
            attention,
            lora: None,
            threads: u64::from(crate::spec::CpuSpec::REFERENCE.threads),
            g: Segment::new(name),
        }
    }

    /// Whether autocast is on (mixed precision with fp32 master weights) [AC].
    pub(crate) fn autocast(&self) -> bool {
        self.precision.is_mixed()
    }

    /// Dtype the trained parameters are stored in.
    pub(crate) fn param_dtype(&self) -> Dtype {
        self.precision.param_dtype()
    }

    /// Dtype of the LoRA adapters (the parameter dtype without LoRA).
    fn adapter_dtype(&self) -> Dtype {
        self.lora.as_ref().map_or(self.param_dtype(), |l| l.dtype)
    }

    /// Dtype of matmul / conv / SDPA outputs.
    pub(crate) fn low(&self) -> Dtype {
        self.precision.compute_dtype()
    }

    /// Dtype of frozen weights: a LoRA base is cast to the compute dtype (`weight_dtype` in the
    /// diffusers scripts), everything trained keeps the parameter dtype.
    fn frozen(&self) -> bool {
        self.lora.is_some()
    }

    /// The tensor an autocast-listed op reads: itself, or a new cast copy [AC].
    pub(crate) fn cast_low(&mut self, name: &str, x: Tid) -> Tid {
        let low = self.low();
        self.g.cast(&format!("{name} →{low}"), x, low)
    }

    /// A parameter read outside autocast's list (a norm's weight, a scale-shift table): the
    /// stored tensor itself, trained in the parameter dtype, or a frozen LoRA base already cast
    /// to the compute dtype (`weight_dtype` in the diffusers scripts).
    pub(crate) fn plain_param(&mut self, name: &str, elems: u64) -> Tid {
        if self.frozen() {
            let low = self.low();
            self.g.param(name, elems, low, false)
        } else {
            let pd = self.param_dtype();
            self.g.param(name, elems, pd, true)
        }
    }

    /// A parameter as an autocast-listed op reads it: trained (and, under autocast, its cached
    /// low-precision copy [AC], marked saved: the autocast cache holds it for the rest of the
    /// forward and the op that reads it keeps it for backward), or a frozen LoRA base already in
    /// the compute dtype (no copy; it is a parameter, so saving it costs nothing).
    pub(crate) fn weight(&mut self, name: &str, elems: u64) -> Tid {
        let p = self.plain_param(name, elems);
        if self.frozen() {
            return p;
        }
        let c = self.cast_low(name, p);
        save(&mut self.g, c);
        c
    }

    /// A parameter whose autocast copy only the cache holds (a bias: `addmm` does not save it).
    pub(crate) fn cached_weight(&mut self, name: &str, elems: u64) -> Tid {
        let p = self.plain_param(name, elems);
        if self.frozen() {
            return p;
        }
        let c = self.cast_low(name, p);
        if c != p {
            self.g.tensors[c].name.push_str(CACHED);
        }
        c
    }

    /// `F.linear(x, W, b)` with a bias: see [`Builder::linear_opt`].
    pub(crate) fn linear(&mut self, name: &str, x: Tid, rows: u64, out: u64, inp: u64) -> Tid {
        self.linear_opt(name, x, Lin::new(rows, out, inp, true))
    }

    /// `F.linear(x, W[, b])`: `addmm` on the 2-D view of x saves the (cast) input when the weight
    /// needs a gradient and the (cast) weight when the input does [AG][AC] (autograd saves a
    /// variable only for the outputs that need it); the output is in the compute dtype and is not
    /// saved by this op. Under LoRA on this module (PEFT `lora.Linear.forward`): the frozen base,
    /// then `lora_B(lora_A(x)) · scaling` added to it, the adapters trained.
    pub(crate) fn linear_opt(&mut self, name: &str, x: Tid, l: Lin) -> Tid {
        let y = self.linear_base(name, x, l, true);
        match self.lora_rank(name) {
            Some(r) => self.lora_adapters(name, x, y, l.with_rank(r), true),
            None => y,
        }
    }

    /// The operands of an autocast-listed op with a weight (`F.linear`, `conv`) in the order the
    /// graph makes them: the weight (`weight_saved`: [`Builder::weight`]; else its copy only sits
    /// in the autocast cache, [`Builder::cached_weight`]), the bias's cached copy, the input's cast
    /// copy [AC]. Returns `[input, weight(, bias)]`.
    fn weighted_operands(
        &mut self,
        name: &str,
        x: Tid,
        w_elems: u64,
        bias: Option<u64>,
        weight_saved: bool,
    ) -> Vec<Tid> {
        let wn = format!("{name}.weight");
        let w = if weight_saved {
            self.weight(&wn, w_elems)
        } else {
            self.cached_weight(&wn, w_elems)
        };
        let mut ins = vec![0, w];
        if let Some(be) = bias {
            ins.push(self.cached_weight(&format!("{name}.bias"), be));
        }
        ins[0] = self.cast_low(&format!("{name} input"), x);
        ins
    }

    /// `F.linear(x, W[, b])` without an adapter (a frozen LoRA base is one too): `addmm`/`mm` on
    /// the 2-D view of x saves the (cast) input when the weight is trained, the (cast) weight
    /// when `weight_saved` (x needs a gradient: `mat1: grad.mm(mat2.t())`) [AG][AC].
    fn linear_base(&mut self, name: &str, x: Tid, l: Lin, weight_saved: bool) -> Tid {
        let ins = self.weighted_operands(
            name,
            x,
            l.out * l.inp,
            l.bias.then_some(l.out),
            weight_saved,
        );
        if !self.frozen() {
            save(&mut self.g, ins[0]);
        }
        self.product(name, &ins, l.rows, l.inp, l.out)
    }

    /// The rank of LoRA on a module, when the spec adapts it (PEFT's name match).
    fn lora_rank(&self, module: &str) -> Option<u64> {
        let l = self.lora.as_ref()?;
        l.modules
            .iter()
            .any(|k| crate::denoiser::matches_module(module, k))
            .then_some(l.rank)
    }

    /// PEFT's `result = result + lora_B(lora_A(dropout(x))) * scaling` (dropout 0: identity) on
    /// the base's output `base`, with `(rows, out, inp, r)` the linear's shape and the rank:
    /// `lora_A` (trained, in the adapters' dtype) reads `xa` cast for it and saves that cast;
    /// its weight (the autocast copy) is saved when `a_saved` (`mm` saves `mat2` for `mat1`'s
    /// gradient [AG]), else the copy only sits in the autocast cache [AC]; `lora_B` saves A's
    /// output; the scaling and the sum make two output-sized tensors.
    fn lora_adapters(
        &mut self,
        name: &str,
        xa: Tid,
        base: Tid,
        (rows, out, inp, r): (u64, u64, u64, u64),
        a_saved: bool,
    ) -> Tid {
        let pd = self.adapter_dtype();
        let low = self.low();
        let ap = self
            .g
            .param(&format!("{name}.lora_A.weight"), r * inp, pd, true);
        let a = self.cast_low(&format!("{name}.lora_A"), ap);
        if a_saved {
            save(&mut self.g, a);
        } else if a != ap {
            self.g.tensors[a].name.push_str(CACHED);
        }
        let xa = self.cast_low(&format!("{name}.lora_A input"), xa);
        save(&mut self.g, xa);
        let ha = self.product(&format!("{name}.lora_A"), &[xa, a], rows, inp, r);
        save(&mut self.g, ha);
        let bw = self
            .g
            .param(&format!("{name}.lora_B.weight"), out * r, pd, true);
        let bw = self.cast_low(&format!("{name}.lora_B"), bw);
        save(&mut self.g, bw);
        let hb = self.product(&format!("{name}.lora_B"), &[ha, bw], rows, r, out);
        let sc = self
            .g
            .op(&format!("{name} lora ·scaling"), &[hb], rows * out, low);
        let bdt = self.g.dtype(base);
        self.g.op(
            &format!("{name} + lora"),
            &[base, sc],
            rows * out,
            promote(bdt, low),
        )
    }

    /// PEFT `lora.Linear.forward` after `result = base_layer(x)` (peft 0.21
    /// `tuners/lora/layer.py`): `x = self._cast_input_dtype(x, lora_A.weight.dtype)` is `xa0`
    /// (a copy of a low-precision x into the adapters' dtype, or x itself), then the adapters
    /// ([`Builder::lora_adapters`]; lora_A's weight saved for x's gradient). PEFT binds the copy
    /// to `x` until `Linear.forward` returns, after the sum; the caller (diffusers
    /// `FeedForward.forward`'s `hidden_states = module(hidden_states)`, the attention
    /// processor's locals) holds the input itself for the whole call. family_trace.py on
    /// dit-bf16-lora16ff-none: the fp32 copy of ff.net.2's input and the GELU output it was made
    /// from are both alive at the forward peak, inside lora_B's mm.
    fn lora_after_base(
        &mut self,
        name: &str,
        (x, xa0): (Tid, Tid),
        base: Tid,
        shape: (u64, u64, u64, u64),
    ) -> Tid {
        let a_saved = self.rg(x);
        let sum = self.lora_adapters(name, xa0, base, shape, a_saved);
        let held: Vec<Tid> = if xa0 != x { vec![xa0, x] } else { vec![x] };
        self.hold(&format!("{name} lora forward"), &held);
        sum
    }

    /// `LayerNorm(D, elementwise_affine=False)`: saves its input and fp32 mean + rstd per row
    /// [AG] (the input's dtype on the CPU kernel, fp32 accumulation on CUDA); the output keeps
    /// the input's dtype (CPU autocast does not list `layer_norm`; CUDA lists it as fp32, and the
    /// DiT's residual stream is fp32 there anyway) [AC].
    pub(crate) fn layer_norm(&mut self, name: &str, x: Tid, rows: u64) -> Tid {
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

    /// `x·(1 + scale[:, None]) + shift[:, None]` over `bd` = b·D modulation elements: `1 + scale`
    /// is a new (b, 1, D) tensor; the mul saves both operands (both need a gradient); the add
    /// saves nothing [AG].
    pub(crate) fn modulate(&mut self, name: &str, xn: Tid, shift: Tid, scale: Tid, bd: u64) -> Tid {
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
    pub(crate) fn ada_ln(&mut self, name: &str, c: Tid, k: u64, b: u64, d: u64) -> Vec<Tid> {
        save(&mut self.g, c);
        let cdt = self.g.dtype(c);
        let silu = self.g.op(&format!("{name} silu(c)"), &[c], b * d, cdt);
        let m = self.linear(name, silu, b, k * d, d);
        (0..k)
            .map(|i| self.g.view(&format!("{name} chunk {i}"), m, b * d))
            .collect()
    }

    /// `scaled_dot_product_attention(q, k, v)` with the spec's attention mode, or its explicit
    /// math; q, k and v in the (b, s, heads, dh) layout of a projection (views). Returns the
    /// output in (b, sq, heads·dh).
    pub(crate) fn attention(&mut self, q: Tid, k: Tid, v: Tid, at: Attn) -> Tid {
        if self.attention == AttentionMode::MemoryEfficient {
            match self.rt.effective_sdpa(self.precision) {
                SdpaBackend::Math => return self.sdpa_math(q, k, v, at),
                backend => return self.sdpa_fused(q, k, v, at, backend),
            }
        }
        self.explicit_attention(q, k, v, at)
    }

    /// The fused SDPA kernels [SDPA]: save q, k, v, their output and an fp32 log-sum-exp (the
    /// memory-efficient kernel pads rows to 32); the output layout (b, s, heads, dh) makes the
    /// transpose + reshape after it a view.
    fn sdpa_fused(&mut self, q: Tid, k: Tid, v: Tid, at: Attn, backend: SdpaBackend) -> Tid {
        for t in [q, k, v] {
            save(&mut self.g, t);
        }
        let lse_rows = if backend == SdpaBackend::Efficient {
            at.b * at.heads * at.sq.div_ceil(32) * 32
        } else {
            at.b * at.heads * at.sq
        };
        let low = self.low();
        let o = self.g.op("sdpa out", &[q, k, v], at.q_elems(), low);
        save(&mut self.g, o);
        // CPU flash allocates per-thread blocks of scores for the call; CUDA kernels tile in SRAM.
        let (fwd, bwd) = if self.rt.device == TorchDevice::Cpu && backend == SdpaBackend::Flash {
            cpu_flash_scratch(self.threads, at, low)
        } else {
            (0, 0)
        };
        self.g.annotate(o, lse_rows * 4, fwd, bwd);
        self.g.view("attn out (b, s, D) view", o, at.q_elems())
    }

    /// The scores of a composite attention: q (`q_label` names its reshape) and kᵀ reshaped
    /// for `bmm`, both saved (the bmm's backward reads them), then their product `label` in
    /// `dt` [MM].
    fn bmm_scores(
        &mut self,
        (q, q_label): (Tid, &str),
        k: Tid,
        label: &str,
        at: Attn,
        dt: Dtype,
    ) -> Tid {
        let qc = self.g.op(q_label, &[q], at.q_elems(), dt);
        let kc = self.g.op("kᵀ reshaped for bmm", &[k], at.kv_elems(), dt);
        save(&mut self.g, qc);
        save(&mut self.g, kc);
        self.g.op(label, &[qc, kc], at.scores(), dt)
    }

    /// P·v of a composite attention: v reshaped for `bmm` and saved (the bmm's backward reads
    /// it), then the product in `dt` [MM].
    fn bmm_pv(&mut self, p: Tid, v: Tid, at: Attn, dt: Dtype) -> Tid {
        let vc = self.g.op("v reshaped for bmm", &[v], at.kv_elems(), dt);
        save(&mut self.g, vc);
        self.g.op("P·v", &[p, vc], at.q_elems(), dt)
    }

    /// timm's explicit path: q·scale, (q @ kᵀ), softmax, (P @ v) [MM][AG][AC].
    fn explicit_attention(&mut self, q: Tid, k: Tid, v: Tid, at: Attn) -> Tid {
        let low = self.low();
        let (eq, a) = (at.q_elems(), at.scores());
        let qs = self.g.op("q·scale", &[q], eq, low);
        let scores = self.bmm_scores((qs, "q·scale reshaped for bmm"), k, "scores q·kᵀ", at, low);
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
        let o = self.bmm_pv(pc, v, at, low);
        // (b, a, s, d) → transpose(1, 2).reshape(b, s, D) copies [MM].
        self.g.op("attn out (b, s, D) copy", &[o], eq, low)
    }

    /// The SDPA math backend: composite ops; fp16/bf16 inputs are upcast to fp32 on CUDA since
    /// PyTorch 2.5 [SDPA]; q and k are both scaled by √scale [SDPA][MM].
    fn sdpa_math(&mut self, q: Tid, k: Tid, v: Tid, at: Attn) -> Tid {
        let (eq, ekv, a) = (at.q_elems(), at.kv_elems(), at.scores());
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
        let qs = self.g.op("q·√scale", &[q], eq, wd);
        let ks = self.g.op("k·√scale", &[k], ekv, wd);
        let scores = self.bmm_scores((qs, "q reshaped for bmm"), ks, "scores", at, wd);
        let p = self.g.op("softmax P", &[scores], a, wd);
        save(&mut self.g, p);
        let o = self.bmm_pv(p, v, at, wd);
        let o = self.g.cast(&format!("sdpa out →{low}"), o, low);
        self.g.op("attn out (b, s, D) copy", &[o], eq, low)
    }
}
