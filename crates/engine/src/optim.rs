//! Optimizers on the master weights, the EMA of the trained weights, and the dynamic loss scaler
//! of fp16-mixed.
//!
//! - [`AdamW`]: β = (0.9, 0.999), eps 1e-8, bias correction, decoupled weight decay, updated in
//!   place by three one-pass kernels (m, v, then the weight; no state-sized temporaries)
//!   (p ← p − lr·wd·p, then p ← p − lr·m̂/(√v̂ + eps)); m and v in f32 (f64 under fp64), created
//!   at the first step. Weights stored in a lower dtype (bf16-pure) are updated in the optimizer
//!   dtype and cast back.
//! - [`Sgd`]: p ← p − lr·(g + wd·p); no state.
//! - [`Ema`]: shadow ← decay·shadow + (1 − decay)·p after each optimizer step, in its own dtype.
//! - [`LossScaler`]: initial scale 2^16; on a non-finite gradient the step is skipped and the
//!   scale halved; after `growth_interval` clean steps it doubles.

use candle_core::{bail, CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Tensor, Var};

use crate::error::Result;

/// Update rule shared by the optimizers.
pub trait Optimizer {
    /// Apply one update; `grads[i]` belongs to `params[i]` and is multiplied by `inv_scale`
    /// (1/loss scale) as it is read.
    fn step(&mut self, params: &[&Var], grads: &[&Tensor], inv_scale: f64) -> Result<()>;
    /// Bytes of optimizer state.
    fn state_bytes(&self) -> u64;
}

fn unscale(g: Tensor, inv_scale: f64) -> Result<Tensor> {
    Ok(if inv_scale == 1.0 {
        g
    } else {
        (g * inv_scale)?
    })
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

/// `m ← β·m + (1 − β)·(s·g)` (or `(s·g)²` for the second moment), in place in one pass: no
/// temporaries, where the composed candle expression made five state-sized ones.
struct Moment {
    beta: f64,
    scale: f64,
    square: bool,
}

impl Moment {
    fn apply<T: num_like::Float>(&self, d: &mut [T], g: &[T]) {
        let (b, a, s) = (T::of(self.beta), T::of(1.0 - self.beta), T::of(self.scale));
        for (d, &g) in d.iter_mut().zip(g) {
            let g = g * s;
            let x = if self.square { g * g } else { g };
            *d = *d * b + x * a;
        }
    }
}

impl InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let (r1, r2) = (range(l1, self.name())?, range(l2, self.name())?);
        match (s1, s2) {
            (CpuStorage::F32(d), CpuStorage::F32(g)) => self.apply(&mut d[r1], &g[r2]),
            (CpuStorage::F64(d), CpuStorage::F64(g)) => self.apply(&mut d[r1], &g[r2]),
            _ => bail!("adamw-moment: state and gradient must both be f32 or f64"),
        }
        Ok(())
    }
}

/// `p ← p·(1 − lr·wd) − lr·(m/bc1)/(√(v/bc2) + eps)` in place, in the state's dtype (weights
/// stored in bf16 are widened and rounded back per element).
struct AdamStep {
    lr: f64,
    decay: f64,
    bc1: f64,
    bc2: f64,
    eps: f64,
}

impl AdamStep {
    fn update<T: num_like::Float>(&self, p: T, m: T, v: T) -> T {
        let mh = m / T::of(self.bc1);
        let vh = v / T::of(self.bc2);
        let upd = mh / (vh.sqrt() + T::of(self.eps));
        p * T::of(self.decay) - upd * T::of(self.lr)
    }
}

impl InplaceOp3 for AdamStep {
    fn name(&self) -> &'static str {
        "adamw-step"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        let (r1, r2, r3) = (
            range(l1, self.name())?,
            range(l2, self.name())?,
            range(l3, self.name())?,
        );
        match (s1, s2, s3) {
            (CpuStorage::F32(p), CpuStorage::F32(m), CpuStorage::F32(v)) => {
                for ((p, &m), &v) in p[r1].iter_mut().zip(&m[r2]).zip(&v[r3]) {
                    *p = self.update(*p, m, v);
                }
            }
            (CpuStorage::F64(p), CpuStorage::F64(m), CpuStorage::F64(v)) => {
                for ((p, &m), &v) in p[r1].iter_mut().zip(&m[r2]).zip(&v[r3]) {
                    *p = self.update(*p, m, v);
                }
            }
            (CpuStorage::BF16(p), CpuStorage::F32(m), CpuStorage::F32(v)) => {
                for ((p, &m), &v) in p[r1].iter_mut().zip(&m[r2]).zip(&v[r3]) {
                    *p = half::bf16::from_f32(self.update(p.to_f32(), m, v));
                }
            }
            (CpuStorage::F16(p), CpuStorage::F32(m), CpuStorage::F32(v)) => {
                for ((p, &m), &v) in p[r1].iter_mut().zip(&m[r2]).zip(&v[r3]) {
                    *p = half::f16::from_f32(self.update(p.to_f32(), m, v));
                }
            }
            _ => bail!("adamw-step: unsupported weight / state dtypes"),
        }
        Ok(())
    }
}

/// `shadow ← d·shadow + (1 − d)·p` in place (the weights converted per element when the EMA
/// has another dtype).
struct EmaStep {
    decay: f64,
}

/// Element types the EMA kernel reads and writes, through f64 (f32 pairs stay in f32).
trait Elem: Copy {
    fn get(self) -> f64;
    fn put(x: f64) -> Self;
}

impl Elem for f32 {
    fn get(self) -> f64 {
        f64::from(self)
    }
    fn put(x: f64) -> Self {
        x as f32
    }
}

impl Elem for f64 {
    fn get(self) -> f64 {
        self
    }
    fn put(x: f64) -> Self {
        x
    }
}

impl Elem for half::bf16 {
    fn get(self) -> f64 {
        self.to_f64()
    }
    fn put(x: f64) -> Self {
        half::bf16::from_f64(x)
    }
}

impl Elem for half::f16 {
    fn get(self) -> f64 {
        self.to_f64()
    }
    fn put(x: f64) -> Self {
        half::f16::from_f64(x)
    }
}

fn ema_mix<S: Elem, P: Elem>(s: &mut [S], p: &[P], d: f64) {
    for (s, p) in s.iter_mut().zip(p) {
        *s = S::put(s.get() * d + p.get() * (1.0 - d));
    }
}

impl InplaceOp2 for EmaStep {
    fn name(&self) -> &'static str {
        "ema-step"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
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
                    for (s, &p) in s[r1].iter_mut().zip(&p[r2]) {
                        *s = *s * d + p * a;
                    }
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

/// The two float types the optimizer kernels run in.
mod num_like {
    pub trait Float:
        Copy
        + std::ops::Add<Output = Self>
        + std::ops::Sub<Output = Self>
        + std::ops::Mul<Output = Self>
        + std::ops::Div<Output = Self>
    {
        fn of(x: f64) -> Self;
        fn sqrt(self) -> Self;
    }

    impl Float for f32 {
        fn of(x: f64) -> Self {
            x as f32
        }
        fn sqrt(self) -> Self {
            f32::sqrt(self)
        }
    }

    impl Float for f64 {
        fn of(x: f64) -> Self {
            x
        }
        fn sqrt(self) -> Self {
            f64::sqrt(self)
        }
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
    m: Vec<Tensor>,
    v: Vec<Tensor>,
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
            m: Vec::new(),
            v: Vec::new(),
        }
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.t
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, params: &[&Var], grads: &[&Tensor], inv_scale: f64) -> Result<()> {
        if self.m.is_empty() {
            for p in params {
                self.m
                    .push(Tensor::zeros(p.shape(), self.dtype, p.device())?);
                self.v
                    .push(Tensor::zeros(p.shape(), self.dtype, p.device())?);
            }
        }
        self.t += 1;
        let t = self.t as i32;
        let bc1 = 1.0 - self.beta1.powi(t);
        let bc2 = 1.0 - self.beta2.powi(t);
        // One pass per tensor, in place: m, v, then the weight (no state-sized temporaries).
        let step = AdamStep {
            lr: self.lr,
            decay: 1.0 - self.lr * self.weight_decay,
            bc1,
            bc2,
            eps: self.eps,
        };
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let g = g.to_dtype(self.dtype)?;
            for (state, beta, square) in [
                (&self.m[i], self.beta1, false),
                (&self.v[i], self.beta2, true),
            ] {
                state.inplace_op2(
                    &g,
                    &Moment {
                        beta,
                        scale: inv_scale,
                        square,
                    },
                )?;
            }
            p.as_tensor().inplace_op3(&self.m[i], &self.v[i], &step)?;
        }
        Ok(())
    }

    fn state_bytes(&self) -> u64 {
        self.m.iter().chain(&self.v).map(bytes).sum()
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
pub struct Ema {
    pub decay: f64,
    pub dtype: DType,
    shadow: Vec<Tensor>,
}

impl Ema {
    /// Starts as a copy of `params` in `dtype`.
    pub fn new(params: &[&Var], decay: f64, dtype: DType) -> Result<Self> {
        let shadow = params
            .iter()
            .map(|p| Ok(p.as_tensor().detach().to_dtype(dtype)?.copy()?.detach()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Ema {
            decay,
            dtype,
            shadow,
        })
    }

    pub fn update(&mut self, params: &[&Var]) -> Result<()> {
        let step = EmaStep { decay: self.decay };
        for (s, p) in self.shadow.iter().zip(params) {
            s.inplace_op2(p.as_tensor(), &step)?;
        }
        Ok(())
    }

    pub fn shadow(&self) -> &[Tensor] {
        &self.shadow
    }

    pub fn state_bytes(&self) -> u64 {
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
    pub fn update(&mut self, finite: bool) -> bool {
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
    pub fn set_scale(&mut self, scale: f64) {
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
