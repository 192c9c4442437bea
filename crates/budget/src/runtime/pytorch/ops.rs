//! The ops of eager PyTorch as graph builders: each adds what the op allocates to a [`Segment`]
//! and marks what its autograd node saves for backward (the rule sources [AG], [MM], [AC],
//! [SDPA] are listed in the folder's `mod.rs`). The DiT's rules (`rules.rs`) and every family's
//! (`families/`) are written with them.

use crate::runtime::pytorch::device::PyTorch;
use crate::segment::{Segment, Tid};
use crate::spec::{AttentionMode, Dtype, Precision, SdpaBackend, TorchDevice};

/// Marker appended to the name of a tensor that some op saves for backward.
pub const SAVED: &str = " [saved]";
/// Marker of an autocast weight copy that only the autocast cache holds (until the forward ends).
pub const CACHED: &str = " [autocast cache]";
/// Marker on the name of a matmul (a linear's `addmm`/`mm` on the 2-D view of its input): the
/// input's gradient it makes is a reshape view of its 2-D result, which autograd's
/// `InputBuffer` cannot add a second gradient into in place (see
/// [`crate::runtime::pytorch::allocator::simulate`]).
pub const MATMUL: &str = " [matmul]";
/// Marker on the name of a matmul whose right operand (a weight) needs no gradient: its node
/// saves only what `mat1`'s gradient reads (`grad.mm(mat2.t())`), not its left operand [AG]
/// (`tools/autograd/derivatives.yaml` `addmm`/`mm`: `self` is saved for `mat2`'s gradient only).
/// A frozen base layer under LoRA reads its input this way; the release rule
/// ([`crate::runtime::pytorch::allocator::simulate`]) does not count it as a saver.
pub const LEFT_UNSAVED: &str = " [matmul, weight frozen]";
/// Marks a concatenation (`torch.cat`) whose backward hands its inputs slices of its own
/// gradient (`CatBackward0`: `cat_tensors_backward` returns `grad.narrow(dim, …)` views,
/// `tools/autograd/derivatives.yaml`, torch 2.15): the inputs' gradients are no new buffers,
/// and the concatenation's gradient stays allocated until the last of them is consumed
/// (`allocator.rs`). Used where the segment itself made every input.
pub const GRAD_VIEWS: &str = " (cat: input gradients are views)";

/// Dtype of an elementwise result under type promotion (the wider float wins).
pub fn promote(a: Dtype, b: Dtype) -> Dtype {
    if a.size() >= b.size() {
        a
    } else {
        b
    }
}

/// Mark `t` as saved for backward by some op.
pub fn save(g: &mut Segment, t: Tid) {
    let name = &mut g.tensors[t].name;
    if !name.ends_with(SAVED) {
        name.push_str(SAVED);
    }
}

/// LoRA on some linears: rank and the PEFT `target_modules` names.
#[derive(Debug, Clone)]
pub struct LoraOn {
    pub rank: u64,
    pub modules: Vec<String>,
    /// The adapters' dtype ([`crate::spec::Recipe::trained_dtype`]): fp32, or the weight dtype
    /// under `lora.dtype = "weight"` (then autocast's casts and PEFT's input cast are no-ops).
    pub dtype: Dtype,
}

/// The geometry of one attention call: q (b, heads, sq, dh), k and v (b, heads, skv, dh).
#[derive(Debug, Clone, Copy)]
pub struct Attn {
    pub b: u64,
    pub heads: u64,
    pub sq: u64,
    pub skv: u64,
    pub dh: u64,
}

impl Attn {
    pub fn q_elems(&self) -> u64 {
        self.b * self.heads * self.sq * self.dh
    }
    pub fn kv_elems(&self) -> u64 {
        self.b * self.heads * self.skv * self.dh
    }
    pub fn scores(&self) -> u64 {
        self.b * self.heads * self.sq * self.skv
    }
}

/// One forward graph under construction, with the precision rules of the spec.
pub struct Builder<'a> {
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
    pub fn new(
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
    pub fn autocast(&self) -> bool {
        self.precision.is_mixed()
    }

    /// Dtype the trained parameters are stored in.
    pub fn param_dtype(&self) -> Dtype {
        self.precision.param_dtype()
    }

    /// Dtype of the LoRA adapters (the parameter dtype without LoRA).
    fn adapter_dtype(&self) -> Dtype {
        self.lora.as_ref().map_or(self.param_dtype(), |l| l.dtype)
    }

    /// Dtype of matmul / conv / SDPA outputs.
    pub fn low(&self) -> Dtype {
        self.precision.compute_dtype()
    }

    /// Dtype of frozen weights: a LoRA base is cast to the compute dtype (`weight_dtype` in the
    /// diffusers scripts), everything trained keeps the parameter dtype.
    fn frozen(&self) -> bool {
        self.lora.is_some()
    }

    /// The tensor an autocast-listed op reads: itself, or a new cast copy [AC].
    pub fn cast_low(&mut self, name: &str, x: Tid) -> Tid {
        let low = self.low();
        self.g.cast(&format!("{name} →{low}"), x, low)
    }

    /// A parameter as an autocast-listed op reads it: trained (and, under autocast, its cached
    /// low-precision copy [AC], marked saved: the autocast cache holds it for the rest of the
    /// forward and the op that reads it keeps it for backward), or a frozen LoRA base already in
    /// the compute dtype (no copy; it is a parameter, so saving it costs nothing).
    pub fn weight(&mut self, name: &str, elems: u64) -> Tid {
        if self.frozen() {
            let low = self.low();
            return self.g.param(name, elems, low, false);
        }
        let pd = self.param_dtype();
        let p = self.g.param(name, elems, pd, true);
        let c = self.cast_low(name, p);
        save(&mut self.g, c);
        c
    }

    /// A parameter whose autocast copy only the cache holds (a bias: `addmm` does not save it).
    pub fn cached_weight(&mut self, name: &str, elems: u64) -> Tid {
        if self.frozen() {
            let low = self.low();
            return self.g.param(name, elems, low, false);
        }
        let pd = self.param_dtype();
        let p = self.g.param(name, elems, pd, true);
        let c = self.cast_low(name, p);
        if c != p {
            self.g.tensors[c].name.push_str(CACHED);
        }
        c
    }

    /// A parameter read outside autocast's list (a norm's weight, a scale-shift table): the
    /// stored tensor itself.
    pub fn plain_param(&mut self, name: &str, elems: u64) -> Tid {
        if self.frozen() {
            let low = self.low();
            self.g.param(name, elems, low, false)
        } else {
            let pd = self.param_dtype();
            self.g.param(name, elems, pd, true)
        }
    }

    /// `F.linear(x, W, b)` with a bias: see [`Builder::linear_opt`].
    pub fn linear(&mut self, name: &str, x: Tid, rows: u64, out: u64, inp: u64) -> Tid {
        self.linear_opt(name, x, rows, out, inp, true)
    }

    /// `F.linear(x, W[, b])`: `addmm` on the 2-D view of x saves the (cast) input when the weight
    /// needs a gradient and the (cast) weight when the input does [AG][AC] (autograd saves a
    /// variable only for the outputs that need it); the output is in the compute dtype and is not
    /// saved by this op. Under LoRA on this module (PEFT `lora.Linear.forward`): the frozen base,
    /// then `lora_B(lora_A(x)) · scaling` added to it, the adapters trained.
    pub fn linear_opt(
        &mut self,
        name: &str,
        x: Tid,
        rows: u64,
        out: u64,
        inp: u64,
        bias: bool,
    ) -> Tid {
        let w = self.weight(&format!("{name}.weight"), out * inp);
        let mut ins = vec![0, w];
        if bias {
            ins.push(self.cached_weight(&format!("{name}.bias"), out));
        }
        let xin = self.cast_low(&format!("{name} input"), x);
        ins[0] = xin;
        if !self.frozen() {
            save(&mut self.g, xin);
        }
        let y = self.product(name, &ins, rows, inp, out);
        match self.lora_rank(name) {
            Some(r) => self.lora_branch(name, x, y, rows, out, inp, r),
            None => y,
        }
    }

    /// The rank of LoRA on a module, when the spec adapts it (PEFT's name match).
    fn lora_rank(&self, module: &str) -> Option<u64> {
        let l = self.lora.as_ref()?;
        l.modules
            .iter()
            .any(|k| crate::denoiser::matches_module(module, k))
            .then_some(l.rank)
    }

    /// PEFT's `result = result + lora_B(lora_A(dropout(x))) * scaling` (dropout 0: identity):
    /// `lora_A` (fp32, trained) reads the input cast for it and saves it, `lora_B` saves A's
    /// output; the scaling and the sum make two output-sized tensors.
    #[allow(clippy::too_many_arguments)]
    fn lora_branch(
        &mut self,
        name: &str,
        x: Tid,
        base: Tid,
        rows: u64,
        out: u64,
        inp: u64,
        r: u64,
    ) -> Tid {
        let pd = self.adapter_dtype();
        let low = self.low();
        let a = self
            .g
            .param(&format!("{name}.lora_A.weight"), r * inp, pd, true);
        let a = self.cast_low(&format!("{name}.lora_A"), a);
        save(&mut self.g, a);
        let xa = self.cast_low(&format!("{name}.lora_A input"), x);
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

    /// `LayerNorm(D, elementwise_affine=False)`: saves its input and fp32 mean + rstd per row
    /// [AG] (the input's dtype on the CPU kernel, fp32 accumulation on CUDA); the output keeps
    /// the input's dtype (CPU autocast does not list `layer_norm`; CUDA lists it as fp32, and the
    /// DiT's residual stream is fp32 there anyway) [AC].
    pub fn layer_norm(&mut self, name: &str, x: Tid, rows: u64) -> Tid {
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
    pub fn modulate(&mut self, name: &str, xn: Tid, shift: Tid, scale: Tid, bd: u64) -> Tid {
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
    pub fn ada_ln(&mut self, name: &str, c: Tid, k: u64, b: u64, d: u64) -> Vec<Tid> {
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
    pub fn attention(&mut self, q: Tid, k: Tid, v: Tid, at: Attn) -> Tid {
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

    /// timm's explicit path: q·scale, (q @ kᵀ), softmax, (P @ v) [MM][AG][AC].
    fn explicit_attention(&mut self, q: Tid, k: Tid, v: Tid, at: Attn) -> Tid {
        let low = self.low();
        let (eq, ekv, a) = (at.q_elems(), at.kv_elems(), at.scores());
        let qs = self.g.op("q·scale", &[q], eq, low);
        let qc = self.g.op("q·scale reshaped for bmm", &[qs], eq, low);
        let kc = self.g.op("kᵀ reshaped for bmm", &[k], ekv, low);
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
        let vc = self.g.op("v reshaped for bmm", &[v], ekv, low);
        save(&mut self.g, vc);
        let o = self.g.op("P·v", &[pc, vc], eq, low);
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
        let qc = self.g.op("q reshaped for bmm", &[qs], eq, wd);
        let kc = self.g.op("kᵀ reshaped for bmm", &[ks], ekv, wd);
        save(&mut self.g, qc);
        save(&mut self.g, kc);
        let scores = self.g.op("scores", &[qc, kc], a, wd);
        let p = self.g.op("softmax P", &[scores], a, wd);
        save(&mut self.g, p);
        let vc = self.g.op("v reshaped for bmm", &[v], ekv, wd);
        save(&mut self.g, vc);
        let o = self.g.op("P·v", &[p, vc], eq, wd);
        let o = self.g.cast(&format!("sdpa out →{low}"), o, low);
        self.g.op("attn out (b, s, D) copy", &[o], eq, low)
    }
}

// ---- Flux / SD3 (famjoint): grad-aware savers, torch.nn.RMSNorm, diffusers' real RoPE ----

impl<'a> Builder<'a> {
    /// Whether a gradient flows to `t` (autograd records a node only when some input needs one).
    pub fn rg(&self, t: Tid) -> bool {
        self.g.tensors[t].requires_grad
    }

    /// Mark `t` saved when `cond` (autograd saves a variable only for the inputs that need a
    /// gradient from it [AG]).
    pub fn save_if(&mut self, t: Tid, cond: bool) {
        if cond {
            save(&mut self.g, t);
        }
    }

    /// `F.linear` as [`Builder::linear_opt`], except that the (cast) weight is saved only when
    /// the input needs a gradient (`AddmmBackward0` saves `mat2` for `mat1`'s gradient [AG]):
    /// otherwise only the autocast cache holds its copy [AC].
    pub fn linear_g(
        &mut self,
        name: &str,
        x: Tid,
        rows: u64,
        out: u64,
        inp: u64,
        bias: bool,
    ) -> Tid {
        if let (true, Some(r)) = (self.frozen(), self.lora_rank(name)) {
            let y = self.linear_opt_base(name, x, rows, out, inp, bias);
            return self.lora_branch_peft(name, x, y, rows, out, inp, r);
        }
        if self.rg(x) || self.frozen() {
            return self.linear_opt(name, x, rows, out, inp, bias);
        }
        let w = self.cached_weight(&format!("{name}.weight"), out * inp);
        let mut ins = vec![0, w];
        if bias {
            ins.push(self.cached_weight(&format!("{name}.bias"), out));
        }
        let xin = self.cast_low(&format!("{name} input"), x);
        ins[0] = xin;
        save(&mut self.g, xin);
        let y = self.product(name, &ins, rows, inp, out);
        match self.lora_rank(name) {
            Some(r) => self.lora_branch(name, x, y, rows, out, inp, r),
            None => y,
        }
    }

    /// A frozen base linear (PEFT's `base_layer`): no saved input; its weight is a parameter.
    fn linear_opt_base(
        &mut self,
        name: &str,
        x: Tid,
        rows: u64,
        out: u64,
        inp: u64,
        bias: bool,
    ) -> Tid {
        let w = self.weight(&format!("{name}.weight"), out * inp);
        let mut ins = vec![0, w];
        if bias {
            ins.push(self.cached_weight(&format!("{name}.bias"), out));
        }
        ins[0] = self.cast_low(&format!("{name} input"), x);
        self.product(name, &ins, rows, inp, out)
    }

    /// PEFT `lora.Linear.forward` (peft 0.21 `tuners/lora/layer.py`): after the base,
    /// `x = self._cast_input_dtype(x, lora_A.weight.dtype)` (a copy into the adapters' fp32 when x
    /// is in a lower dtype, bound to `x` until the forward returns), `lora_A` (autocast casts that
    /// copy again: each adapted module saves its own low-precision input [AC]), `lora_B` (saves
    /// A's output), `· scaling`, `result + …` [AG].
    #[allow(clippy::too_many_arguments)]
    fn lora_branch_peft(
        &mut self,
        name: &str,
        x: Tid,
        base: Tid,
        rows: u64,
        out: u64,
        inp: u64,
        r: u64,
    ) -> Tid {
        let pd = self.adapter_dtype();
        let low = self.low();
        let rx = self.rg(x);
        let x32 = self.g.cast(&format!("{name} x.to(lora dtype)"), x, pd);
        let a = self
            .g
            .param(&format!("{name}.lora_A.weight"), r * inp, pd, true);
        let a = self.cast_low(&format!("{name}.lora_A"), a);
        if self.g.dtype(a) != pd {
            let n = &mut self.g.tensors[a].name;
            n.push_str(if rx { SAVED } else { CACHED });
        }
        let xa = self.cast_low(&format!("{name}.lora_A input"), x32);
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
        let y = self.g.op(
            &format!("{name} + lora"),
            &[base, sc],
            rows * out,
            promote(bdt, low),
        );
        // The copy bound to PEFT's `x`, and the caller's input, until the forward returns (see
        // [`Builder::linear_rg`]).
        let held: Vec<Tid> = if x32 != x { vec![x32, x] } else { vec![x] };
        self.hold(&format!("{name} lora forward"), &held);
        y
    }

    /// diffusers `apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1)` on x of
    /// `n` elements: `-x_imag` (n/2), `stack` (n), `x.float()·cos`, `x_rotated.float()·sin` and
    /// their sum in fp32 (with the casts below fp32), `.to(x.dtype)`; the muls save only the
    /// fp32 tables (they need no gradient) [AG].
    pub fn rope_real(&mut self, name: &str, x: Tid, cos: Tid, sin: Tid) -> Tid {
        let n = self.g.elems(x);
        let xd = self.g.dtype(x);
        let rx = self.rg(x);
        let neg = self.g.op(&format!("{name} -x_imag"), &[x], n / 2, xd);
        let rot = self.g.op(&format!("{name} x_rotated"), &[x, neg], n, xd);
        let xf = self.g.cast(&format!("{name} x.float()"), x, Dtype::F32);
        self.save_if(cos, rx);
        let a = self
            .g
            .op(&format!("{name} x·cos"), &[xf, cos], n, Dtype::F32);
        let rf = self
            .g
            .cast(&format!("{name} x_rotated.float()"), rot, Dtype::F32);
        self.save_if(sin, rx);
        let b = self
            .g
            .op(&format!("{name} x_rotated·sin"), &[rf, sin], n, Dtype::F32);
        let s = self.g.op(&format!("{name} sum"), &[a, b], n, Dtype::F32);
        let out = self.g.cast(&format!("{name} .to(x.dtype)"), s, xd);
        // `x_rotated` is a local of the function: alive until it returns.
        self.hold(&format!("{name} return"), &[rot]);
        out
    }

    /// Python locals that keep tensors alive until their function returns: a zero-byte op that
    /// reads them there (no gradient reaches it). A segment's output must be set after it.
    pub fn hold(&mut self, name: &str, ts: &[Tid]) {
        self.g
            .op(&format!("{name} (locals released)"), ts, 0, Dtype::F32);
    }
}

// ---- pixart, dit-diffusers (famcross): ops that save only what a gradient needs, the masked
// attention of a cross-attention, PEFT's input cast ----

impl Builder<'_> {
    /// `a * b` elementwise (broadcast) into `n` elements of the promoted dtype: `MulBackward0`
    /// saves `b` when `a` needs a gradient and `a` when `b` does [AG].
    pub fn mul(&mut self, name: &str, a: Tid, b: Tid, n: u64) -> Tid {
        let (ra, rb) = (self.rg(a), self.rg(b));
        self.save_if(b, ra);
        self.save_if(a, rb);
        let dt = promote(self.g.dtype(a), self.g.dtype(b));
        self.g.op(name, &[a, b], n, dt)
    }

    /// An elementwise op that saves nothing (`add`, `sub`, a scalar multiple or division) into `n`
    /// elements of the promoted dtype of its inputs [AG].
    pub fn ew(&mut self, name: &str, ins: &[Tid], n: u64) -> Tid {
        let dt = ins
            .iter()
            .map(|&t| self.g.dtype(t))
            .reduce(promote)
            .unwrap_or(Dtype::F32);
        self.g.op(name, ins, n, dt)
    }

    /// An activation that saves its input (`gelu`, `silu`) when it needs a gradient [AG]; the
    /// output keeps the input's dtype (neither is on an autocast list) [AC].
    pub fn act(&mut self, name: &str, x: Tid) -> Tid {
        let r = self.rg(x);
        self.save_if(x, r);
        let (n, dt) = (self.g.elems(x), self.g.dtype(x));
        self.g.op(name, &[x], n, dt)
    }

    /// [`Builder::layer_norm`] when its input needs a gradient; otherwise autograd records
    /// nothing (no saved input, no mean/rstd kept) [AG].
    pub fn layer_norm_rg(&mut self, name: &str, x: Tid, rows: u64) -> Tid {
        if self.rg(x) {
            return self.layer_norm(name, x, rows);
        }
        let (n, dt) = (self.g.elems(x), self.g.dtype(x));
        self.g.op(name, &[x], n, dt)
    }

    /// `x·(1 + scale) + shift` with [`Builder::mul`]'s saving rule (a frozen scale saves only
    /// `1 + scale`, an input without gradient only the norm's output) [AG].
    pub fn modulate_rg(&mut self, name: &str, xn: Tid, shift: Tid, scale: Tid, bd: u64) -> Tid {
        let sdt = self.g.dtype(scale);
        let one_plus = self.g.op(&format!("{name} 1+scale"), &[scale], bd, sdt);
        let n = self.g.elems(xn);
        let mul = self.mul(&format!("{name} ·(1+scale)"), xn, one_plus, n);
        self.ew(&format!("{name} +shift"), &[mul, shift], n)
    }

    /// `F.linear(x, W[, b])` as [`Builder::linear_opt`], but `addmm` saves the (cast) weight only
    /// when x needs a gradient (`mat1: grad.mm(mat2.t())`); otherwise the weight's autocast copy
    /// is held by the cache alone [AG][AC]. Under LoRA on the module, PEFT's
    /// `_cast_input_dtype(x, lora_A.weight.dtype)` first makes an fp32 copy of a low-precision x
    /// (the adapters are fp32 after `cast_training_params`), which autocast casts back for
    /// `lora_A` (`peft/tuners/lora/layer.py` `Linear.forward`).
    pub fn linear_rg(
        &mut self,
        name: &str,
        x: Tid,
        rows: u64,
        out: u64,
        inp: u64,
        bias: bool,
    ) -> Tid {
        let x_rg = self.rg(x);
        let w = if x_rg {
            self.weight(&format!("{name}.weight"), out * inp)
        } else {
            self.cached_weight(&format!("{name}.weight"), out * inp)
        };
        let mut ins = vec![0, w];
        if bias {
            ins.push(self.cached_weight(&format!("{name}.bias"), out));
        }
        let xin = self.cast_low(&format!("{name} input"), x);
        ins[0] = xin;
        if !self.frozen() {
            save(&mut self.g, xin);
        }
        let low = self.low();
        let y = self.product(name, &ins, rows, inp, out);
        let Some(r) = self.lora_rank(name) else {
            return y;
        };
        let pd = self.adapter_dtype();
        let xa0 = if self.autocast() {
            self.g.cast(&format!("{name} lora input →{pd}"), x, pd)
        } else {
            x
        };
        let xa = xa0;
        let a = self
            .g
            .param(&format!("{name}.lora_A.weight"), r * inp, pd, true);
        let a = self.cast_low(&format!("{name}.lora_A"), a);
        if x_rg {
            save(&mut self.g, a);
        } else if self.g.tensors[a].kind == crate::segment::TensorKind::Alloc {
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
        let bdt = self.g.dtype(y);
        let sum = self.g.op(
            &format!("{name} + lora"),
            &[y, sc],
            rows * out,
            promote(bdt, low),
        );
        // PEFT binds the copy to `x` (`x = self._cast_input_dtype(x, …)`): alive until
        // `Linear.forward` returns, after the sum (peft 0.21 `tuners/lora/layer.py`); the caller
        // (diffusers `FeedForward.forward`'s `hidden_states = module(hidden_states)`, the
        // attention processor's locals) holds the input itself for the whole call. family_trace.py
        // on dit-bf16-lora16ff-none: the fp32 copy of ff.net.2's input and the GELU output it was
        // made from are both alive at the forward peak, inside lora_B's mm.
        let held: Vec<Tid> = if xa0 != x { vec![xa0, x] } else { vec![x] };
        self.hold(&format!("{name} lora forward"), &held);
        sum
    }

    /// A matmul `(m × k) · (k × n)` (`addmm`/`mm` of a linear: `ins` = input, weight[, bias])
    /// into `m × n` elements of the compute dtype, with the CPU's low-precision matmul scratch
    /// ([`Builder::gemm_scratch`]) for the gradients its backward computes: the input's when
    /// it needs one, the weight's when the weight does.
    pub fn product(&mut self, name: &str, ins: &[Tid], m: u64, k: u64, n: u64) -> Tid {
        let low = self.low();
        let y = self.g.op(name, ins, m * n, low);
        let (grad_x, grad_w) = (self.rg(ins[0]), self.rg(ins[1]));
        if let Some(op) = self.g.ops.last_mut() {
            op.name.push_str(if grad_w { MATMUL } else { LEFT_UNSAVED });
        }
        self.gemm_scratch(y, m, k, n, grad_x, grad_w);
        y
    }

    /// The scratchpad of a bf16/fp16 matmul on the CPU (`addmm`/`mm` → oneDNN's brgemm
    /// matmul, which books it through PyTorch's CPU allocator for the call; see
    /// [`cpu_gemm_scratch`]), on the op producing `y` of an (m × k) · (k × n) product: forward,
    /// and backward as the larger of `grad·W` (m × n · n × k) and `gradᵀ·x` (n × m · m × k, its
    /// left operand transposed), with the spec's intra-op threads. fp32 matmuls go to MKL
    /// without a scratch that the profiler sees, and CUDA's cuBLAS workspace is not modelled
    /// here.
    pub fn gemm_scratch(&mut self, y: Tid, m: u64, k: u64, n: u64, grad_x: bool, grad_w: bool) {
        let half = matches!(self.low(), Dtype::Bf16 | Dtype::F16);
        if self.rt.device != TorchDevice::Cpu || !half {
            return;
        }
        let t = self.threads;
        let fwd = cpu_gemm_scratch(t, m, k, n, false);
        let mut bwd = 0;
        if grad_x {
            bwd = bwd.max(cpu_gemm_scratch(t, m, n, k, false));
        }
        if grad_w {
            bwd = bwd.max(cpu_gemm_scratch(t, n, m, k, true));
        }
        self.g.annotate(y, 0, fwd, bwd);
    }

    /// `F.scaled_dot_product_attention(q, k, v, attn_mask=mask)` (diffusers `AttnProcessor2_0`):
    /// [`Builder::attention`] with the mask read by the kernel; the fused kernels save it
    /// (`attn_mask` / `attn_bias`) [SDPA]; CUDA flash takes no mask, so the dispatcher runs the
    /// memory-efficient kernel; the math backend adds it into the scores in place.
    pub fn attention_masked(&mut self, q: Tid, k: Tid, v: Tid, mask: Option<Tid>, at: Attn) -> Tid {
        let Some(m) = mask else {
            return self.attention(q, k, v, at);
        };
        let start = self.g.ops.len();
        let fused = self.attention == AttentionMode::MemoryEfficient;
        let o = if fused {
            match self.rt.effective_sdpa(self.precision) {
                SdpaBackend::Math => self.sdpa_math(q, k, v, at),
                SdpaBackend::Flash if self.rt.device == TorchDevice::Cuda => {
                    self.sdpa_fused(q, k, v, at, SdpaBackend::Efficient)
                }
                backend => self.sdpa_fused(q, k, v, at, backend),
            }
        } else {
            self.explicit_attention(q, k, v, at)
        };
        let reader = self.g.ops[start..]
            .iter()
            .position(|op| op.name == "sdpa out" || op.name.starts_with("scores"))
            .map(|i| i + start);
        if let Some(i) = reader {
            self.g.ops[i].inputs.push(m);
            if self.g.ops[i].name == "sdpa out" {
                save(&mut self.g, m);
            }
        }
        o
    }
}

/// Bytes PyTorch's CPU flash attention (`aten/src/ATen/native/cpu/FlashAttentionKernel.cpp`,
/// torch 2.15) allocates for one call beyond its outputs, (forward, backward), with `threads`
/// intra-op threads and inputs in `dt`. Both kernels block q by `qSplitSize` = 32, 64 or 256
/// rows (q length below 192, below 768, else; at most the q length) and k/v by `kvSplitSize` =
/// min(512, kv length), and allocate per-thread buffers up front with `at::empty({num_thread,
/// size_per_thread})` in the accumulation type (fp32 for bf16/fp16) plus, for a reduced type, a
/// second one in the input dtype (an fp32 input makes it empty):
/// - `cpu_flash_attention` (forward): `qk` qSplit·kvSplit + `qk_max` and `qk_sum` qSplit each +
///   `dst` qSplit·headSize in fp32; `qk_reduced` qSplit·kvSplit in the reduced type (the
///   oneDNN-packed path, fp16 only, pads these and adds packed copies of k and v: not modelled);
/// - `cpu_flash_attention_backward`: `attn` + `grad_attn`, 2·qSplit·kvSplit in fp32, the same
///   again in the reduced type, and inside `at::parallel_for` a `dsum` of qSplit fp32 per thread
///   that runs (min(threads, b·heads) with grain 1).
///
/// Measured (torch 2.15 CPU, 2 threads; `bench/torch_peer/family_trace.py` on the SD3 LoRA bf16
/// spec, q = kv = 218 joint tokens, qSplit 64): 223,232 + 111,616 B in the backward, as here.
pub fn cpu_flash_scratch(threads: u64, at: Attn, dt: Dtype) -> (u64, u64) {
    if at.sq == 0 || at.skv == 0 {
        return (0, 0);
    }
    let threads = threads.max(1);
    let q_split = match at.sq {
        s if s >= 768 => 256,
        s if s >= 192 => 64,
        _ => 32,
    }
    .min(at.sq);
    let kv_split = at.skv.min(512);
    let acc = Dtype::F32.size();
    let reduced = if matches!(dt, Dtype::Bf16 | Dtype::F16) {
        dt.size()
    } else {
        0
    };
    let block = q_split * kv_split;
    let fwd = threads * (block + 2 * q_split + q_split * at.dh) * acc + threads * block * reduced;
    let workers = threads.min((at.b * at.heads).max(1));
    let bwd = threads * 2 * block * acc + threads * 2 * block * reduced + workers * q_split * acc;
    (fwd, bwd)
}

/// The row block oneDNN's brgemm matmul picks for an (m × k) · (k × n) product on `nthr`
/// threads, with `n_blk` output columns per block (`cpu/x64/matmul/brgemm_matmul_utils.cpp`
/// `compute_blocking_heuristic_avx512`, one batch, no k-parallel split): rows blocks from
/// min(256, m) down to min(32, m) (16 when the column blocks leave threads idle) are scored by
/// `matmul_avx512_blocking_params_t::get_imbalance` — the spread of the m × n blocks over the
/// threads, the rows the last block pads, the k tail — skipping block counts under 3 per
/// thread that do not divide among the threads (`n_chunk_size` column blocks make one work
/// item); the first (largest) best one wins, else the smallest. With the k tail equal for every
/// candidate, it is left out.
fn brgemm_m_blk(nthr: u64, m: u64, n_chunks: u64, n_chunk_size: u64) -> u64 {
    let disbalance = |work: u64, tb: u64| -> f32 {
        let rem = work % tb;
        let scalar = if work < tb {
            tb - rem
        } else {
            (tb - rem).min(rem)
        };
        scalar as f32 / tb as f32
    };
    let max_m_blk = m.min(256);
    let min_m_blk = if nthr > n_chunks {
        m.min(16)
    } else {
        m.min(32)
    };
    let mut best: Option<(f32, u64)> = None;
    for m_blk in (min_m_blk..=max_m_blk).rev() {
        let work = m.div_ceil(m_blk) * n_chunks.div_ceil(n_chunk_size);
        if work < 3 * nthr && !work.is_multiple_of(nthr) {
            continue;
        }
        let pad = (m_blk * m.div_ceil(m_blk)) % m;
        let score = (disbalance(work, nthr) + pad as f32 / m as f32) / 5.0;
        if best.is_none_or(|(b, _)| score < b) {
            best = Some((score, m_blk));
        }
    }
    best.map_or(min_m_blk, |(_, b)| b)
}

/// Bytes of oneDNN's bf16 matmul scratchpad for (m × k) · (k × n) on the CPU with `threads`
/// intra-op threads (torch 2.15 `aten::addmm`/`aten::mm` → oneDNN 3.13.3's
/// `brgemm_matmul_t<avx512_core_bf16>`; `brgemm_matmul_utils.cpp` `init_aux_values`,
/// `init_scratchpad`): per thread an fp32 C block of `M_blk` rows ([`brgemm_m_blk`]) by
/// `N_blk` = min(n, 64) columns, a packed B panel of `K_blk` (min(k, 512), 1024 when k exceeds
/// 1024 and the left operand is not transposed; rounded up to 32) by 64 bf16, and 640 B, plus
/// 384 B; a transposed left operand (the weight gradient `gradᵀ·x`) adds its bf16 copy,
/// m × k × 2 B, and 128 B.
///
/// Measured (`bench/torch_peer/gemm_scratch_probe.py`, torch 2.15 CPU, AVX-512 with
/// AVX512-BF16): exact on 32 forward shapes (m 8–2000, k 4–2048, n 4–256) at 2 threads and 4
/// shapes each at 1 and 4 threads; the transposed ones exact at (n, m, k) = (64, 256, 64) and
/// (256, 256, 256), +4 % / +8 % / −15 % where m exceeds 512 (oneDNN then splits the copy by
/// `M_blk` with a padded leading dimension, and splits n into chunks).
pub fn cpu_gemm_scratch(threads: u64, m: u64, k: u64, n: u64, a_transposed: bool) -> u64 {
    if m == 0 || k == 0 || n == 0 {
        return 0;
    }
    let nthr = threads.max(1);
    let n_blk = n.min(64);
    // A transposed left operand is copied (`use_buffer_a`), which lets the heuristic group up
    // to 16 column blocks per thread's work item (`max_n_chunks`).
    let n_chunks = n.div_ceil(n_blk);
    let n_chunk_size = if a_transposed { n_chunks.min(16) } else { 1 };
    let m_blk = brgemm_m_blk(nthr, m, n_chunks, n_chunk_size);
    let k_blk = if k > 1024 && !a_transposed {
        1024
    } else {
        k.min(512)
    };
    let k_pad = k_blk.div_ceil(32) * 32;
    let mut s = 384 + nthr * (640 + m_blk * n_blk * 4 + k_pad * 64 * 2);
    if a_transposed {
        s += m * k * 2 + 128;
    }
    s
}

// ---- sana / wan (famsana): ops whose saves depend on which operands need a gradient ----

impl Builder<'_> {
    /// `LayerNorm(D, elementwise_affine=False)` as [`Builder::layer_norm`], recorded only when
    /// its input needs a gradient. A non-contiguous input (a transposed patch embedding) is
    /// made contiguous inside the CPU kernel's forward and again in its backward
    /// (`X.expect_contiguous()` in `layer_norm_cpu` / `layer_norm_backward_cpu`).
    pub fn layer_norm_strided(&mut self, name: &str, x: Tid, rows: u64, contiguous: bool) -> Tid {
        let y = if self.rg(x) {
            self.layer_norm(name, x, rows)
        } else {
            let (n, dt) = (self.g.elems(x), self.g.dtype(x));
            self.g.op(name, &[x], n, dt)
        };
        if !contiguous {
            let b = self.g.tensors[x].bytes();
            self.g.annotate(y, 0, b, b);
        }
        y
    }

    /// diffusers `RMSNorm(dim, eps, elementwise_affine)` (`normalization.py`, the non-NPU path):
    /// `x.to(float32).pow(2).mean(-1, keepdim=True)`, `x * rsqrt(var + eps)` (fp32 by
    /// promotion), `.to(weight.dtype)` when the weight is fp16/bf16, `* weight`. `PowBackward0`
    /// saves the fp32 copy, `RsqrtBackward0` its result, the first `MulBackward0` x and the rsqrt,
    /// the second the normalized tensor (the weight is a parameter) [AG].
    pub fn rms_norm(&mut self, name: &str, x: Tid, rows: u64, affine: bool) -> Tid {
        let n = self.g.elems(x);
        let dim = n / rows.max(1);
        let xf = self.g.cast(&format!("{name} x→f32"), x, Dtype::F32);
        let r = self.rg(x);
        self.save_if(xf, r);
        let sq = self.g.op(&format!("{name} pow(2)"), &[xf], n, Dtype::F32);
        // PowBackward0: grad·(2·x.pow(1)) makes x.pow(1) and its double before the product.
        self.g.annotate(sq, 0, 0, 2 * n * 4);
        let var = self.g.op(&format!("{name} mean"), &[sq], rows, Dtype::F32);
        let ve = self.g.op(&format!("{name} +eps"), &[var], rows, Dtype::F32);
        let rs = self.g.op(&format!("{name} rsqrt"), &[ve], rows, Dtype::F32);
        self.save_if(rs, r);
        let mut h = self.mul(&format!("{name} x·rsqrt"), x, rs, n);
        if affine {
            let w = self.plain_param(&format!("{name}.weight"), dim);
            let wdt = self.g.dtype(w);
            if matches!(wdt, Dtype::Bf16 | Dtype::F16) {
                h = self.g.cast(&format!("{name} →{wdt}"), h, wdt);
            }
            h = self.mul(&format!("{name} ·weight"), h, w, n);
        }
        h
    }

    /// `F.linear` on an input that needs no gradient (cached data, timestep frequencies): the
    /// (cast) input is saved for the weight's gradient, the autocast copy of the weight only sits
    /// in the autocast cache (`AddmmBackward0` saves `mat2` only for `mat1`'s gradient) [AG][AC].
    /// With a gradient-carrying input, or LoRA on the module: [`Builder::linear_opt`].
    pub fn linear_if_grad(
        &mut self,
        name: &str,
        x: Tid,
        rows: u64,
        out: u64,
        inp: u64,
        bias: bool,
    ) -> Tid {
        if self.rg(x) || self.lora_rank(name).is_some() || self.frozen() {
            return self.linear_opt(name, x, rows, out, inp, bias);
        }
        let w = self.cached_weight(&format!("{name}.weight"), out * inp);
        let mut ins = vec![0, w];
        if bias {
            ins.push(self.cached_weight(&format!("{name}.bias"), out));
        }
        let xin = self.cast_low(&format!("{name} input"), x);
        ins[0] = xin;
        save(&mut self.g, xin);
        self.product(name, &ins, rows, inp, out)
    }

    /// `F.linear` on a non-contiguous 3-D input (a transposed view): `at::matmul` folds the input
    /// into a contiguous copy that `mm` saves when the weight needs a gradient (`should_fold`),
    /// otherwise it runs `bmm` on the strided input against the expanded weight and saves
    /// nothing new [MM][AC]; the bias is added in place. LoRA on the module: see
    /// [`Builder::linear_peft`] (lora_A, trained, folds its own copy).
    pub fn linear_strided(
        &mut self,
        name: &str,
        x: Tid,
        rows: u64,
        out: u64,
        inp: u64,
        bias: bool,
    ) -> Tid {
        if !self.frozen() {
            let xc = self.cast_low(&format!("{name} input"), x);
            let dt = self.g.dtype(xc);
            let xr = self.g.op(
                &format!("{name} input reshaped for mm"),
                &[xc],
                rows * inp,
                dt,
            );
            return self.linear_opt(name, xr, rows, out, inp, bias);
        }
        let y = self.frozen_base(name, x, rows, out, inp, bias);
        let Some(r) = self.lora_rank(name) else {
            return y;
        };
        let pd = self.adapter_dtype();
        let xa0 = self.g.cast(&format!("{name} x.to(lora_A dtype)"), x, pd);
        let xc = self.cast_low(&format!("{name}.lora_A input"), xa0);
        let low = self.low();
        let xr = self.g.op(
            &format!("{name}.lora_A input reshaped for mm"),
            &[xc],
            rows * inp,
            low,
        );
        self.lora_with_held_input(name, xa0, x, xr, y, rows, out, inp, r)
    }

    /// A frozen LoRA base (`base_layer(x)`): the weight in the compute dtype, nothing saved.
    fn frozen_base(
        &mut self,
        name: &str,
        x: Tid,
        rows: u64,
        out: u64,
        inp: u64,
        bias: bool,
    ) -> Tid {
        let w = self.weight(&format!("{name}.weight"), out * inp);
        let mut ins = vec![0, w];
        if bias {
            ins.push(self.cached_weight(&format!("{name}.bias"), out));
        }
        ins[0] = self.cast_low(&format!("{name} input"), x);
        self.product(name, &ins, rows, inp, out)
    }

    /// The LoRA branch on `xl` (what lora_A reads), while PEFT's `x = x.to(lora_A.weight.dtype)`
    /// copy `xa0` stays referenced until the layer's forward returns: its bytes ride as forward
    /// scratch on the branch's ops after the simulator's last read of it.
    #[allow(clippy::too_many_arguments)]
    fn lora_with_held_input(
        &mut self,
        name: &str,
        xa0: Tid,
        x: Tid,
        xl: Tid,
        base: Tid,
        rows: u64,
        out: u64,
        inp: u64,
        r: u64,
    ) -> Tid {
        let n0 = self.g.ops.len();
        let y = self.lora_branch(name, xl, base, rows, out, inp, r);
        if !self.rg(xl) {
            // lora_A's `mm` saves its weight only for its input's gradient [AG]: with an input
            // that needs none, the weight's autocast copy only sits in the cache.
            let prefix = format!("{name}.lora_A →");
            let cast = self.g.ops[n0..]
                .iter()
                .map(|o| o.output)
                .find(|&t| self.g.tensors[t].name.starts_with(&prefix));
            if let Some(t) = cast {
                let nm = &mut self.g.tensors[t].name;
                if let Some(stem) = nm.strip_suffix(SAVED) {
                    *nm = format!("{stem}{CACHED}");
                }
            }
        }
        if xa0 != x {
            let held = self.g.tensors[xa0].bytes();
            let outs: Vec<Tid> = self.g.ops[n0..].iter().map(|o| o.output).collect();
            for t in outs {
                self.g.annotate(t, 0, held, 0);
            }
        }
        y
    }

    /// `F.linear` as PEFT's `lora.Linear.forward` runs it when the module is adapted:
    /// `result = base_layer(x)`, then `x = x.to(lora_A.weight.dtype)` (the fp32 adapters after
    /// `cast_training_params`: a copy of a low-precision input), `lora_B(lora_A(x)) · scaling`
    /// under autocast, so lora_A saves its **own** autocast copy of x, never x itself [AC].
    /// Without LoRA on the module (or without autocast, where every cast is a no-op):
    /// [`Builder::linear_opt`].
    pub fn linear_peft(
        &mut self,
        name: &str,
        x: Tid,
        rows: u64,
        out: u64,
        inp: u64,
        bias: bool,
    ) -> Tid {
        let r = match self.lora_rank(name) {
            Some(r) if self.autocast() => r,
            _ => return self.linear_opt(name, x, rows, out, inp, bias),
        };
        let y = self.frozen_base(name, x, rows, out, inp, bias);
        let pd = self.adapter_dtype();
        let xa0 = self.g.cast(&format!("{name} x.to(lora_A dtype)"), x, pd);
        let xl = self.cast_low(&format!("{name}.lora_A input"), xa0);
        self.lora_with_held_input(name, xa0, x, xl, y, rows, out, inp, r)
    }

    /// `conv2d` / `conv3d` under autocast: `ConvolutionBackward0` saves input and weight together
    /// (one formula for both) whenever the node exists; the bias copy only sits in the cache
    /// [AG][AC].
    pub fn conv_rg(
        &mut self,
        name: &str,
        x: Tid,
        out_elems: u64,
        w_elems: u64,
        bias: Option<u64>,
    ) -> Tid {
        let w = self.weight(&format!("{name}.weight"), w_elems);
        let mut ins = vec![0, w];
        if let Some(be) = bias {
            ins.push(self.cached_weight(&format!("{name}.bias"), be));
        }
        let xin = self.cast_low(&format!("{name} input"), x);
        ins[0] = xin;
        let node = self.rg(xin) || !self.frozen();
        self.save_if(xin, node);
        let low = self.low();
        self.g.op(name, &ins, out_elems, low)
    }

    /// `torch.nn.RMSNorm(dim, eps, elementwise_affine=True)` (`F.rms_norm`, the composite of
    /// `layer_norm.cpp`): the input upcast to fp32 (saved by `pow` and the first `mul`),
    /// `rsqrt(pow(2).mean(-1).add_(eps))` (saved), `x·rsqrt` (saved by the weight's `mul` when
    /// the weight is trained), `·weight`, then `type_as(input)` [AG] — as the saved-tensor dump
    /// of Wan's `norm_q` / `norm_k` shows (the fp32 `MulBackward0` result saved by `mul`).
    pub fn torch_rms_norm(&mut self, name: &str, x: Tid, rows: u64) -> Tid {
        let n = self.g.elems(x);
        let dim = n / rows.max(1);
        let dt = self.g.dtype(x);
        let xf = self.g.cast(&format!("{name} x→f32"), x, Dtype::F32);
        let r = self.rg(x);
        self.save_if(xf, r);
        let sq = self.g.op(&format!("{name} pow(2)"), &[xf], n, Dtype::F32);
        // PowBackward0: grad·(2·x.pow(1)) makes x.pow(1) and its double before the product.
        self.g.annotate(sq, 0, 0, 2 * n * 4);
        let var = self.g.op(
            &format!("{name} mean (+eps in place)"),
            &[sq],
            rows,
            Dtype::F32,
        );
        let rs = self
            .g
            .op(&format!("{name} rsqrt"), &[var], rows, Dtype::F32);
        self.save_if(rs, r);
        let h = self.mul(&format!("{name} x·rsqrt"), xf, rs, n);
        let w = self.plain_param(&format!("{name}.weight"), dim);
        let y = self.mul(&format!("{name} ·weight"), h, w, n);
        self.g.cast(&format!("{name} type_as(input)"), y, dt)
    }

    /// Fused SDPA with an additive mask (`attn_mask`, saved by the node beside q, k, v) [SDPA].
    pub fn attention_mask_saved(
        &mut self,
        q: Tid,
        k: Tid,
        v: Tid,
        at: Attn,
        mask: Option<Tid>,
    ) -> Tid {
        let o = self.attention(q, k, v, at);
        let fused = self.attention == AttentionMode::MemoryEfficient
            && self.rt.effective_sdpa(self.precision) != SdpaBackend::Math;
        if let Some(m) = mask {
            let r = self.rg(o) && fused;
            self.save_if(m, r);
        }
        o
    }
}
