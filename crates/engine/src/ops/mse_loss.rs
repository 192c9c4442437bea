//! [`mse_loss`]: the diffusion loss `mean((pred − target)²)` as one node on the prediction,
//! keeping d = pred − target only. Budget twin: `ditmem_budget::ditmem_cpu::sims::family_loss`.
//!
//! Why: composed (a subtraction, a square, a sum, a scale), candle's backward makes the square's
//! rule `d·g` then `·2`, each step's `zeros_like` + `add` in the store, and the subtraction's and
//! the view's: six prediction-sized temporaries chained in the store while the loss backward
//! runs, on top of the kept d and d². At the tiny `sd3-bf16-lora4-none` spec that chain (515 KiB)
//! set the step's peak. PyTorch's `MseLossBackward0` saves pred and target and makes one
//! gradient. This op keeps d, hands d back scaled in place as the prediction's gradient, and
//! makes nothing else.
//!
//! Numerics: d is the composition's `pred − target`; the gradient is its rule's `(d·(g/n))·2`
//! element for element (the same bits); the loss sums d² in f64 before rounding to the dtype
//! (the composition summed in the dtype).

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp1, InplaceOp1, Layout, Shape, Tensor};

use super::storage::{err, with_cpu, CResult};

/// The op (see the module docs).
#[derive(Debug)]
struct MseLoss {
    /// d = pred − target, taken out by the backward.
    d: Mutex<Option<Tensor>>,
    n: usize,
}

/// `mean((pred − target)²)` (a scalar in pred's dtype, f32 or f64), differentiable in pred.
/// `target` (pred's shape and dtype) is taken by value and freed once d is made.
pub fn mse_loss(pred: &Tensor, target: Tensor) -> CResult<Tensor> {
    if pred.shape() != target.shape() || pred.dtype() != target.dtype() {
        return Err(err(format!(
            "mse loss: prediction {:?} {:?} and target {:?} {:?} differ",
            pred.dims(),
            pred.dtype(),
            target.dims(),
            target.dtype()
        )));
    }
    let d = (pred.detach() - &target)?;
    drop(target);
    let n = d.elem_count();
    pred.apply_op1(MseLoss {
        d: Mutex::new(Some(d)),
        n,
    })
}

/// `v = (v·gs)·2` in place: the square's rule on d with the mean's gradient gs = g/n.
struct ScaleByTwo {
    gs: f64,
}

impl InplaceOp1 for ScaleByTwo {
    fn name(&self) -> &'static str {
        "mse-loss-grad"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, _l: &Layout) -> CResult<()> {
        match s {
            CpuStorage::F32(v) => {
                let gs = self.gs as f32;
                v.iter_mut().for_each(|x| *x = (*x * gs) * 2.0);
            }
            CpuStorage::F64(v) => v.iter_mut().for_each(|x| *x = (*x * self.gs) * 2.0),
            _ => return Err(err("mse loss: f32 or f64 only")),
        }
        Ok(())
    }
}

impl CustomOp1 for MseLoss {
    fn name(&self) -> &'static str {
        "mse-loss"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let guard = self.d.lock().map_err(|_| err("mse loss: d poisoned"))?;
        let d = guard
            .as_ref()
            .ok_or_else(|| err("mse loss: d already taken"))?;
        let inv = 1.0 / self.n as f64;
        let out = with_cpu(d, |s, l| {
            let (a, b) = l
                .contiguous_offsets()
                .ok_or_else(|| err("mse loss: d must be contiguous"))?;
            Ok(match s {
                CpuStorage::F32(v) => {
                    let sum: f64 = v[a..b].iter().map(|&x| f64::from(x) * f64::from(x)).sum();
                    CpuStorage::F32(vec![(sum as f32) * inv as f32])
                }
                CpuStorage::F64(v) => {
                    let sum: f64 = v[a..b].iter().map(|&x| x * x).sum();
                    CpuStorage::F64(vec![sum * inv])
                }
                _ => return Err(err("mse loss: f32 or f64 only")),
            })
        })?;
        Ok((out, Shape::from(())))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let d = self
            .d
            .lock()
            .map_err(|_| err("mse loss: d poisoned"))?
            .take()
            .ok_or_else(|| err("mse loss: one backward per loss (d was taken)"))?;
        // The mean's rule in the dtype: g·(1/n), as candle's affine computes it.
        let inv = 1.0 / self.n as f64;
        let gs = match grad.dtype() {
            candle_core::DType::F32 => f64::from(grad.to_scalar::<f32>()? * inv as f32),
            _ => grad.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()? * inv,
        };
        d.inplace_op1(&ScaleByTwo { gs })?;
        Ok(Some(d.reshape(arg.shape())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// The fused loss against the composition: the loss to the dtype's rounding, the gradient
    /// to the bit, through a narrowed view as the DiT's ε channels are.
    #[test]
    fn matches_the_composition() {
        let dev = Device::Cpu;
        for dt in [DType::F32, DType::F64] {
            let vals: Vec<f64> = (0..96)
                .map(|i| ((i * 37 % 23) as f64 - 11.0) / 7.0)
                .collect();
            let x = Var::from_tensor(
                &Tensor::from_vec(vals, (2, 6, 8), &dev)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap(),
            )
            .unwrap();
            let tv: Vec<f64> = (0..64)
                .map(|i| ((i * 11 % 13) as f64 - 6.0) / 5.0)
                .collect();
            let target = Tensor::from_vec(tv, (2, 4, 8), &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let run = |fused: bool| {
                let pred = x.as_tensor().narrow(1, 0, 4).unwrap();
                let loss = if fused {
                    mse_loss(&pred, target.clone()).unwrap()
                } else {
                    (&pred - &target)
                        .unwrap()
                        .sqr()
                        .unwrap()
                        .mean_all()
                        .unwrap()
                };
                let root = loss.affine(0.75, 0.0).unwrap();
                let g = root.backward().unwrap();
                let l = loss
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap();
                let gx = g.get(x.as_tensor()).unwrap().to_dtype(DType::F64).unwrap();
                (l, gx.flatten_all().unwrap().to_vec1::<f64>().unwrap())
            };
            let (lf, gf) = run(true);
            let (lc, gc) = run(false);
            // The composition sums the 64 squares in the dtype in an order of candle's (which
            // may differ by CPU): within 64 roundings of the sum, all terms being positive.
            let u = if dt == DType::F32 {
                2f64.powi(-24)
            } else {
                2f64.powi(-53)
            };
            let tol = 64.0 * u;
            assert!((lf - lc).abs() <= tol * lc.abs(), "{dt:?}: {lf} vs {lc}");
            assert_eq!(gf, gc, "{dt:?}");
            assert!(
                gf[40..48].iter().all(|&v| v == 0.0),
                "the narrowed-off channels"
            );
        }
    }

    #[test]
    fn mismatched_target_is_an_error() {
        let dev = Device::Cpu;
        let p = Tensor::zeros((2, 3), DType::F32, &dev).unwrap();
        assert!(mse_loss(&p, Tensor::zeros((3, 2), DType::F32, &dev).unwrap()).is_err());
        assert!(mse_loss(&p, Tensor::zeros((2, 3), DType::F64, &dev).unwrap()).is_err());
    }
}
