//! Flux's and SD3's builders (famjoint): grad-aware savers, `torch.nn.RMSNorm`, diffusers' real
//! RoPE, the linear by what needs a gradient ([`Builder::linear_g`]) and PEFT's LoRA branch.

use super::{save, Builder, Lin};
use crate::segment::Tid;
use crate::spec::Dtype;

impl<'a> Builder<'a> {
    /// Whether a gradient flows to `t` (autograd records a node only when some input needs one).
    pub(crate) fn rg(&self, t: Tid) -> bool {
        self.g.tensors[t].requires_grad
    }

    /// Mark `t` saved when `cond` (autograd saves a variable only for the inputs that need a
    /// gradient from it [AG]).
    pub(crate) fn save_if(&mut self, t: Tid, cond: bool) {
        if cond {
            save(&mut self.g, t);
        }
    }

    /// `F.linear` as [`Builder::linear_opt`], except that the (cast) weight is saved only when
    /// the input needs a gradient (`AddmmBackward0` saves `mat2` for `mat1`'s gradient [AG]):
    /// otherwise only the autocast cache holds its copy [AC] ([`Builder::linear_if_grad`]).
    /// Under LoRA on the module, PEFT `lora.Linear.forward` (peft 0.21 `tuners/lora/layer.py`):
    /// the frozen base (no saved input; its weight is a parameter), then
    /// `x = self._cast_input_dtype(x, lora_A.weight.dtype)` (a copy into the adapters' fp32 when
    /// x is in a lower dtype, bound to `x` until the forward returns), `lora_A` (autocast casts
    /// that copy again: each adapted module saves its own low-precision input [AC]), `lora_B`
    /// (saves A's output), `· scaling`, `result + …` [AG] ([`Builder::lora_after_base`]).
    pub(crate) fn linear_g(&mut self, name: &str, x: Tid, l: Lin) -> Tid {
        if let (true, Some(r)) = (self.frozen(), self.lora_rank(name)) {
            let y = self.linear_base(name, x, l, true);
            let pd = self.adapter_dtype();
            let x32 = self.g.cast(&format!("{name} x.to(lora dtype)"), x, pd);
            return self.lora_after_base(name, (x, x32), y, l.with_rank(r));
        }
        self.linear_if_grad(name, x, l)
    }

    /// diffusers `apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1)` on x of
    /// `n` elements: `-x_imag` (n/2), `stack` (n), `x.float()·cos`, `x_rotated.float()·sin` and
    /// their sum in fp32 (with the casts below fp32), `.to(x.dtype)`; the muls save only the
    /// fp32 tables (they need no gradient) [AG].
    pub(crate) fn rope_real(&mut self, name: &str, x: Tid, cos: Tid, sin: Tid) -> Tid {
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
    pub(crate) fn hold(&mut self, name: &str, ts: &[Tid]) {
        self.g
            .op(&format!("{name} (locals released)"), ts, 0, Dtype::F32);
    }
}
