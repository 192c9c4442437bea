//! Flux's and SD3's builders (famjoint): grad-aware savers, `torch.nn.RMSNorm`, diffusers' real
//! RoPE, the linear by what needs a gradient ([`Builder::linear_g`]) and PEFT's LoRA branch.

use super::{promote, save, Builder, CACHED, SAVED};
use crate::segment::Tid;
use crate::spec::Dtype;

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
    pub(super) fn linear_opt_base(
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
    pub(super) fn lora_branch_peft(
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
