//! PixArt's and diffusers' DiT's builders (famcross): ops that save only what a gradient needs,
//! the masked attention of a cross-attention, PEFT's input cast.

use super::{cpu_gemm_scratch, promote, save, Attn, Builder, Lin, LEFT_UNSAVED, MATMUL};
use crate::segment::Tid;
use crate::spec::{AttentionMode, Dtype, SdpaBackend, TorchDevice};

impl Builder<'_> {
    /// `a * b` elementwise (broadcast) into `n` elements of the promoted dtype: `MulBackward0`
    /// saves `b` when `a` needs a gradient and `a` when `b` does [AG].
    pub(crate) fn mul(&mut self, name: &str, a: Tid, b: Tid, n: u64) -> Tid {
        let (ra, rb) = (self.rg(a), self.rg(b));
        self.save_if(b, ra);
        self.save_if(a, rb);
        let dt = promote(self.g.dtype(a), self.g.dtype(b));
        self.g.op(name, &[a, b], n, dt)
    }

    /// An elementwise op that saves nothing (`add`, `sub`, a scalar multiple or division) into `n`
    /// elements of the promoted dtype of its inputs [AG].
    pub(crate) fn ew(&mut self, name: &str, ins: &[Tid], n: u64) -> Tid {
        let dt = ins
            .iter()
            .map(|&t| self.g.dtype(t))
            .reduce(promote)
            .unwrap_or(Dtype::F32);
        self.g.op(name, ins, n, dt)
    }

    /// An activation that saves its input (`gelu`, `silu`) when it needs a gradient [AG]; the
    /// output keeps the input's dtype (neither is on an autocast list) [AC].
    pub(crate) fn act(&mut self, name: &str, x: Tid) -> Tid {
        let r = self.rg(x);
        self.save_if(x, r);
        let (n, dt) = (self.g.elems(x), self.g.dtype(x));
        self.g.op(name, &[x], n, dt)
    }

    /// [`Builder::layer_norm`] when its input needs a gradient; otherwise autograd records
    /// nothing (no saved input, no mean/rstd kept) [AG].
    pub(crate) fn layer_norm_rg(&mut self, name: &str, x: Tid, rows: u64) -> Tid {
        if self.rg(x) {
            return self.layer_norm(name, x, rows);
        }
        let (n, dt) = (self.g.elems(x), self.g.dtype(x));
        self.g.op(name, &[x], n, dt)
    }

    /// `x·(1 + scale) + shift` with [`Builder::mul`]'s saving rule (a frozen scale saves only
    /// `1 + scale`, an input without gradient only the norm's output) [AG].
    pub(crate) fn modulate_rg(
        &mut self,
        name: &str,
        xn: Tid,
        shift: Tid,
        scale: Tid,
        bd: u64,
    ) -> Tid {
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
    pub(crate) fn linear_rg(&mut self, name: &str, x: Tid, l: Lin) -> Tid {
        let y = self.linear_base(name, x, l, self.rg(x));
        let Some(r) = self.lora_rank(name) else {
            return y;
        };
        let pd = self.adapter_dtype();
        let xa0 = if self.autocast() {
            self.g.cast(&format!("{name} lora input →{pd}"), x, pd)
        } else {
            x
        };
        self.lora_after_base(name, (x, xa0), y, l.with_rank(r))
    }

    /// A matmul `(m × k) · (k × n)` (`addmm`/`mm` of a linear: `ins` = input, weight[, bias])
    /// into `m × n` elements of the compute dtype, with the CPU's low-precision matmul scratch
    /// ([`Builder::gemm_scratch`]) for the gradients its backward computes: the input's when
    /// it needs one, the weight's when the weight does.
    pub(crate) fn product(&mut self, name: &str, ins: &[Tid], m: u64, k: u64, n: u64) -> Tid {
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
    pub(crate) fn gemm_scratch(
        &mut self,
        y: Tid,
        m: u64,
        k: u64,
        n: u64,
        grad_x: bool,
        grad_w: bool,
    ) {
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
    pub(crate) fn attention_masked(
        &mut self,
        q: Tid,
        k: Tid,
        v: Tid,
        mask: Option<Tid>,
        at: Attn,
    ) -> Tid {
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
