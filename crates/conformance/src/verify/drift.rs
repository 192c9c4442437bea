//! Drift over K optimizer steps against the reference's trajectory (module docs, 4.):
//! [`Drift`].

use super::error::bad;
use super::error::Result;
use super::metrics::{diff_sq, hash_values, norm_sq, ratio, scalar_rel, to_f64};

use super::reference::{Reference, VerifyOptions};
use super::roundoff::unit_roundoff;
use super::tolerance::DRIFT_GROWTH_FACTOR;
use crate::diffusion::SyntheticData;
use crate::trainer::Trainer;
use ditmem_budget::{Dtype, Spec};
use serde::Serialize;
use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;

/// Divergence of a variant's trajectory from the reference's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Drift {
    /// |ℓ_t − ℓ_ref,t| / |ℓ_ref,t| for t = 1..=K.
    pub loss_rel: Vec<f64>,
    /// ‖θ_t − θ_ref,t‖ / ‖θ_ref,t‖ for t = 0..=K.
    pub param_rel: Vec<f64>,
    /// ‖ema_t − ema_ref,t‖ / ‖ema_ref,t‖ for t = 0..=K (empty without an EMA).
    pub ema_rel: Vec<f64>,
    /// param_rel after the last step.
    pub final_rel: f64,
    /// ‖θ_ref,K − θ_ref,0‖ / ‖θ_ref,K‖: how far the reference moved in K steps.
    pub travel_rel: f64,
    /// final_rel / travel_rel = ‖θ_K − θ_ref,K‖ / ‖θ_ref,K − θ_ref,0‖: the divergence as a share
    /// of the distance trained, held to the drift tolerance ([`Tolerance::drift`]).
    pub vs_travel: f64,
    /// param_rel after the first step.
    pub one_step_rel: f64,
    /// DRIFT_GROWTH_FACTOR × K × one_step_rel.
    pub predicted_max: f64,
    /// The final divergence exceeds the prediction.
    pub grows_too_fast: bool,
    /// The first step t whose EMA divergence exceeds [`ema_bound`] (`None`: within it at every
    /// step, or no EMA).
    pub ema_exceeds_at: Option<usize>,
    /// Steps the fp16 loss scaler skipped.
    pub skipped_steps: u32,
    /// Each trained tensor's share of the reference's squared travel ‖θ_ref,K − θ_ref,0‖², in
    /// the reference's tensor order (empty: unknown, every tensor held to the policy's drift
    /// tolerance; see [`Tolerance::drift_of`]).
    #[serde(skip)]
    pub travel_shares: Vec<f64>,
}

/// The EMA rule: an EMA is a convex combination of the weights it has seen, so its divergence
/// from the reference's EMA cannot exceed the largest weight divergence so far (both EMAs
/// weight the same steps), plus the rounding of the shadow itself (f32: u(f32) per update,
/// counted 4× per step as a margin): `ema_rel[t] ≤ max_{s≤t} param_rel[s] + 4·(t+1)·u(f32)`.
pub(crate) fn ema_bound(param_rel: &[f64], t: usize) -> f64 {
    let max_so_far = param_rel[..=t.min(param_rel.len().saturating_sub(1))]
        .iter()
        .copied()
        .fold(0.0, f64::max);
    max_so_far + 4.0 * (t as f64 + 1.0) * unit_roundoff(Dtype::F32)
}

impl Drift {
    /// The drift of a trajectory from the per-step norms (`param_rel`, `ema_rel`: K + 1 values
    /// each, or `ema_rel` empty), the reference's travel ‖θ_ref,K − θ_ref,0‖ / ‖θ_ref,K‖ and the
    /// losses.
    pub fn from_norms(
        losses: &[f64],
        reference_losses: &[f64],
        param_rel: Vec<f64>,
        ema_rel: Vec<f64>,
        travel_rel: f64,
        skipped_steps: u32,
    ) -> Drift {
        let loss_rel: Vec<f64> = losses
            .iter()
            .zip(reference_losses)
            .map(|(&a, &b)| scalar_rel(a, b))
            .collect();
        let k = losses.len();
        let final_rel = param_rel.last().copied().unwrap_or(0.0);
        let one_step_rel = param_rel.get(1).copied().unwrap_or(final_rel);
        let predicted_max = DRIFT_GROWTH_FACTOR * k as f64 * one_step_rel;
        let ema_exceeds_at = ema_rel
            .iter()
            .enumerate()
            .find(|&(t, &e)| e.is_nan() || e > ema_bound(&param_rel, t))
            .map(|(t, _)| t);
        Drift {
            // NaN counts as too fast.
            grows_too_fast: k > 1
                && !matches!(
                    final_rel.partial_cmp(&predicted_max),
                    Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
                ),
            loss_rel,
            param_rel,
            ema_rel,
            final_rel,
            travel_rel,
            vs_travel: ratio(final_rel, travel_rel),
            one_step_rel,
            predicted_max,
            ema_exceeds_at,
            skipped_steps,
            travel_shares: Vec::new(),
        }
    }
}

/// ‖a − r‖² and ‖r‖² of the weights (or the EMA weights) of `t` after `step` steps against the
/// reference's, tensor by tensor.
///
/// With `travel`, also ‖θ_ref,step − θ_ref,0‖ / ‖θ_ref,step‖, how far the reference moved (its
/// initial weights read into the variant's buffer once it has been compared: no extra copy).
pub(super) fn state_norms(
    t: &Trainer,
    step: u32,
    reference: &Reference,
    rd: &mut super::store::Reader<'_>,
    h: &mut DefaultHasher,
    travel: bool,
) -> Result<(f64, Option<f64>, f64, Vec<f64>)> {
    let mut r = Vec::new();
    let (mut d2, mut n2, mut t2) = (0.0, 0.0, 0.0);
    let mut travel_sq = Vec::new();
    for (name, _) in &reference.tensors {
        let mut p = to_f64(&t.parameter(name)?)?;
        rd.read_into(&format!("param/{step}/{name}"), &mut r)?;
        if p.len() != r.len() {
            return Err(bad(
                "drift",
                format!("'{name}' has {} values; the reference {}", p.len(), r.len()),
            ));
        }
        hash_values(h, &p);
        d2 += diff_sq(&p, &r);
        n2 += norm_sq(&r);
        if travel {
            rd.read_into(&format!("param/0/{name}"), &mut p)?;
            let moved = diff_sq(&p, &r);
            t2 += moved;
            travel_sq.push(moved);
        }
    }
    let param = ratio(d2.sqrt(), n2.sqrt());
    let moved = ratio(t2.sqrt(), n2.sqrt());
    let ema = match (t.ema_parameters(), reference.ema) {
        (Some(e), true) => {
            let (mut d2, mut n2) = (0.0, 0.0);
            for (name, v) in e {
                let p = to_f64(&v)?;
                rd.read_into(&format!("ema/{step}/{name}"), &mut r)?;
                d2 += diff_sq(&p, &r);
                n2 += norm_sq(&r);
            }
            Some(ratio(d2.sqrt(), n2.sqrt()))
        }
        _ => None,
    };
    for x in travel_sq.iter_mut() {
        *x = ratio(*x, t2);
    }
    Ok((param, ema, moved, travel_sq))
}

/// K optimizer steps of a variant from the initial weights, each compared with the reference's
/// trajectory as it is taken.
pub(super) fn drift(
    spec: &Spec,
    opts: &VerifyOptions,
    reference: &Reference,
    rd: &mut super::store::Reader<'_>,
    h: &mut DefaultHasher,
    progress: &mut dyn FnMut(u32),
) -> Result<Drift> {
    let mut t = Trainer::new(spec, opts.train())?;
    let data = SyntheticData::new(spec, opts.data_seed)?;
    let mut param_rel = Vec::with_capacity(opts.steps as usize + 1);
    let mut ema_rel = Vec::new();
    let mut losses = Vec::with_capacity(opts.steps as usize);
    let mut skipped = 0;
    let (p, e, _, _) = state_norms(&t, 0, reference, rd, h, false)?;
    param_rel.push(p);
    ema_rel.extend(e);
    let (mut travel, mut shares) = (0.0, Vec::new());
    for i in 0..opts.steps {
        if i + 1 == opts.steps {
            // No step follows: the optimizer's state need not outlive this one (the update is
            // the same; see `plan_memory`).
            t.release_optimizer_state_after_next_step();
        }
        let r = t.step(&data.step_batch(u64::from(i)), None)?;
        skipped += u32::from(r.skipped);
        losses.push(r.loss);
        h.write_u64(r.loss.to_bits());
        let last = i + 1 == opts.steps;
        let (p, e, moved, s) = state_norms(&t, i + 1, reference, rd, h, last)?;
        param_rel.push(p);
        ema_rel.extend(e);
        if last {
            (travel, shares) = (moved, s);
        }
        progress(i + 1);
    }
    let mut d = Drift::from_norms(
        &losses,
        &reference.losses,
        param_rel,
        ema_rel,
        travel,
        skipped,
    );
    d.travel_shares = shares;
    Ok(d)
}

// ---------------------------------------------------------------------------------------------
// The verification.
