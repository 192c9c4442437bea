//! One step on the fixed batch against the reference (module docs, 1.): per-tensor gradient
//! errors ([`TensorError`]) and their summary ([`OneStep`], [`check_one_step`]).

use super::error::bad;
use super::error::Result;
use super::metrics::{diff_norm, hash_values, norm, ratio, rel_err, scalar_rel, to_f64};
use super::reference::{Reference, VerifyOptions};
use super::tolerance::{Tolerance, KAPPA_KINK, KAPPA_UNDERFLOW};
use super::variant::Variant;
use super::verdict::Fault;
use crate::diffusion::{Batch, SyntheticData};
use crate::model::Dims;
use crate::trainer::Trainer;
use ditmem_budget::{Precision, Spec};
use serde::Serialize;
use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;

/// Gradient error of one tensor.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorError {
    pub name: String,
    pub rel_err: f64,
    /// The tensor's underflow term measured on the reference: the relative error its
    /// loss-scaled gradient loses to the compute dtype's subnormals, in its own storage and in
    /// its activation gradients' ([`super::terms::underflow_with_upstream`]); 0 when it
    /// is normal, and for a gradient zero in exact arithmetic (judged against the whole
    /// gradient, whose scale is normal).
    pub underflow: f64,
    /// The cancellation its gradient comes out of: ‖terms‖ / ‖result‖ in the f64 replay
    /// ([`Reference::amplification`]), or a key bias's remainder of a zero sum measured on the
    /// reference's gradients (`key_bias.rs`); 1 when none.
    pub amplification: f64,
    /// The expected relative error from components crossing a ReLU kink in the compute dtype
    /// ([`Reference::kink_of`]; 0 when none).
    pub kink: f64,
    /// The cancellation of the softmax backward behind it: ‖terms‖ / ‖result‖ in the f64
    /// replay ([`Reference::softmax_amplification`], `softmax.rs`; 1 when none). It amplifies
    /// the rounding of the dtype the softmax backward runs in ([`softmax_dtype`]).
    pub softmax: f64,
}

impl OneStep {
    /// The tensor with the largest error / its own tolerance, that margin and that tolerance
    /// (None without tensors).
    pub(crate) fn worst_margin(&self, tol: &Tolerance) -> Option<(&TensorError, f64, f64)> {
        self.per_tensor
            .iter()
            .map(|te| {
                let t = tol.grad_of(te);
                let m = if te.rel_err.is_nan() {
                    f64::INFINITY
                } else {
                    te.rel_err / t
                };
                (te, m, t)
            })
            .max_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// The gradient's margin under `tol` (0 without tensors) and the largest per-tensor
    /// tolerance, which bounds the whole gradient's relative error (and so its norm's).
    pub(super) fn grad_margin(&self, tol: &Tolerance) -> (f64, f64) {
        let m = self.worst_margin(tol).map_or(0.0, |w| w.1);
        let widest = self
            .per_tensor
            .iter()
            .map(|te| tol.grad_of(te))
            .fold(tol.grad, f64::max);
        (m, widest)
    }
}

/// The one-step comparison of a variant with the reference.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OneStep {
    pub loss: f64,
    pub loss_rel_err: f64,
    pub grad_rel_err_max: f64,
    pub grad_rel_err_median: f64,
    pub worst_tensor: String,
    /// Cosine similarity of the whole (concatenated) gradient with the reference's.
    pub cosine: f64,
    /// Share of non-finite gradient values (first attempt under fp16-mixed).
    pub nonfinite_share: f64,
    /// Loss scale the gradients were computed at (1 unless fp16-mixed).
    pub loss_scale: f64,
    /// |‖g‖ − ‖g_ref‖| / ‖g_ref‖ with ‖g‖ the norm the trainer reports (the one a clipping rule
    /// would use), unscaled by the trainer itself: at most ‖g − g_ref‖ / ‖g_ref‖, itself at most
    /// the largest per-tensor error, so it is held to the gradient tolerance plus
    /// [`OneStep::grad_norm_rounding`].
    pub grad_norm_rel_err: f64,
    /// N · 2^−53 (N: gradient values): the f64 summation error of the two norms themselves,
    /// summed in different orders (it matters only to fp64 variants, whose tolerance is ~1e-15).
    pub grad_norm_rounding: f64,
    pub per_tensor: Vec<TensorError>,
}

pub(super) fn summarize(
    loss: f64,
    reference_loss: f64,
    per_tensor: Vec<TensorError>,
    (dot, na, nb): (f64, f64, f64),
    nonfinite_share: f64,
    loss_scale: f64,
    (grad_norm, values): (f64, usize),
) -> OneStep {
    let mut sorted: Vec<f64> = per_tensor.iter().map(|t| t.rel_err).collect();
    sorted.sort_by(f64::total_cmp);
    let median = match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]),
    };
    let worst = per_tensor
        .iter()
        .max_by(|a, b| a.rel_err.total_cmp(&b.rel_err))
        .map(|t| (t.name.clone(), t.rel_err))
        .filter(|t| t.1 != 0.0)
        .unwrap_or_else(|| ("-".into(), 0.0));
    let cosine = if na > 0.0 && nb > 0.0 {
        dot / (na.sqrt() * nb.sqrt())
    } else {
        f64::NAN
    };
    OneStep {
        loss,
        loss_rel_err: scalar_rel(loss, reference_loss),
        grad_rel_err_max: worst.1,
        grad_rel_err_median: median,
        worst_tensor: worst.0,
        cosine,
        nonfinite_share,
        loss_scale,
        grad_norm_rel_err: scalar_rel(grad_norm, nb.sqrt()),
        grad_norm_rounding: values as f64 * f64::EPSILON / 2.0,
        per_tensor,
    }
}

/// The variant trains the reference's tensors, in its order, and the fault (if any) targets
/// one of them.
fn check_trained(names: &[String], reference: &Reference, fault: Option<&Fault>) -> Result<()> {
    if names.len() != reference.tensors.len()
        || names
            .iter()
            .zip(&reference.tensors)
            .any(|(a, (b, _))| a != b)
    {
        return Err(bad(
            "gradients",
            format!(
                "the variant trains {} tensors; the reference {}",
                names.len(),
                reference.tensors.len()
            ),
        ));
    }
    if let Some(f) = fault {
        let target = f.target();
        if !names.iter().any(|n| n == target) {
            return Err(bad("fault", format!("'{target}' is not a trained tensor")));
        }
    }
    Ok(())
}

/// The gradients of `names` on `batch` in `t`; under fp16-mixed a non-finite gradient halves
/// the loss scale and retries, as the dynamic loss scaler would (the overflowing step is
/// skipped in training). The loss and the non-finite share of the first attempt.
fn gradients_scaled(t: &mut Trainer, batch: &Batch, names: &[String]) -> Result<(f64, f64)> {
    let mut first_share = None;
    let mut attempts = 0;
    let loss = loop {
        attempts += 1;
        let loss = t.compute_gradients(batch)?;
        let (mut nonfinite, mut total) = (0usize, 0usize);
        for n in names {
            if let Some(g) = t.gradient(n)? {
                let v = to_f64(&g)?;
                total += v.len();
                nonfinite += v.iter().filter(|x| !x.is_finite()).count();
            }
        }
        first_share.get_or_insert(nonfinite as f64 / total.max(1) as f64);
        let scale = t.loss_scale().unwrap_or(1.0);
        if nonfinite == 0 || t.loss_scale().is_none() || scale <= 1.0 {
            break loss;
        }
        if attempts >= 40 {
            return Err(bad(
                "fp16 loss scale",
                "gradients stay non-finite down to a scale of 1",
            ));
        }
        t.set_loss_scale(scale / 2.0)?;
    };
    Ok((loss, first_share.unwrap_or(0.0)))
}

/// The variant's gradient of the tensor `name` (zeros of `shape` when none reached it), the
/// fault applied, with the reference's read into `r`; an error when their lengths differ.
fn gradient_pair(
    t: &Trainer,
    name: &str,
    shape: &[usize],
    fault: Option<&Fault>,
    rd: &mut super::store::Reader<'_>,
    r: &mut Vec<f64>,
) -> Result<Vec<f64>> {
    let mut g = match t.gradient(name)? {
        Some(g) => to_f64(&g)?,
        None => vec![0.0; shape.iter().product()],
    };
    if let Some(f) = fault {
        f.apply(name, &mut g);
    }
    rd.read_into(&format!("grad/{name}"), r)?;
    if g.len() != r.len() {
        return Err(bad(
            "gradients",
            format!(
                "'{name}' has {} values; the reference has {}",
                g.len(),
                r.len()
            ),
        ));
    }
    Ok(g)
}

/// One forward/backward of a variant on `step_batch(0)`, compared tensor by tensor with the
/// reference's gradients. Under fp16-mixed a non-finite gradient halves the loss scale and
/// retries, as the dynamic loss scaler would (the overflowing step is skipped in training); the
/// non-finite share reported is the first attempt's.
pub(super) fn one_step(
    spec: &Spec,
    fault: Option<&Fault>,
    opts: &VerifyOptions,
    reference: &Reference,
    rd: &mut super::store::Reader<'_>,
    h: &mut DefaultHasher,
) -> Result<OneStep> {
    let arch = ditmem_engine::families::Arch::of(spec)?;
    let mut t = Trainer::new(spec, opts.train())?;
    let names = t.trained_names();
    check_trained(&names, reference, fault)?;
    let batch = SyntheticData::new(spec, opts.data_seed)?.step_batch(0);
    let (loss, first_share) = gradients_scaled(&mut t, &batch, &names)?;
    let scale = t.loss_scale().unwrap_or(1.0);
    let compute = spec.recipe.precision.compute_dtype();
    // The underflow term is the policy's, at the scale its loss scaler holds (or starts from,
    // should the run have none: a missing scaler is a bug the term must not absorb).
    let policy_scale = match spec.recipe.precision {
        Precision::Fp16Mixed => t.loss_scale().unwrap_or(crate::optim::LossScaler::INITIAL),
        _ => 1.0,
    };
    // The rows a gradient sums over, at most (see super::terms::underflow_with_upstream).
    let d = Dims::new(spec)?;
    let rows = (spec.workload.microbatch as usize * (d.tokens + batch.text_tokens)) as u64;
    let grad_norm = t.gradient_norm()?;
    h.write_u64(loss.to_bits());
    let mut per_tensor = Vec::with_capacity(names.len());
    let (mut dot, mut na, mut nb) = (0.0, 0.0, 0.0);
    let mut r = Vec::new();
    let mut sibling = Vec::new();
    let mut values = 0usize;
    for (name, shape) in &reference.tensors {
        let g = gradient_pair(&t, name, shape, fault, rd, &mut r)?;
        hash_values(h, &g);
        values += g.len();
        let zero = ditmem_engine::families::zero_gradient(&arch, name);
        per_tensor.push(TensorError {
            name: name.clone(),
            // Made relative to the whole gradient below when zero in exact arithmetic.
            rel_err: if zero {
                diff_norm(&g, &r)
            } else {
                rel_err(&g, &r)
            },
            underflow: if zero {
                0.0
            } else {
                let per_head = shape.len() == 1 && shape[0] == d.head_dim;
                let n = rows * if per_head { d.heads as u64 } else { 1 };
                super::terms::underflow_with_upstream(&r, policy_scale, n, compute)
            },
            amplification: reference.amplification_of(name).max(if zero {
                1.0
            } else {
                super::key_bias::of(crate::families::of(&arch).key_bias_pairs(name), name, |n| {
                    rd.read_into(&format!("grad/{n}"), &mut sibling)?;
                    Ok(norm(&sibling))
                })?
            }),
            kink: reference.kink_of(name, compute),
            softmax: reference.softmax_amplification,
        });
        for (x, y) in g.iter().zip(&r) {
            dot += x * y;
            na += x * x;
            nb += y * y;
        }
    }
    // A gradient that is zero in exact arithmetic (a key bias: softmax ignores a shift of a
    // row's scores) holds only rounding noise, in the reference too: its error is judged as a
    // share of the whole reference gradient, ‖g − g_ref‖ / ‖g_ref,all‖.
    for te in per_tensor.iter_mut() {
        if ditmem_engine::families::zero_gradient(&arch, &te.name) {
            te.rel_err = ratio(te.rel_err, nb.sqrt());
        }
    }
    Ok(summarize(
        loss,
        reference.loss,
        per_tensor,
        (dot, na, nb),
        first_share,
        scale,
        (grad_norm, values),
    ))
}

/// The one-step comparison of `variant` of `base` with the reference (fault applied), without
/// the drift run.
pub fn check_one_step(
    base: &Spec,
    variant: &Variant,
    opts: &VerifyOptions,
    reference: &Reference,
) -> Result<OneStep> {
    let mut rd = reference.reader()?;
    one_step(
        &variant.apply(base),
        variant.fault.as_ref(),
        opts,
        reference,
        &mut rd,
        &mut DefaultHasher::new(),
    )
}

impl Tolerance {
    /// The gradient tolerance of one tensor: the policy's, multiplied by the cancellation its
    /// gradient comes out of and by the softmax's ([`Tolerance::softmax_factor`]), with its
    /// underflow and kink terms added in quadrature.
    pub fn grad_of(&self, te: &TensorError) -> f64 {
        (self.grad * te.amplification.max(1.0) * self.softmax_factor(te.softmax))
            .hypot(KAPPA_UNDERFLOW * te.underflow)
            .hypot(KAPPA_KINK * te.kink)
    }
}

impl Tolerance {
    /// The drift tolerance of a variant whose tensors' gradient tolerances are `one`'s: each
    /// tensor's divergence is held to κ_d × its own gradient tolerance in units of its own
    /// travel, so the whole divergence as a share of the whole travel to κ_d × the
    /// travel-weighted RMS of those tolerances, √(Σₜ shareₜ · (grad_of(t))²). The policy's
    /// [`Tolerance::drift`] where no tensor has a term of its own (or the shares are unknown).
    pub(crate) fn drift_of(&self, one: &OneStep, travel_shares: &[f64]) -> f64 {
        if travel_shares.len() != one.per_tensor.len() || self.grad <= 0.0 {
            return self.drift;
        }
        let mean_sq: f64 = one
            .per_tensor
            .iter()
            .zip(travel_shares)
            .map(|(te, s)| s * (self.grad_of(te) / self.grad).powi(2))
            .sum();
        self.drift * mean_sq.sqrt().max(1.0)
    }
}
