//! The `pytorch` step timeline: the three segments simulated under PyTorch's release rule and
//! one optimizer step replayed as the peer (`bench/torch_peer/peer.py`) runs it [CK][OPT] (the
//! rule sources are listed in the folder's `mod.rs`).

use serde::Serialize;

use crate::events::{laid_out_microbatches, Breakdown, Event, Events, Phase, StaticBytes};
use crate::params::{ParamRole, ParamTensor};
use crate::runtime::pytorch::allocator::{simulate, Live, SegCost};
use crate::runtime::pytorch::device::for_spec;
use crate::runtime::shape::Shape;
use crate::spec::{Optimizer, Precision, Prediction, Spec};

/// The three segments of a spec under PyTorch's rules.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Costs {
    pub embed: SegCost,
    pub block: SegCost,
    pub final_layer: SegCost,
}

pub fn costs(spec: &Spec) -> Costs {
    let rt = for_spec(spec);
    let dims = Shape::new(spec);
    let f = dims.precision.accum_dtype();
    let x_grad = dims.e() * f.size();
    let embed = rt.embed(&dims);
    let c = embed
        .ops
        .iter()
        .map(|o| o.output)
        .find(|&t| embed.tensors[t].name.starts_with("c = "))
        .map(|t| vec![t])
        .unwrap_or_default();
    let loss_grad = dims.precision.param_dtype().size();
    Costs {
        embed: simulate(&embed, x_grad, &c),
        block: simulate(&rt.block(&dims), x_grad, &[]),
        final_layer: simulate(&rt.final_layer(&dims), loss_grad, &[]),
    }
}

/// Transient bytes of the optimizer step over all trained tensors at once [OPT].
pub fn optimizer_scratch(trained_elems: u64, precision: Precision, optimizer: Optimizer) -> u64 {
    match optimizer {
        // `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`: a new state-sized list.
        Optimizer::AdamW | Optimizer::AdamW8bit => {
            trained_elems * precision.optimizer_dtype().size()
        }
        Optimizer::Sgd => 0,
    }
}

fn with(live: Breakdown, seg: Live) -> Breakdown {
    let mut b = live;
    b.activations += seg.activations;
    b.weight_casts += seg.weight_casts;
    b.workspace += seg.workspace;
    b.gradients += seg.gradients;
    b
}

/// Replay one optimizer step as the peer (`bench/torch_peer/peer.py`) runs it: per microbatch
/// the data, the forward under autocast (weight copies cached until it exits), the fp32 loss,
/// `loss.backward()` (each segment's graph released op by op, checkpointed blocks recomputed
/// first [CK]), then `optimizer.step()` [OPT], the EMA update and `zero_grad(set_to_none=True)`.
pub fn replay(
    spec: &Spec,
    table: &[ParamTensor],
    st: &StaticBytes,
    max_microbatches: u32,
) -> Vec<Event> {
    let c = costs(spec);
    let dims = Shape::new(spec);
    let r = &spec.recipe;
    let p = r.precision;
    let pd = p.param_dtype().size();
    let f = p.accum_dtype().size();
    let x_grad = dims.e() * f;
    let c_bytes = dims.b * dims.d * f;
    let trained: Vec<&ParamTensor> = table
        .iter()
        .filter(|t| t.role == ParamRole::Trained)
        .collect();
    let trained_elems: u64 = trained.iter().map(|t| t.numel()).sum();
    // AdamW keeps a 4-byte `step` tensor per parameter beside m and v (`state['step']`).
    let steps = if r.optimizer == Optimizer::Sgd {
        0
    } else {
        4 * trained.len() as u64
    };
    let base = Breakdown {
        weights: st.weights,
        master_weights: st.master_weights,
        optimizer_state: st.optimizer_state + steps,
        ema: st.ema,
        ..Breakdown::default()
    };
    let mut ev = Events::default();
    ev.push(Phase::Start, "step start".into(), None, 0, false, base);
    let mut live = base;
    let depth = spec.model.depth;
    let w = &spec.workload;
    for mb in 0..laid_out_microbatches(w.accumulation, max_microbatches) {
        let first = mb == 0;
        // x0, noise (the ε target), ᾱ_t, t and y (int64).
        let target = if r.prediction == Prediction::V {
            dims.latent * pd
        } else {
            0
        };
        let kept_data = dims.latent * pd + 8 * dims.b + target;
        live.data = kept_data + dims.latent * pd + dims.b * (pd + 8);
        // Forward.
        let mut cache = 0;
        let e = c.embed;
        ev.push(
            Phase::Forward,
            "embed (inside)".into(),
            None,
            mb,
            true,
            with(live, e.fwd_peak),
        );
        live.activations += e.kept.activations + e.output;
        live.weight_casts += e.kept.weight_casts;
        cache += e.cache_only;
        live.weight_casts += e.cache_only;
        ev.push(Phase::Forward, "embed".into(), None, mb, false, live);
        let b = c.block;
        for i in 0..depth {
            let ck = r.recompute.recomputes_block(i);
            let peak = if ck { b.ckpt_peak } else { b.fwd_peak };
            ev.push(
                Phase::Forward,
                format!("block {i} (inside)"),
                Some(i),
                mb,
                true,
                with(live, peak),
            );
            live.activations += b.output;
            if ck {
                cache += b.ckpt_cache;
                live.weight_casts += b.ckpt_cache;
            } else {
                live.activations += b.kept.activations;
                live.weight_casts += b.kept.weight_casts + b.cache_only;
                cache += b.cache_only;
            }
            ev.push(
                Phase::Forward,
                format!("block {i}"),
                Some(i),
                mb,
                false,
                live,
            );
        }
        let fl = c.final_layer;
        ev.push(
            Phase::Forward,
            "final + loss (inside)".into(),
            None,
            mb,
            true,
            with(live, fl.fwd_peak),
        );
        live.activations += fl.kept.activations + fl.output;
        live.weight_casts += fl.kept.weight_casts + fl.cache_only;
        cache += fl.cache_only;
        ev.push(Phase::Forward, "loss".into(), None, mb, false, live);
        // Autocast exits: copies only the cache held are freed; x0 and ᾱ go with the forward.
        live.weight_casts -= cache;
        live.data = kept_data;

        // Backward: the final layer, then blocks in reverse, then the embedder.
        let back = |live: &mut Breakdown, s: &SegCost, grad_in: u64| -> Breakdown {
            let mut at = *live;
            at.activations -= s.kept.activations;
            at.weight_casts -= s.kept.weight_casts;
            at.workspace -= grad_in;
            let mut peak = s.bwd_peak;
            if !first {
                // The new gradient is added into the existing `.grad` and freed.
                peak.workspace += peak.gradients;
                peak.gradients = 0;
            }
            with(at, peak)
        };
        let inside = back(&mut live, &fl, 0);
        ev.push(
            Phase::Backward,
            "final + loss (inside)".into(),
            None,
            mb,
            true,
            inside,
        );
        live.activations -= fl.kept.activations + fl.output + b.output;
        live.weight_casts -= fl.kept.weight_casts;
        live.workspace += x_grad + c_bytes;
        if first {
            live.gradients += fl.param_grads;
        }
        ev.push(
            Phase::Backward,
            "final + loss".into(),
            None,
            mb,
            false,
            live,
        );
        for i in (0..depth).rev() {
            let ck = r.recompute.recomputes_block(i);
            if ck {
                // Recompute under the same autocast state, with the incoming gradient alive.
                ev.push(
                    Phase::Backward,
                    format!("block {i} recompute (inside)"),
                    Some(i),
                    mb,
                    true,
                    with(live, b.fwd_peak),
                );
                live.activations += b.kept.activations;
                live.weight_casts += b.kept.weight_casts;
            }
            let inside = back(&mut live, &b, x_grad);
            ev.push(
                Phase::Backward,
                format!("block {i} (inside)"),
                Some(i),
                mb,
                true,
                inside,
            );
            live.activations -= b.kept.activations;
            live.weight_casts -= b.kept.weight_casts;
            // The block's input (the previous segment's output) is released with norm1's node.
            live.activations -= if i == 0 { e.output } else { b.output };
            if first {
                live.gradients += b.param_grads;
            }
            ev.push(
                Phase::Backward,
                format!("block {i}"),
                Some(i),
                mb,
                false,
                live,
            );
        }
        let inside = back(&mut live, &e, x_grad);
        ev.push(
            Phase::Backward,
            "embed (inside)".into(),
            None,
            mb,
            true,
            inside,
        );
        live.activations -= e.kept.activations;
        live.weight_casts -= e.kept.weight_casts;
        live.workspace -= x_grad + c_bytes;
        if first {
            live.gradients += e.param_grads;
        }
        live.data = 0;
        ev.push(Phase::Backward, "embed".into(), None, mb, false, live);
    }
    // Optimizer step, EMA, zero_grad.
    if trained_elems > 0 {
        let mut at = live;
        at.workspace += optimizer_scratch(trained_elems, p, r.optimizer);
        ev.push(
            Phase::Optimizer,
            format!("{} (inside)", r.optimizer.name()),
            None,
            0,
            true,
            at,
        );
        if r.ema.enabled && r.ema.dtype != p.param_dtype() {
            // `p.detach().to(ema dtype)` for every parameter before the foreach update.
            let mut at = live;
            at.workspace += trained_elems * r.ema.dtype.size();
            ev.push(Phase::Optimizer, "ema (inside)".into(), None, 0, true, at);
        }
    }
    live.gradients = 0;
    ev.push(Phase::Optimizer, "step end".into(), None, 0, false, live);
    ev.0
}
