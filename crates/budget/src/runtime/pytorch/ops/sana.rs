//! Sana's and Wan's builders (famsana): ops whose saves depend on which operands need a
//! gradient.

use super::{Attn, Builder, Lin};
use crate::segment::Tid;
use crate::spec::{AttentionMode, Dtype, SdpaBackend};

impl Builder<'_> {
    /// `LayerNorm(D, elementwise_affine=False)` as [`Builder::layer_norm`], recorded only when
    /// its input needs a gradient. A non-contiguous input (a transposed patch embedding) is
    /// made contiguous inside the CPU kernel's forward and again in its backward
    /// (`X.expect_contiguous()` in `layer_norm_cpu` / `layer_norm_backward_cpu`).
    pub(crate) fn layer_norm_strided(
        &mut self,
        name: &str,
        x: Tid,
        rows: u64,
        contiguous: bool,
    ) -> Tid {
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
    pub(crate) fn rms_norm(&mut self, name: &str, x: Tid, rows: u64, affine: bool) -> Tid {
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
    pub(crate) fn linear_if_grad(&mut self, name: &str, x: Tid, l: Lin) -> Tid {
        if self.rg(x) || self.lora_rank(name).is_some() || self.frozen() {
            return self.linear_opt(name, x, l);
        }
        self.linear_base(name, x, l, false)
    }

    /// `F.linear` on a non-contiguous 3-D input (a transposed view): `at::matmul` folds the input
    /// into a contiguous copy that `mm` saves when the weight needs a gradient (`should_fold`),
    /// otherwise it runs `bmm` on the strided input against the expanded weight and saves
    /// nothing new [MM][AC]; the bias is added in place. LoRA on the module: see
    /// [`Builder::linear_peft`] (lora_A, trained, folds its own copy).
    pub(crate) fn linear_strided(&mut self, name: &str, x: Tid, l: Lin) -> Tid {
        if !self.frozen() {
            let xc = self.cast_low(&format!("{name} input"), x);
            let dt = self.g.dtype(xc);
            let xr = self.g.op(
                &format!("{name} input reshaped for mm"),
                &[xc],
                l.rows * l.inp,
                dt,
            );
            return self.linear_opt(name, xr, l);
        }
        let y = self.linear_base(name, x, l, true);
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
            l.rows * l.inp,
            low,
        );
        self.lora_with_held_input(name, (x, xa0, xr), y, l.with_rank(r))
    }

    /// The LoRA branch on `xl` (what lora_A reads), while PEFT's `x = x.to(lora_A.weight.dtype)`
    /// copy `xa0` stays referenced until the layer's forward returns: its bytes ride as forward
    /// scratch on the branch's ops after the simulator's last read of it.
    /// `(x, xa0, xl)`: the layer's input, PEFT's copy, what lora_A reads; `shape`: the linear's
    /// `(rows, out, inp)` and the rank.
    fn lora_with_held_input(
        &mut self,
        name: &str,
        (x, xa0, xl): (Tid, Tid, Tid),
        base: Tid,
        shape: (u64, u64, u64, u64),
    ) -> Tid {
        let n0 = self.g.ops.len();
        // lora_A's `mm` saves its weight only for its input's gradient [AG]: with an input that
        // needs none, the weight's autocast copy only sits in the cache.
        let a_saved = self.rg(xl);
        let y = self.lora_adapters(name, xl, base, shape, a_saved);
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
    pub(crate) fn linear_peft(&mut self, name: &str, x: Tid, l: Lin) -> Tid {
        let r = match self.lora_rank(name) {
            Some(r) if self.autocast() => r,
            _ => return self.linear_opt(name, x, l),
        };
        let y = self.linear_base(name, x, l, true);
        let pd = self.adapter_dtype();
        let xa0 = self.g.cast(&format!("{name} x.to(lora_A dtype)"), x, pd);
        let xl = self.cast_low(&format!("{name}.lora_A input"), xa0);
        self.lora_with_held_input(name, (x, xa0, xl), y, l.with_rank(r))
    }

    /// `conv2d` / `conv3d` under autocast: `ConvolutionBackward0` saves input and weight together
    /// (one formula for both) whenever the node exists; the bias copy only sits in the cache
    /// [AG][AC].
    pub(crate) fn conv_rg(
        &mut self,
        name: &str,
        x: Tid,
        out_elems: u64,
        w_elems: u64,
        bias: Option<u64>,
    ) -> Tid {
        let ins = self.weighted_operands(name, x, w_elems, bias, true);
        let xin = ins[0];
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
    pub(crate) fn torch_rms_norm(&mut self, name: &str, x: Tid, rows: u64) -> Tid {
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
    pub(crate) fn attention_mask_saved(
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
