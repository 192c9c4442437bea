//! Optimizers on the master weights, the EMA of the trained weights, and the dynamic loss scaler
//! of fp16-mixed.
//!
//! - [`AdamW`]: β = (0.9, 0.999), eps 1e-8, bias correction, decoupled weight decay, updated in
//!   place in one pass over weight, gradient and moments (no state-sized temporaries)
//!   (p ← p − lr·wd·p, then p ← p − lr·m̂/(√v̂ + eps)); m and v in f32 (f64 under fp64), plain
//!   buffers of the optimizer created at the first step. Weights stored in a lower dtype (bf16-pure) are updated in the optimizer
//!   dtype and cast back.
//! - [`Sgd`]: p ← p − lr·(g + wd·p); no state.
//! - [`Ema`]: shadow ← decay·shadow + (1 − decay)·p after each optimizer step, in its own dtype.
//! - [`LossScaler`]: initial scale 2^16; on a non-finite gradient the step is skipped and the
//!   scale halved; after `growth_interval` clean steps it doubles.

use candle_core::{bail, CpuStorage, DType, Layout, Tensor, Var};
use rayon::prelude::*;

use crate::error::Result;
use crate::kernels::scalar::{Acc, Elem};
use crate::ops::custom_op::{Cpu, CpuInplaceOp, Op};
use crate::ops::storage::CResult;

/// Update rule shared by the optimizers.
pub trait Optimizer: Send {
    /// Apply one update; `grads[i]` belongs to `params[i]` and is multiplied by `inv_scale`
    /// (1/loss scale) as it is read.
    fn step(&mut self, params: &[&Var], grads: &[&Tensor], inv_scale: f64) -> Result<()>;
    /// Bytes of optimizer state.
    fn state_bytes(&self) -> u64;
    /// The next step is the last one this optimizer takes: its state need not outlive it.
    /// Stateful optimizers then hold one tensor's state at a time during that step and none
    /// after (the update itself is unchanged, bit for bit). `verify` uses it: its runs stop
    /// after the compared steps, so a state kept for a step never taken only costs memory.
    fn release_state_after_next_step(&mut self) {}
}

fn unscale(g: Tensor, inv_scale: f64) -> Result<Tensor> {
    Ok(if inv_scale == 1.0 {
        g
    } else {
        (g * inv_scale)?
    })
}

/// Elements per parallel work item of the update kernels; shorter tensors (biases, norms) run
/// on the calling thread. The updates are memory-bound, so they spread over the cores like the
/// rest of the step instead of running on one.
const PAR_ITEM: usize = 1 << 15;

/// `f` over matching chunks of `a` (written) and `b`, in parallel when long enough.
fn zip2<A: Send, B: Sync>(a: &mut [A], b: &[B], f: impl Fn(&mut [A], &[B]) + Sync) {
    if a.len() < 2 * PAR_ITEM {
        f(a, b)
    } else {
        a.par_chunks_mut(PAR_ITEM)
            .zip(b.par_chunks(PAR_ITEM))
            .for_each(|(x, y)| f(x, y));
    }
}

fn bytes(t: &Tensor) -> u64 {
    t.elem_count() as u64 * t.dtype().size_in_bytes() as u64
}

/// The contiguous range of a layout (the optimizer's tensors are always contiguous).
fn range(l: &Layout, what: &str) -> candle_core::Result<std::ops::Range<usize>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(a..b),
        None => bail!("{what}: a contiguous tensor is expected"),
    }
}

/// AdamW's moments of one tensor, owned by the optimizer (no candle tensors: the fused update
/// below writes them in the same pass as the weight).
#[derive(Debug)]
enum Moments {
    F32 { m: Vec<f32>, v: Vec<f32> },
    F64 { m: Vec<f64>, v: Vec<f64> },
}

impl Moments {
    fn zeros(n: usize, dtype: DType) -> Result<Moments> {
        Ok(match dtype {
            DType::F32 => Moments::F32 {
                m: vec![0.0; n],
                v: vec![0.0; n],
            },
            DType::F64 => Moments::F64 {
                m: vec![0.0; n],
                v: vec![0.0; n],
            },
            other => {
                return Err(crate::error::EngineError::unsupported(
                    format!("AdamW state in {other:?}"),
                    "the optimizer state is f32 (or f64 under fp64)",
                ))
            }
        })
    }

    fn bytes(&self) -> u64 {
        match self {
            Moments::F32 { m, v } => 4 * (m.len() + v.len()) as u64,
            Moments::F64 { m, v } => 8 * (m.len() + v.len()) as u64,
        }
    }
}

/// One AdamW update of a weight in one pass over p, g, m and v:
/// `m ← β₁m + (1 − β₁)(s·g)`, `v ← β₂v + (1 − β₂)(s·g)²`,
/// `p ← p·(1 − lr·wd) − lr·(m/bc1)/(√(v/bc2) + eps)`, in the state's dtype (weights stored in
/// bf16/f16 are widened and rounded back per element). Three separate in-place passes read the
/// state twice; this one reads and writes each value once, spread over the cores.
struct AdamUpdate<'a> {
    beta1: f64,
    beta2: f64,
    scale: f64,
    lr: f64,
    decay: f64,
    bc1: f64,
    bc2: f64,
    eps: f64,
    state: std::sync::Mutex<&'a mut Moments>,
}

impl AdamUpdate<'_> {
    /// The pass over matching chunks; `get`/`put` convert the stored weight.
    fn pass<T: Acc + Send + Sync, P: Copy + Send + Sync>(
        &self,
        p: &mut [P],
        g: &[T],
        m: &mut [T],
        v: &mut [T],
        get: impl Fn(P) -> T + Sync,
        put: impl Fn(T) -> P + Sync,
    ) where
        half::bf16: Elem<T>,
    {
        let of = T::from_f64;
        let (b1, a1) = (of(self.beta1), of(1.0 - self.beta1));
        let (b2, a2) = (of(self.beta2), of(1.0 - self.beta2));
        let (s, lr, decay) = (of(self.scale), of(self.lr), of(self.decay));
        let (bc1, bc2, eps) = (of(self.bc1), of(self.bc2), of(self.eps));
        // Rounded to the nearest bf16 (the mutation `AdamMomentsBf16`).
        let bf16 = |x: T| half::bf16::from_acc(x).to_acc();
        let moments_bf16 = crate::mutation::active(crate::mutation::Mutation::AdamMomentsBf16);
        let chunk = |p: &mut [P], g: &[T], m: &mut [T], v: &mut [T]| {
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                let g = g * s;
                *m = *m * b1 + g * a1;
                *v = *v * b2 + g * g * a2;
                if moments_bf16 {
                    *m = bf16(*m);
                    *v = bf16(*v);
                }
                let upd = (*m / bc1) / ((*v / bc2).sqrt() + eps);
                *p = put(get(*p) * decay - upd * lr);
            }
        };
        if p.len() < 2 * PAR_ITEM {
            chunk(p, g, m, v);
        } else {
            p.par_chunks_mut(PAR_ITEM)
                .zip(g.par_chunks(PAR_ITEM))
                .zip(m.par_chunks_mut(PAR_ITEM).zip(v.par_chunks_mut(PAR_ITEM)))
                .for_each(|((p, g), (m, v))| chunk(p, g, m, v));
        }
    }
}

impl CpuInplaceOp for AdamUpdate<'_> {
    fn name(&self) -> &'static str {
        "adamw-update"
    }

    fn fwd(&self, (s1, l1): (&mut CpuStorage, &Layout), (s2, l2): Cpu<'_>) -> CResult<()> {
        let (r1, r2) = (range(l1, self.name())?, range(l2, self.name())?);
        let mut st = self
            .state
            .lock()
            .map_err(|_| candle_core::Error::Msg("adamw-update: state lock poisoned".into()))?;
        let n = r1.len();
        if r2.len() != n {
            bail!("adamw-update: gradient length differs from the weight's");
        }
        match (s1, s2, &mut **st) {
            (CpuStorage::F32(p), CpuStorage::F32(g), Moments::F32 { m, v }) if m.len() == n => {
                self.pass(&mut p[r1], &g[r2], m, v, |x| x, |y| y)
            }
            (CpuStorage::F64(p), CpuStorage::F64(g), Moments::F64 { m, v }) if m.len() == n => {
                self.pass(&mut p[r1], &g[r2], m, v, |x| x, |y| y)
            }
            (CpuStorage::BF16(p), CpuStorage::F32(g), Moments::F32 { m, v }) if m.len() == n => {
                self.pass(
                    &mut p[r1],
                    &g[r2],
                    m,
                    v,
                    |x| x.to_f32(),
                    half::bf16::from_f32,
                )
            }
            (CpuStorage::F16(p), CpuStorage::F32(g), Moments::F32 { m, v }) if m.len() == n => self
                .pass(
                    &mut p[r1],
                    &g[r2],
                    m,
                    v,
                    |x| x.to_f32(),
                    half::f16::from_f32,
                ),
            _ => bail!("adamw-update: unsupported weight / gradient / state dtypes or sizes"),
        }
        Ok(())
    }
}

/// `shadow ← d·shadow + (1 − d)·p` in place (the weights converted per element when the EMA
/// has another dtype).
struct EmaStep {
    decay: f64,
}

/// The EMA's update on elements of any storage type, through f64 (f32 pairs stay in f32).
fn ema_mix<S: Elem<f64> + Send, P: Elem<f64> + Sync>(s: &mut [S], p: &[P], d: f64) {
    zip2(s, p, |s, p| {
        for (s, p) in s.iter_mut().zip(p) {
            *s = S::from_acc(s.to_acc() * d + p.to_acc() * (1.0 - d));
        }
    });
}

impl CpuInplaceOp for EmaStep {
    fn name(&self) -> &'static str {
        "ema-step"
    }

    fn fwd(&self, (s1, l1): (&mut CpuStorage, &Layout), (s2, l2): Cpu<'_>) -> CResult<()> {
        let (r1, r2) = (range(l1, self.name())?, range(l2, self.name())?);
        let d = self.decay;
        macro_rules! by_weight {
            ($s:expr) => {
                match s2 {
                    CpuStorage::F32(p) => ema_mix(&mut $s[r1], &p[r2], d),
                    CpuStorage::F64(p) => ema_mix(&mut $s[r1], &p[r2], d),
                    CpuStorage::BF16(p) => ema_mix(&mut $s[r1], &p[r2], d),
                    CpuStorage::F16(p) => ema_mix(&mut $s[r1], &p[r2], d),
                    _ => bail!("ema-step: unsupported weight dtype"),
                }
            };
        }
        match s1 {
            // The common case stays in f32 arithmetic.
            CpuStorage::F32(s) => match s2 {
                CpuStorage::F32(p) => {
                    let (d, a) = (d as f32, (1.0 - d) as f32);
                    zip2(&mut s[r1], &p[r2], |s, p| {
                        for (s, &p) in s.iter_mut().zip(p) {
                            *s = *s * d + p * a;
                        }
                    });
                }
                _ => by_weight!(s),
            },
            CpuStorage::F64(s) => by_weight!(s),
            CpuStorage::BF16(s) => by_weight!(s),
            CpuStorage::F16(s) => by_weight!(s),
            _ => bail!("ema-step: unsupported EMA dtype"),
        }
        Ok(())
    }
}

/// AdamW with bias correction and decoupled weight decay.
#[derive(Debug)]
pub struct AdamW {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub dtype: DType,
    t: u64,
    moments: Vec<Moments>,
    /// Set by [`Optimizer::release_state_after_next_step`]: the next step frees each tensor's
    /// moments right after its update (and creates them one at a time on a first step).
    release: bool,
}

impl AdamW {
    pub fn new(lr: f64, weight_decay: f64, dtype: DType) -> Self {
        AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            dtype,
            t: 0,
            moments: Vec::new(),
            release: false,
        }
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.t
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, params: &[&Var], grads: &[&Tensor], inv_scale: f64) -> Result<()> {
        let release = std::mem::take(&mut self.release);
        if self.moments.is_empty() && !release {
            for p in params {
                self.moments
                    .push(Moments::zeros(p.as_tensor().elem_count(), self.dtype)?);
            }
        }
        let first = self.moments.is_empty();
        if (!first && self.moments.len() != params.len()) || grads.len() != params.len() {
            return Err(crate::error::EngineError::bad_input(
                "optimizer",
                format!(
                    "{} parameters and {} gradients for {} moment pairs",
                    params.len(),
                    grads.len(),
                    self.moments.len()
                ),
            ));
        }
        self.t += 1;
        let t = self.t as i32;
        let bc1 = 1.0 - self.beta1.powi(t);
        let bc2 = 1.0 - self.beta2.powi(t);
        // Under `release` each tensor's moments live only through its own update: created as
        // zeros on a first step (as the loop above would), taken out of the list otherwise.
        let mut kept = std::mem::take(&mut self.moments).into_iter();
        for (p, g) in params.iter().zip(grads) {
            let mut own = match kept.next() {
                Some(st) => st,
                None => Moments::zeros(p.as_tensor().elem_count(), self.dtype)?,
            };
            let st = &mut own;
            let g = g.to_dtype(self.dtype)?;
            let update = AdamUpdate {
                beta1: self.beta1,
                beta2: self.beta2,
                scale: inv_scale,
                lr: self.lr,
                decay: 1.0 - self.lr * self.weight_decay,
                bc1,
                bc2,
                eps: self.eps,
                state: std::sync::Mutex::new(st),
            };
            p.as_tensor().inplace_op2(&g, &Op(update))?;
            if !release {
                self.moments.push(own);
            }
        }
        Ok(())
    }

    fn state_bytes(&self) -> u64 {
        self.moments.iter().map(Moments::bytes).sum()
    }

    fn release_state_after_next_step(&mut self) {
        self.release = true;
    }
}

/// Plain SGD with (coupled) weight decay.
#[derive(Debug)]
pub struct Sgd {
    pub lr: f64,
    pub weight_decay: f64,
    pub dtype: DType,
}

impl Optimizer for Sgd {
    fn step(&mut self, params: &[&Var], grads: &[&Tensor], inv_scale: f64) -> Result<()> {
        for (p, g) in params.iter().zip(grads) {
            let pw = p.as_tensor().detach().to_dtype(self.dtype)?;
            let mut g = unscale(g.to_dtype(self.dtype)?, inv_scale)?;
            if self.weight_decay != 0.0 {
                g = (g + (&pw * self.weight_decay)?)?;
            }
            let new = (pw - (g * self.lr)?)?;
            p.set(&new.to_dtype(p.dtype())?)?;
        }
        Ok(())
    }

    fn state_bytes(&self) -> u64 {
        0
    }
}

/// Exponential moving average of the trained weights.
#[derive(Debug)]
pub(crate) struct Ema {
    pub decay: f64,
    shadow: Vec<Tensor>,
}

impl Ema {
    /// Starts as a copy of `params` in `dtype`.
    pub(crate) fn new(params: &[&Var], decay: f64, dtype: DType) -> Result<Self> {
        let shadow = params
            .iter()
            .map(|p| Ok(p.as_tensor().detach().to_dtype(dtype)?.copy()?.detach()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Ema { decay, shadow })
    }

    pub(crate) fn update(&mut self, params: &[&Var]) -> Result<()> {
        let step = Op(EmaStep { decay: self.decay });
        for (s, p) in self.shadow.iter().zip(params) {
            s.inplace_op2(p.as_tensor(), &step)?;
        }
        Ok(())
    }

    pub(crate) fn shadow(&self) -> &[Tensor] {
        &self.shadow
    }

    pub(crate) fn state_bytes(&self) -> u64 {
        self.shadow.iter().map(bytes).sum()
    }
}

/// Dynamic loss scaling for fp16-mixed.
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    pub scale: f64,
    pub growth_interval: u32,
    clean_steps: u32,
}

impl LossScaler {
    /// Initial scale 2^16.
    pub const INITIAL: f64 = 65536.0;

    pub fn new(growth_interval: u32) -> Self {
        LossScaler {
            scale: Self::INITIAL,
            growth_interval: growth_interval.max(1),
            clean_steps: 0,
        }
    }

    /// Record whether the gradients were finite; returns true when the step must be skipped.
    pub(crate) fn update(&mut self, finite: bool) -> bool {
        if finite {
            self.clean_steps += 1;
            if self.clean_steps >= self.growth_interval {
                self.scale *= 2.0;
                self.clean_steps = 0;
            }
            false
        } else {
            self.scale = (self.scale / 2.0).max(f64::MIN_POSITIVE);
            self.clean_steps = 0;
            true
        }
    }

    /// Set the scale (tests inject overflows with a huge one).
    pub(crate) fn set_scale(&mut self, scale: f64) {
        self.scale = scale;
        self.clean_steps = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn adamw_first_step_moves_by_lr() {
        // With bias correction the first AdamW step is lr·sign(g) (|g| ≫ eps).
        let p =
            Var::from_tensor(&Tensor::new(&[1.0f64, -2.0, 0.5], &Device::Cpu).unwrap()).unwrap();
        let g = Tensor::new(&[0.3f64, -4.0, 0.0], &Device::Cpu).unwrap();
        let mut o = AdamW::new(0.1, 0.0, DType::F64);
        o.step(&[&p], &[&g], 1.0).unwrap();
        let v: Vec<f64> = p.as_tensor().to_vec1().unwrap();
        assert!((v[0] - 0.9).abs() < 1e-6);
        assert!((v[1] - (-1.9)).abs() < 1e-6);
        assert!((v[2] - 0.5).abs() < 1e-12);
        assert_eq!(o.state_bytes(), 2 * 3 * 8);
    }

    #[test]
    fn scaler_halves_and_grows() {
        let mut s = LossScaler::new(2);
        assert!(s.update(false));
        assert_eq!(s.scale, 32768.0);
        assert!(!s.update(true));
        assert!(!s.update(true));
        assert_eq!(s.scale, 65536.0);
    }
}
