//! Optimizers on the master weights, the EMA of the trained weights, and the dynamic loss scaler
//! of fp16-mixed.
//!
//! - [`AdamW`]: β = (0.9, 0.999), eps 1e-8, bias correction, decoupled weight decay
//!   (p ← p − lr·wd·p, then p ← p − lr·m̂/(√v̂ + eps)); m and v in f32 (f64 under fp64), created
//!   at the first step. Weights stored in a lower dtype (bf16-pure) are updated in the optimizer
//!   dtype and cast back.
//! - [`Sgd`]: p ← p − lr·(g + wd·p); no state.
//! - [`Ema`]: shadow ← decay·shadow + (1 − decay)·p after each optimizer step, in its own dtype.
//! - [`LossScaler`]: initial scale 2^16; on a non-finite gradient the step is skipped and the
//!   scale halved; after `growth_interval` clean steps it doubles.

use candle_core::{DType, Tensor, Var};

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
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let g = unscale(g.to_dtype(self.dtype)?, inv_scale)?;
            let m = ((&self.m[i] * self.beta1)? + (&g * (1.0 - self.beta1))?)?;
            let v = ((&self.v[i] * self.beta2)? + (g.sqr()? * (1.0 - self.beta2))?)?;
            let pw = p.as_tensor().detach().to_dtype(self.dtype)?;
            let decayed = if self.weight_decay != 0.0 {
                (&pw * (1.0 - self.lr * self.weight_decay))?
            } else {
                pw
            };
            let denom = ((&v / bc2)?.sqrt()? + self.eps)?;
            let upd = ((&m / bc1)? / denom)?;
            let new = (decayed - (upd * self.lr)?)?;
            p.set(&new.to_dtype(p.dtype())?)?;
            self.m[i] = m;
            self.v[i] = v;
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
        for (s, p) in self.shadow.iter_mut().zip(params) {
            let pw = p.as_tensor().detach().to_dtype(self.dtype)?;
            *s = ((&*s * self.decay)? + (pw * (1.0 - self.decay))?)?;
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
