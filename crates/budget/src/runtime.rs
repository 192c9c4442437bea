//! Runtime models: what each executor allocates and keeps per op.
//!
//! The op inventory depends on who executes the step. The ditmem engine (candle) composes its ops
//! from candle primitives and keeps every intermediate of a tracked graph; PyTorch's autograd keeps
//! only what each op's backward reads and rounds allocations in its caching allocator. A runtime is
//! a [`RuntimeModel`]; the timeline and the planner only talk to the trait, so a new runtime is a
//! new implementation plus a [`crate::spec::Runtime`] variant.

use crate::graph::{Segment, Tid};
use crate::params::block_linears;
use crate::spec::{AttentionMode, Dtype, LoraTarget, Precision, Recompute, Spec};

/// Dimensions of one microbatch, shared by every segment builder.
#[derive(Debug, Clone)]
pub struct Dims {
    /// Microbatch b.
    pub b: u64,
    /// Tokens per image s.
    pub s: u64,
    /// Hidden size D.
    pub d: u64,
    /// Heads a.
    pub heads: u64,
    /// MLP hidden size.
    pub mlp: u64,
    pub freq: u64,
    /// Rows of the label table (classes + null class).
    pub label_rows: u64,
    pub c_in: u64,
    pub c_out: u64,
    pub patch2: u64,
    /// Latent elements per microbatch (b·C·h·w).
    pub latent: u64,
    pub precision: Precision,
    pub attention: AttentionMode,
    pub attention_only: bool,
    pub lora: Option<(u64, Vec<LoraTarget>)>,
    pub attn_dropout: bool,
    pub mlp_dropout: bool,
}

impl Dims {
    pub fn new(spec: &Spec) -> Dims {
        let m = &spec.model;
        let s = spec.tokens().unwrap_or(0);
        let b = u64::from(spec.workload.microbatch);
        let p2 = u64::from(m.patch) * u64::from(m.patch);
        Dims {
            b,
            s,
            d: u64::from(m.hidden),
            heads: u64::from(m.heads),
            mlp: u64::from(m.mlp_hidden()),
            freq: u64::from(m.freq_embed),
            label_rows: u64::from(m.label_rows()),
            c_in: u64::from(m.in_channels),
            c_out: u64::from(m.out_channels()),
            patch2: p2,
            latent: b * s * p2 * u64::from(m.in_channels),
            precision: spec.recipe.precision,
            attention: spec.recipe.attention,
            attention_only: spec.recipe.recompute == Recompute::AttentionOnly,
            lora: spec
                .recipe
                .lora
                .as_ref()
                .map(|l| (u64::from(l.rank), l.targets.clone())),
            attn_dropout: m.attn_dropout > 0.0,
            mlp_dropout: m.mlp_dropout > 0.0,
        }
    }

    /// Token-sized elements b·s·D.
    pub fn e(&self) -> u64 {
        self.b * self.s * self.d
    }

    /// Attention-probability elements b·a·s².
    pub fn a(&self) -> u64 {
        self.b * self.heads * self.s * self.s
    }

    /// Rows b·s.
    pub fn rows(&self) -> u64 {
        self.b * self.s
    }
}

/// Where a runtime's per-op rules come from and how it allocates.
pub trait RuntimeModel {
    fn name(&self) -> &'static str;
    /// Forward graph of the input side: noising, patch embedding, timestep and label embedders.
    fn embed_segment(&self, dims: &Dims) -> Segment;
    /// Forward graph of one DiT block.
    fn block_segment(&self, dims: &Dims) -> Segment;
    /// Forward graph of the final layer and the loss.
    fn final_segment(&self, dims: &Dims) -> Segment;
    /// True when a tracked graph keeps every op output (candle); false when only what backward
    /// reads is kept (PyTorch autograd).
    fn keeps_all_outputs(&self) -> bool;
    /// Whether the tensor is saved for backward when `keeps_all_outputs` is false.
    fn saves(&self, _seg: &Segment, _t: Tid) -> bool {
        true
    }
    /// Transient bytes of one optimizer update of a tensor with `elems` elements (beyond m and v).
    fn optimizer_scratch(
        &self,
        elems: u64,
        precision: Precision,
        optimizer: crate::spec::Optimizer,
    ) -> u64;
    /// Transient bytes of the EMA update of a tensor with `elems` elements.
    fn ema_scratch(&self, elems: u64, dtype: Dtype) -> u64;
    /// Bytes an allocation of `bytes` really takes (allocator rounding).
    fn round(&self, bytes: u64) -> u64 {
        bytes
    }
}

/// The ditmem engine on the CPU: candle ops composed as in `ditmem-engine`'s model.
///
/// Every op below is a candle call in the engine; every `op` is one fresh buffer that the tracked
/// graph keeps until the segment's backward is done. Views (`narrow`, `t`, reshape of a
/// contiguous tensor, `unsqueeze`) allocate nothing. Backward scratch follows candle's
/// `backprop.rs`: each gradient is accumulated through `zeros_like` + `add`, so an op's input
/// gradient briefly costs a partial, a zero buffer and the sum.
pub struct DitmemCpu;

impl DitmemCpu {
    /// `y = x · Wᵀ + b` on a 2-D view, with the weight cast to the compute dtype (a graph node
    /// under mixed precision) and an optional LoRA branch `(x·Aᵀ)·Bᵀ` added.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        g: &mut Segment,
        dims: &Dims,
        name: &str,
        x: Tid,
        rows: u64,
        out: u64,
        inp: u64,
        target: Option<LoraTarget>,
        base_trained: bool,
    ) -> Tid {
        let cd = dims.precision.compute_dtype();
        let lora = dims
            .lora
            .as_ref()
            .filter(|(_, t)| target.is_some_and(|tg| t.contains(&tg)));
        // Under LoRA the base is frozen and already stored in the compute dtype.
        let wd = if base_trained {
            dims.precision.param_dtype()
        } else {
            cd
        };
        let w = g.param(&format!("{name}.weight"), out * inp, wd, base_trained);
        let bias = g.param(&format!("{name}.bias"), out, wd, base_trained);
        let wc = g.cast(&format!("{name}.weight→{cd}"), w, cd);
        let bc = g.cast(&format!("{name}.bias→{cd}"), bias, cd);
        let wt = g.view(&format!("{name}.weightᵀ"), wc, out * inp);
        let mm = g.op(&format!("{name} matmul"), &[x, wt], rows * out, cd);
        let mut y = g.op(&format!("{name} +bias"), &[mm, bc], rows * out, cd);
        if let Some((r, _)) = lora {
            let pd = dims.precision.param_dtype();
            let a = g.param(&format!("{name}.lora_a"), r * inp, pd, true);
            let bm = g.param(&format!("{name}.lora_b"), out * r, pd, true);
            let ac = g.cast(&format!("{name}.lora_a→{cd}"), a, cd);
            let bc2 = g.cast(&format!("{name}.lora_b→{cd}"), bm, cd);
            let at = g.view(&format!("{name}.lora_aᵀ"), ac, r * inp);
            let bt = g.view(&format!("{name}.lora_bᵀ"), bc2, out * r);
            let xa = g.op(&format!("{name} x·Aᵀ"), &[x, at], rows * r, cd);
            let xab = g.op(&format!("{name} ·Bᵀ"), &[xa, bt], rows * out, cd);
            y = g.op(&format!("{name} +lora"), &[y, xab], rows * out, cd);
        }
        y
    }

    /// LayerNorm without affine, composed from differentiable candle ops in the accumulation dtype.
    fn layer_norm(g: &mut Segment, name: &str, x: Tid, rows: u64, width: u64) -> Tid {
        let ad = g.dtype(x);
        let n = rows * width;
        let mean = g.op(&format!("{name} mean"), &[x], rows, ad);
        let xc = g.op(&format!("{name} x−mean"), &[x, mean], n, ad);
        let sq = g.op(&format!("{name} (x−mean)²"), &[xc], n, ad);
        let var = g.op(&format!("{name} var"), &[sq], rows, ad);
        let ve = g.op(&format!("{name} var+eps"), &[var], rows, ad);
        let rstd = g.op(&format!("{name} (var+eps)^−½"), &[ve], rows, ad);
        g.op(&format!("{name} out"), &[xc, rstd], n, ad)
    }

    /// `x·(1+scale) + shift`, then the cast to the compute dtype for the following matmul.
    fn modulate(g: &mut Segment, dims: &Dims, name: &str, xn: Tid, shift: Tid, scale: Tid) -> Tid {
        let ad = g.dtype(xn);
        let n = g.elems(xn);
        let bd = dims.b * dims.d;
        let one_plus = g.op(&format!("{name} 1+scale"), &[scale], bd, ad);
        let mul = g.op(&format!("{name} ·(1+scale)"), &[xn, one_plus], n, ad);
        let add = g.op(&format!("{name} +shift"), &[mul, shift], n, ad);
        g.cast(
            &format!("{name}→{}", dims.precision.compute_dtype()),
            add,
            dims.precision.compute_dtype(),
        )
    }

    /// The adaLN modulation `Linear(SiLU(c))` chunked into `k` views of b·D.
    fn ada_ln(
        g: &mut Segment,
        dims: &Dims,
        name: &str,
        c: Tid,
        k: u64,
        target: Option<LoraTarget>,
        trained: bool,
    ) -> Vec<Tid> {
        let ad = dims.precision.accum_dtype();
        let cd = dims.precision.compute_dtype();
        let bd = dims.b * dims.d;
        let silu = g.op(&format!("{name} silu(c)"), &[c], bd, ad);
        let sc = g.cast(&format!("{name} silu(c)→{cd}"), silu, cd);
        let m = Self::linear(
            g,
            dims,
            name,
            sc,
            dims.b,
            k * dims.d,
            dims.d,
            target,
            trained,
        );
        let m = g.cast(&format!("{name} →{ad}"), m, ad);
        (0..k)
            .map(|i| g.view(&format!("{name} chunk {i}"), m, bd))
            .collect()
    }

    /// Attention over q, k, v of shape (b, a, s, dh) in the compute dtype.
    fn attention(g: &mut Segment, dims: &Dims, q: Tid, k: Tid, v: Tid) -> Tid {
        let ad = dims.precision.accum_dtype();
        let cd = dims.precision.compute_dtype();
        let e = dims.e();
        let a = dims.a();
        let bas = dims.b * dims.heads * dims.s;
        if dims.attention == AttentionMode::MemoryEfficient || dims.attention_only {
            // One custom op: keeps its output (and, memory-efficient, a f32 log-sum-exp per row);
            // q, k, v are already alive. Forward scratch: one query chunk of scores.
            let o = g.op("attn core", &[q, k, v], e, cd);
            let acc = if dims.precision == Precision::Fp64 {
                Dtype::F64
            } else {
                Dtype::F32
            };
            let (lse, scratch_fwd, scratch_bwd) = if dims.attention_only {
                // Recomputes the materialized attention for the whole block in backward.
                let bwd = Self::materialized_bytes(dims);
                (0, a * ad.size() + 2 * bas * ad.size(), bwd)
            } else {
                let chunk = dims.b * dims.heads * ATTN_CHUNK.min(dims.s) * dims.s;
                (
                    bas * acc.size(),
                    2 * chunk * acc.size(),
                    3 * chunk * acc.size(),
                )
            };
            g.annotate(o, lse, scratch_fwd, scratch_bwd);
            return o;
        }
        let kt = g.view("kᵀ", k, e);
        let scores = g.op("scores q·kᵀ", &[q, kt], a, cd);
        let s32 = g.cast(&format!("scores→{ad}"), scores, ad);
        let max = g.op("softmax max", &[s32], bas, ad);
        let sub = g.op("softmax x−max", &[s32, max], a, ad);
        let exp = g.op("softmax exp", &[sub], a, ad);
        let sum = g.op("softmax sum", &[exp], bas, ad);
        let p = g.op("softmax P", &[exp, sum], a, ad);
        let mut pc = g.cast(&format!("P→{cd}"), p, cd);
        if dims.attn_dropout {
            let mask = g.op("attn dropout mask", &[], a, cd);
            pc = g.op("attn dropout", &[pc, mask], a, cd);
        }
        g.op("P·v", &[pc, v], e, cd)
    }

    /// Bytes the materialized attention core keeps, for backward rebuilds of it.
    fn materialized_bytes(dims: &Dims) -> u64 {
        let mut sub = Segment::new("attn");
        let cd = dims.precision.compute_dtype();
        let e = dims.e();
        let q = sub.input("q", e, cd, true);
        let k = sub.input("k", e, cd, true);
        let v = sub.input("v", e, cd, true);
        let plain = Dims {
            attention: AttentionMode::Materialized,
            attention_only: false,
            ..dims.clone()
        };
        Self::attention(&mut sub, &plain, q, k, v);
        sub.tensors.iter().map(|t| t.alloc_bytes()).sum()
    }
}

/// Query rows per chunk of the engine's memory-efficient attention.
pub const ATTN_CHUNK: u64 = 64;

impl RuntimeModel for DitmemCpu {
    fn name(&self) -> &'static str {
        "ditmem-cpu"
    }

    fn embed_segment(&self, dims: &Dims) -> Segment {
        let mut g = Segment::new("embed");
        let ad = dims.precision.accum_dtype();
        let cd = dims.precision.compute_dtype();
        let trained = dims.lora.is_none();
        let n = dims.latent;
        let bd = dims.b * dims.d;
        // Noising x_t = √ᾱ·x0 + √(1−ᾱ)·ε; ᾱ per sample is a (b,1,1,1) tensor.
        let x0 = g.input("x0", n, ad, false);
        let eps = g.input("noise", n, ad, false);
        let sa = g.input("sqrt(ᾱ_t)", dims.b, ad, false);
        let sb = g.input("sqrt(1−ᾱ_t)", dims.b, ad, false);
        let a = g.op("√ᾱ·x0", &[x0, sa], n, ad);
        let b = g.op("√(1−ᾱ)·ε", &[eps, sb], n, ad);
        let xt = g.op("x_t", &[a, b], n, ad);
        let patches = g.op("patchify", &[xt], n, ad);
        let pc = g.cast(&format!("patches→{cd}"), patches, cd);
        let emb = Self::linear(
            &mut g,
            dims,
            "x_embedder.proj",
            pc,
            dims.rows(),
            dims.d,
            dims.c_in * dims.patch2,
            None,
            trained,
        );
        let emb = g.cast(&format!("x_embedder→{ad}"), emb, ad);
        let pos = g.param("pos_embed", dims.s * dims.d, ad, false);
        let x = g.op("+pos_embed", &[emb, pos], dims.e(), ad);
        // Conditioning: sinusoid(t) → MLP, plus the label row.
        let half = dims.freq / 2;
        let t = g.input("t", dims.b, ad, false);
        let args = g.op("t·freqs", &[t], dims.b * half, ad);
        let cos = g.op("cos", &[args], dims.b * half, ad);
        let sin = g.op("sin", &[args], dims.b * half, ad);
        let f = g.op("cat[cos,sin]", &[cos, sin], dims.b * dims.freq, ad);
        let fc = g.cast(&format!("t_freq→{cd}"), f, cd);
        let h = Self::linear(
            &mut g,
            dims,
            "t_embedder.mlp.0",
            fc,
            dims.b,
            dims.d,
            dims.freq,
            None,
            trained,
        );
        let h = g.op("t silu", &[h], bd, cd);
        let te = Self::linear(
            &mut g,
            dims,
            "t_embedder.mlp.2",
            h,
            dims.b,
            dims.d,
            dims.d,
            None,
            trained,
        );
        let te = g.cast(&format!("t_emb→{ad}"), te, ad);
        let table = g.param(
            "y_embedder.embedding_table.weight",
            dims.label_rows * dims.d,
            dims.precision.param_dtype(),
            trained,
        );
        let y = g.op("label rows", &[table], bd, dims.precision.param_dtype());
        let y = g.cast(&format!("y_emb→{ad}"), y, ad);
        let _c = g.op("c = t_emb + y_emb", &[te, y], bd, ad);
        // The residual stream is the segment's output; c is carried beside it.
        g.output = x;
        g
    }

    fn block_segment(&self, dims: &Dims) -> Segment {
        let mut g = Segment::new("block");
        let ad = dims.precision.accum_dtype();
        let cd = dims.precision.compute_dtype();
        let trained = dims.lora.is_none();
        let (e, rows, d) = (dims.e(), dims.rows(), dims.d);
        let x = g.input("x", e, ad, true);
        let c = g.input("c", dims.b * d, ad, true);
        let m = Self::ada_ln(
            &mut g,
            dims,
            "adaLN_modulation.1",
            c,
            6,
            Some(LoraTarget::Adaln),
            trained,
        );
        let (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) =
            (m[0], m[1], m[2], m[3], m[4], m[5]);

        // Attention branch.
        let n1 = Self::layer_norm(&mut g, "norm1", x, rows, d);
        let h = Self::modulate(&mut g, dims, "modulate1", n1, shift_msa, scale_msa);
        let qkv = Self::linear(
            &mut g,
            dims,
            "attn.qkv",
            h,
            rows,
            3 * d,
            d,
            Some(LoraTarget::Qkv),
            trained,
        );
        let qv = g.view("q view", qkv, e);
        let kv = g.view("k view", qkv, e);
        let vv = g.view("v view", qkv, e);
        let q = g.op("q·scale", &[qv], e, cd);
        let k = g.op("k contiguous", &[kv], e, cd);
        let v = g.op("v contiguous", &[vv], e, cd);
        let o = Self::attention(&mut g, dims, q, k, v);
        let ot = g.view("oᵀ", o, e);
        let o2 = g.op("o reshape", &[ot], e, cd);
        let p = Self::linear(
            &mut g,
            dims,
            "attn.proj",
            o2,
            rows,
            d,
            d,
            Some(LoraTarget::Proj),
            trained,
        );
        let p = g.cast(&format!("proj→{ad}"), p, ad);
        let gp = g.op("gate_msa·proj", &[p, gate_msa], e, ad);
        let x1 = g.op("x + attn", &[x, gp], e, ad);

        // MLP branch.
        let n2 = Self::layer_norm(&mut g, "norm2", x1, rows, d);
        let h2 = Self::modulate(&mut g, dims, "modulate2", n2, shift_mlp, scale_mlp);
        let f1 = Self::linear(
            &mut g,
            dims,
            "mlp.fc1",
            h2,
            rows,
            dims.mlp,
            d,
            Some(LoraTarget::Fc1),
            trained,
        );
        let mut act = g.op("gelu(tanh)", &[f1], rows * dims.mlp, cd);
        if dims.mlp_dropout {
            let mask = g.op("mlp dropout mask", &[], rows * dims.mlp, cd);
            act = g.op("mlp dropout", &[act, mask], rows * dims.mlp, cd);
        }
        let f2 = Self::linear(
            &mut g,
            dims,
            "mlp.fc2",
            act,
            rows,
            d,
            dims.mlp,
            Some(LoraTarget::Fc2),
            trained,
        );
        let f2 = g.cast(&format!("fc2→{ad}"), f2, ad);
        let gm = g.op("gate_mlp·fc2", &[f2, gate_mlp], e, ad);
        g.op("x + mlp", &[x1, gm], e, ad);
        g
    }

    fn final_segment(&self, dims: &Dims) -> Segment {
        let mut g = Segment::new("final");
        let ad = dims.precision.accum_dtype();
        let trained = dims.lora.is_none();
        let (e, rows, d) = (dims.e(), dims.rows(), dims.d);
        let x = g.input("x", e, ad, true);
        let c = g.input("c", dims.b * d, ad, true);
        let m = Self::ada_ln(
            &mut g,
            dims,
            "final_layer.adaLN_modulation.1",
            c,
            2,
            None,
            trained,
        );
        let n = Self::layer_norm(&mut g, "final norm", x, rows, d);
        let h = Self::modulate(&mut g, dims, "final modulate", n, m[0], m[1]);
        let out = rows * dims.patch2 * dims.c_out;
        let y = Self::linear(
            &mut g,
            dims,
            "final_layer.linear",
            h,
            rows,
            dims.patch2 * dims.c_out,
            d,
            None,
            trained,
        );
        let y = g.cast(&format!("prediction→{ad}"), y, ad);
        let img = g.op("unpatchify", &[y], out, ad);
        let lat = dims.latent;
        let pred = g.view("ε channels", img, lat);
        let target = g.input("target", lat, ad, false);
        let diff = g.op("pred − target", &[pred, target], lat, ad);
        let sq = g.op("(pred − target)²", &[diff], lat, ad);
        g.op("mean (loss)", &[sq], 1, ad);
        g
    }

    fn keeps_all_outputs(&self) -> bool {
        true
    }

    fn optimizer_scratch(
        &self,
        elems: u64,
        precision: Precision,
        optimizer: crate::spec::Optimizer,
    ) -> u64 {
        let sd = precision.optimizer_dtype().size();
        match optimizer {
            // m' = β1·m + (1−β1)·g and v' = β2·v + (1−β2)·g² as new tensors, then the update
            // m̂ / (√v̂ + ε) and the new weight: at most four state-sized temporaries at once.
            crate::spec::Optimizer::AdamW | crate::spec::Optimizer::AdamW8bit => 4 * elems * sd,
            // w' = w − lr·g: the scaled gradient and the new weight.
            crate::spec::Optimizer::Sgd => 2 * elems * precision.param_dtype().size(),
        }
    }

    fn ema_scratch(&self, elems: u64, dtype: Dtype) -> u64 {
        // ema·d and w·(1−d), then their sum replaces ema.
        3 * elems * dtype.size()
    }
}

/// The rules for a spec's runtime.
pub fn model_for(spec: &Spec) -> &'static dyn RuntimeModel {
    match spec.runtime {
        crate::spec::Runtime::DitmemCpu => &DitmemCpu,
    }
}

/// Element count of the largest linear of a block (used by sharded weight gathers).
pub fn block_param_elems(spec: &Spec) -> u64 {
    block_linears(spec)
        .iter()
        .map(|(_, _, o, i)| o * i + o)
        .sum()
}
