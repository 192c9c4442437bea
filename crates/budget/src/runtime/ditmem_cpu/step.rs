//! The `ditmem-cpu` step timeline: a replay of `ditmem-engine`'s `Trainer::step` over the candle
//! graphs of [`super::segments`] (twin: the engine's `trainer.rs`).
//!
//! The replay follows the engine's code path: the microbatch slice of the batch (under
//! accumulation only: one microbatch runs on the batch itself), the embed segment (kept to the
//! end of backward), each block on a leaf copy of its input (stored) or on
//! its input without tracking (recomputed), the final layer on a leaf copy, then backward through
//! the final layer's loss and each block from its output gradient (the seed of
//! `ops::backward_from`), the gradient buffers (moved out of the gradient store, or out of the
//! linears' gradient sinks, on the first microbatch, summed on later ones), and the optimizer
//! step: the gradient norm, AdamW's temporaries, the EMA update. Every event is a point
//! the engine's recorder marks (`inside: false`) or the worst moment between two marks.

use crate::events::{laid_out_microbatches, Breakdown, Event, Events, Phase, StaticBytes};
use crate::params::{Module, ParamRole, ParamTensor};
use crate::runtime::costs::{SegSim, Sims};
use crate::runtime::ditmem_cpu::dtypes::grad_dtype;
use crate::runtime::ditmem_cpu::graph::{STORAGE_META, TENSOR_META};
use crate::runtime::ditmem_cpu::ops::SQUARES_CHUNK;
use crate::runtime::shape::{is_embed, is_final};
use crate::spec::{CpuSpec, Dtype, Latents, Optimizer, Precision, Spec};

/// Packing buffers the `gemm` crate under candle keeps after the first matmuls: one slab of the
/// L2 size per core per thread of the pool (`gemm_common::gemm::L2_SLAB`, a thread-local of
/// `CACHE_INFO[1].cache_bytes`; the step runs on a pool worker, so every thread that calls or
/// helps a matmul is one). Measured with the counting allocator: 1 MiB per thread with 1, 2 and
/// 4 threads on an AMD EPYC (1 MiB L2), and 2 MiB more for 2 threads with the sysfs cache sizes
/// of an Intel Xeon (2 MiB L2). Both numbers come from the spec's `cpu` section. None when the
/// step makes no `gemm` product (see [`step_uses_gemm`]).
pub fn gemm_workspace_bytes(cpu: &CpuSpec) -> u64 {
    u64::from(cpu.threads.max(1)) * cpu.gemm_l2_bytes
}

/// Whether a step of `spec` multiplies through candle's `gemm` crate: f32/f64 products, bf16 or
/// f16 products widened to f32 (no AVX512-BF16 kernel, or f16), and LoRA adapters (composed
/// candle matmuls). bf16 linears and attention on the engine's kernel make none.
pub fn step_uses_gemm(spec: &Spec) -> bool {
    if super::registry::rules(spec).is_some_and(|r| r.step_uses_gemm()) {
        return true;
    }
    let bf16_native =
        spec.recipe.precision.compute_dtype() == Dtype::Bf16 && spec.cpu().bf16_kernel();
    !bf16_native || spec.recipe.lora.is_some()
}

/// A recipe setting the engine does not execute: the field as set, what it is in a few words,
/// and what to use instead.
pub struct NotExecuted {
    pub field: String,
    pub what: &'static str,
    pub instead: &'static str,
}

/// The recipe settings of `spec` the engine does not execute, in the order it checks them: one
/// list for the engine, which refuses the first (`Trainer::new`), and the planner, which says a
/// plan holding any cannot be run by `ditmem run` (the budget still counts them).
pub fn not_executed(spec: &Spec) -> Vec<NotExecuted> {
    let r = &spec.recipe;
    let unless = |holds: bool, field: String, what, instead| {
        holds.then_some(NotExecuted {
            field,
            what,
            instead,
        })
    };
    [
        unless(
            r.zero_stage > 0,
            format!("recipe.zero_stage = {}", r.zero_stage),
            "ZeRO",
            "the engine executes one rank without sharding; use zero_stage = 0",
        ),
        unless(
            r.latents != Latents::Cached,
            "recipe.latents = encode".into(),
            "VAE encoder",
            "the engine has no VAE encoder; use latents = cached",
        ),
        unless(
            !r.base_quant.is_none(),
            format!("recipe.base_quant = {}", r.base_quant.name()),
            "quantized base",
            "the engine keeps a LoRA's frozen base in the compute dtype (a quantized base is the \
             pytorch runtime's: bitsandbytes NF4 / int8, diffusers' fp8 layerwise casting); use \
             base_quant = none",
        ),
        unless(
            !r.text_encoders.is_cached(),
            format!("recipe.text_encoders = {}", r.text_encoders.name()),
            "text encoders",
            "the engine has no text encoders (it trains on caption embeddings); use \
             text_encoders = cached",
        ),
        unless(
            r.optimizer == Optimizer::AdamW8bit,
            "recipe.optimizer = adamw-8bit".into(),
            "8-bit AdamW",
            "8-bit AdamW is not implemented by the engine; use adamw or sgd",
        ),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// Bytes of one trained tensor's optimizer update temporaries in the engine (`optim.rs`).
fn optimizer_peak(elems: u64, p: Precision, opt: Optimizer, scaled: bool) -> u64 {
    let sd = p.optimizer_dtype().size();
    let pd = p.param_dtype().size();
    let gd = grad_dtype(p).size();
    let cast_in = if pd != sd { elems * sd } else { 0 };
    let unscale = if scaled { elems * sd } else { 0 };
    let g_cast = if gd != sd { elems * sd } else { 0 };
    match opt {
        // The engine's AdamW updates m, v and the weight in place in one pass (`optim.rs`,
        // a candle in-place op): only a gradient cast, when the gradient dtype
        // differs from the state's, allocates.
        Optimizer::AdamW | Optimizer::AdamW8bit => g_cast,
        Optimizer::Sgd => {
            g_cast + unscale + cast_in + 2 * elems * sd + if pd != sd { elems * pd } else { 0 }
        }
    }
}

/// Replay one optimizer step of the engine.
pub(crate) fn replay(
    spec: &Spec,
    table: &[ParamTensor],
    st: &StaticBytes,
    sims: &Sims,
    max_microbatches: u32,
) -> Vec<Event> {
    let w = &spec.workload;
    let per_step = u64::from(w.microbatch) * u64::from(w.accumulation);
    let base = Breakdown {
        weights: st.weights,
        master_weights: st.master_weights,
        optimizer_state: st.optimizer_state,
        ema: st.ema,
        data: batch_bytes(spec, per_step),
        runtime: if step_uses_gemm(spec) {
            gemm_workspace_bytes(&spec.cpu())
        } else {
            0
        },
        ..Breakdown::default()
    };
    let mut rp = Replay::new(spec, table, sims);
    rp.ev
        .push(Phase::Start, "step start".into(), None, 0, false, base);
    let mut live = base;
    let slice = microbatch_slice_bytes(spec);
    for mb in 0..laid_out_microbatches(w.accumulation, max_microbatches) {
        live.data += slice;
        rp.forward(&mut live, mb);
        rp.backward(&mut live, mb);
        live.data -= slice;
    }
    rp.optimizer(&mut live, table, base.runtime);
    rp.ev.0
}

/// Bytes of the microbatch slice the engine copies out of the step's batch while it runs the
/// microbatch (`Trainer::forward_backward`, `Batch::slice`): none with one microbatch, which
/// runs on the batch itself.
fn microbatch_slice_bytes(spec: &Spec) -> u64 {
    let w = &spec.workload;
    if w.accumulation > 1 {
        batch_bytes(spec, u64::from(w.microbatch))
    } else {
        0
    }
}

/// Bytes of a `Batch` of `n` samples: latents and noise in f64, timesteps and labels u32,
/// label-drop flags.
fn batch_bytes(spec: &Spec, n: u64) -> u64 {
    let lat_per_sample = u64::from(spec.model.in_channels)
        * (spec.tokens().unwrap_or(0))
        * u64::from(spec.model.patch)
        * u64::from(spec.model.patch);
    // A family's cached text embeddings (n, T, width) in f64.
    let text = super::registry::rules(spec).map_or(0, |r| r.text_elems());
    n * (2 * lat_per_sample * 8 + text * 8 + 4 + 4 + 1)
}

/// The gradients one segment lands in the buffers.
#[derive(Debug, Clone, Copy)]
struct Landing {
    /// A landed gradient is a tensor of its own: its buffer (`gradients`) and candle's
    /// bookkeeping for it (`runtime`), as (buffer bytes, bookkeeping bytes).
    grads: (u64, u64),
    /// The largest of them (the transient of summing it into an existing buffer).
    largest: u64,
    /// The largest gradient the segment adds into a buffer an earlier segment of the same
    /// microbatch landed (diffusers' DiT: block 0's embedder, read again by the embed,
    /// [`super::dit_diffusers::summed_by_embed`]); 0 for none.
    summed: u64,
    /// Cast-on-landing (bf16-pure), first microbatch: (bytes above the state after the last
    /// cast, sunk bytes of the store freed by then) at the landing's worst moment
    /// ([`cast_adjust`]).
    cast: (u64, u64),
}

/// Whether the engine takes `t`'s gradient out of a linear's gradient sink (`Trainer::sinks`,
/// `ops::GradSink`) rather than out of candle's gradient store: a trained linear's weight and
/// bias go to the sink when the linear's input tracks (`LinearW::forward`; budget twin
/// `block::linear_weights`). Not linears: the embedding tables, the modulation tables
/// (`scale_shift_table`) and the norms' affine weights. An embedder's first linear (the patch
/// embedding, `linear_1`, `mlp.0`, a context embedder) reads data that does not track, so its
/// gradients stay in the store; of an embedder's linears only those reading another
/// linear's output are taken as sunk (`linear_2`, `mlp.2`, PixArt's `adaln_single.linear`,
/// Sana's `time_embed.linear`, Wan's `condition_embedder.time_proj`);
/// any other is left in the store, which can only overstate the landing.
fn sunk(t: &ParamTensor, table: &[ParamTensor]) -> bool {
    let not_linear = |n: &str| {
        n.contains("embedding_table")
            || n.ends_with("scale_shift_table")
            || n.rsplit('.').nth(1).is_some_and(|m| m.starts_with("norm"))
    };
    let module = |n: &str| {
        n.rsplit_once('.')
            .map_or(String::new(), |(m, _)| m.to_string())
    };
    let linear_weight =
        |n: &str| !not_linear(n) && table.iter().any(|o| o.name == n && o.shape.len() >= 2);
    let m = module(&t.name);
    // The tensor is a linear's weight or bias: `m.weight` is a 2-D (or conv) tensor.
    if !linear_weight(&format!("{m}.weight")) {
        return false;
    }
    let in_embedder = is_embed(t) || m.contains("embedder") || m.contains(".emb.");
    !in_embedder
        || m.ends_with("linear_2")
        || m.ends_with("mlp.2")
        || m.ends_with("adaln_single.linear")
        || m.ends_with("time_embed.linear")
        || m.ends_with("condition_embedder.time_proj")
}

/// Cast-on-landing (bf16-pure), first microbatch: `Trainer::accumulate` casts the segment's
/// gradients into f32 one by one in its order (the linears' forward order, weight then bias:
/// `model.rs` `BLOCK_LINEARS` puts the original DiT's `adaLN_modulation` first, where the
/// parameter table puts it last; diffusers' DiT sums block 0's embedder first, its class table
/// leading, `families/dit_diffusers/step.rs` `embed_params`; the other families' tables are taken in
/// their own order, measured for PixArt only). A sunk gradient (in a linear's `GradSink`,
/// [`sunk`]) is freed as soon as `cast` has consumed it; one in candle's store stays until
/// `drop(grads)`. A new buffer (`g` bytes) is made while its sunk gradient (`h`, 0 in the
/// store) is alive: `h` above the state after it; a summed one (`summed(t)`: `old + g`) holds
/// `old` and the cast `g` beside the new sum: `2g` above it. Returns the landing's worst moment
/// against the state after the last cast (the store's sunk gradients all freed), as (bytes
/// above it, sunk bytes freed by then): the event holds the store less the second, plus the
/// first. Measured with the counting allocator (DiT-S/2 depth 1 64², bf16-pure: 5,320,166 B of
/// sunk bf16 gradients gone from the store between `backward_from` and the end of
/// `accumulate`, the f32 buffers 10,639,872 B; `compare` at DiT-XL/2, diffusers' DiT-XL/2 and
/// PixArt-Σ widths within 0.001 %, bench/verify/runs/2026-12-06-epyc-dit-diffusers/).
fn cast_adjust(
    table: &[ParamTensor],
    f: &dyn Fn(&ParamTensor) -> bool,
    summed: &dyn Fn(&ParamTensor) -> bool,
    gd: u64,
    pd: u64,
) -> (u64, u64) {
    let meta = TENSOR_META + STORAGE_META;
    let mut ts: Vec<&ParamTensor> = table
        .iter()
        .filter(|t| t.role == ParamRole::Trained && (f(t) || summed(t)))
        .collect();
    ts.sort_by_key(|t| {
        (
            !summed(t),
            !(summed(t) && t.name.contains("embedding_table")),
            !(t.block.is_some() && t.name.contains("adaLN_modulation")),
        )
    });
    // (new buffer bytes, sunk bytes, summed)
    let items: Vec<(u64, u64, bool)> = ts
        .iter()
        .map(|t| {
            let h = if sunk(t, table) {
                t.numel() * pd + meta
            } else {
                0
            };
            (t.numel() * gd + meta, h, summed(t))
        })
        .collect();
    let sunk_total: u64 = items.iter().map(|&(_, h, _)| h).sum();
    // Walk from the last cast back; `later` = the live bytes the casts after k still add.
    let (mut later, mut excess) = (0i128, 0i128);
    for &(g, h, s) in items.iter().rev() {
        let (g, h) = (i128::from(g), i128::from(h));
        let above = if s { 2 * g } else { h };
        excess = excess.max(above - later);
        later += if s { -h } else { g - h };
    }
    (u64::try_from(excess).unwrap_or(0), sunk_total)
}

impl Landing {
    fn of(table: &[ParamTensor], gd: u64, pd: u64, f: &dyn Fn(&ParamTensor) -> bool) -> Landing {
        let trained = || {
            table
                .iter()
                .filter(|t| t.role == ParamRole::Trained && f(t))
        };
        Landing {
            grads: trained().fold((0, 0), |(b, m), t| {
                (b + t.numel() * gd, m + TENSOR_META + STORAGE_META)
            }),
            largest: trained().map(|t| t.numel() * gd).max().unwrap_or(0),
            summed: 0,
            cast: cast_adjust(table, f, &|_| false, gd, pd),
        }
    }
}

/// The state of one replay: the spec's segments, what each segment lands, and the events so far.
struct Replay<'a> {
    spec: &'a Spec,
    sims: &'a Sims,
    ev: Events,
    /// The conditioning leaves' gradients with candle's bookkeeping ([`Sims::cond_grad`]).
    bd: u64,
    /// Weights stored in another dtype than the gradient buffers (bf16-pure): the first
    /// microbatch's gradients are cast into new buffers while the store still holds the
    /// originals, instead of being moved.
    cast_on_landing: bool,
    /// Ranks a landed gradient is reduce-scattered over (ZeRO-2/3, FSDP2: the rank keeps its
    /// share, `crate::sharding`); 1 otherwise.
    grad_share: u64,
    block: Landing,
    /// The last block's landing when its weights differ ([`Sims::last_block`]).
    last_block: Landing,
    /// The second kind of block's landing ([`Sims::second`]: Flux's single-stream blocks).
    second: Landing,
    /// Which blocks are SD3.5's dual-attention blocks ([`Sims::dual`]; empty without them),
    /// and the landing of one that is not the last.
    dual: Vec<bool>,
    dual_landing: Landing,
    final_layer: Landing,
    embed: Landing,
}

impl<'a> Replay<'a> {
    fn new(spec: &'a Spec, table: &[ParamTensor], sims: &'a Sims) -> Replay<'a> {
        let p = spec.recipe.precision;
        let gd = grad_dtype(p).size();
        let pd = p.param_dtype().size();
        let depth = spec.model.depth;
        let rules = super::registry::rules(spec);
        let summed = |t: &ParamTensor| rules.as_ref().is_some_and(|r| r.summed_by_embed(t));
        let dual: Vec<bool> = match sims.dual {
            Some(_) => {
                let d = rules.as_ref().map_or_else(Vec::new, |r| r.dual_blocks());
                (0..u64::from(depth))
                    .map(|i| d.binary_search(&i).is_ok())
                    .collect()
            }
            None => Vec::new(),
        };
        // The first block of each kind that is not the last (its tensors' gradients land as
        // every such block's do).
        let first = |want: bool| {
            (0..depth.saturating_sub(1))
                .find(|&i| dual.get(i as usize).copied().unwrap_or(false) == want)
                .unwrap_or(0)
        };
        let (plain, first_dual) = (first(false), first(true));
        Replay {
            spec,
            sims,
            ev: Events::default(),
            bd: sims.cond_grad,
            cast_on_landing: p.param_dtype() != grad_dtype(p),
            grad_share: if crate::sharding::Scheme::of(spec).shards_gradients() {
                u64::from(spec.workload.ranks)
            } else {
                1
            },
            block: Landing::of(table, gd, pd, &|t| {
                t.block == Some(plain) && t.module != Module::SingleBlocks
            }),
            last_block: match sims.last_block {
                Some(_) => {
                    let last = spec.model.depth.saturating_sub(1);
                    Landing::of(table, gd, pd, &|t| t.block == Some(last))
                }
                None => Landing::of(table, gd, pd, &|t| t.block == Some(0)),
            },
            second: Landing::of(table, gd, pd, &|t| {
                t.block == Some(0) && t.module == Module::SingleBlocks
            }),
            final_layer: Landing::of(table, gd, pd, &is_final),
            embed: Landing {
                summed: Landing::of(table, gd, pd, &summed).largest,
                cast: cast_adjust(table, &is_embed, &summed, gd, pd),
                ..Landing::of(table, gd, pd, &is_embed)
            },
            dual_landing: Landing::of(table, gd, pd, &|t| t.block == Some(first_dual)),
            dual,
        }
    }

    fn recomputed(&self, i: u32) -> bool {
        self.spec.recipe.recompute.recomputes_block(i)
    }

    /// The simulation of block `i`: of the first kind, of [`Sims::second`] (Flux's
    /// single-stream blocks), or [`Sims::last_block`] (SD3's `context_pre_only` block).
    fn seg_of(&self, i: u32) -> &'a SegSim {
        let sims: &'a Sims = self.sims;
        if let (Some(d), true) = (&sims.dual, self.is_dual(i)) {
            return if i + 1 == self.spec.model.depth {
                &d.last
            } else {
                &d.block
            };
        }
        match (&sims.second, &sims.last_block) {
            (Some(k), _) if i == k.start => &k.first,
            (Some(k), _) if i > k.start => &k.rest,
            (_, Some(l)) if i + 1 == self.spec.model.depth => l,
            _ => &sims.block,
        }
    }

    /// Data bytes of the streams segment `i` (`depth`: the final layer) reads that the family
    /// schedule releases once copied into its leaves (`release_streams`): when `i` is stored
    /// and its input is the embed's streams or a stored block's outputs (a recomputed block's
    /// output is freed whole once copied).
    fn released_input(&self, i: u32) -> u64 {
        let depth = self.spec.model.depth;
        if !self.sims.streams_once || (i < depth && self.recomputed(i)) {
            0
        } else if i == 0 {
            self.sims.embed.output_data
        } else if !self.recomputed(i - 1) {
            self.seg_of(i - 1).output_data
        } else {
            0
        }
    }

    /// Whether block `i` is one of SD3.5's dual-attention blocks.
    fn is_dual(&self, i: u32) -> bool {
        self.dual.get(i as usize).copied().unwrap_or(false)
    }

    /// The landing of block `i`'s gradients.
    fn landing_of(&self, i: u32) -> Landing {
        if self.is_dual(i) && i + 1 != self.spec.model.depth {
            return self.dual_landing;
        }
        match (&self.sims.second, &self.sims.last_block) {
            (Some(k), _) if i >= k.start => self.second,
            (_, Some(_)) if i + 1 == self.spec.model.depth => self.last_block,
            _ => self.block,
        }
    }

    /// Bytes of the streams block `i` reads (`depth`: the final layer), i.e. block i − 1's
    /// outputs; with a second kind of block, the reader's leaf copies of them.
    fn input_bytes(&self, i: u32) -> u64 {
        match &self.sims.second {
            Some(_) if i >= self.spec.model.depth => self.sims.final_layer.leaf,
            Some(_) => self.seg_of(i).leaf,
            None => self.seg_of(i.saturating_sub(1)).output,
        }
    }

    /// An event of microbatch `mb`, its label prefixed by the microbatch under accumulation.
    fn mark(
        &mut self,
        phase: Phase,
        what: String,
        block: Option<u32>,
        mb: u32,
        inside: bool,
        live: Breakdown,
    ) {
        let label = if self.spec.workload.accumulation > 1 {
            format!("microbatch {mb}: {what}")
        } else {
            what
        };
        self.ev.push(phase, label, block, mb, inside, live);
    }

    /// The moment inside a segment's backward (`seg`'s): its root and backward peak on top of
    /// `live`, less what its backward frees of the forward's state.
    fn mark_backward(
        &mut self,
        live: &Breakdown,
        seg: &SegSim,
        what: String,
        block: Option<u32>,
        mb: u32,
    ) {
        let mut inside = *live;
        inside.workspace += seg.root + seg.bwd_peak;
        inside.activations -= seg.bwd_released;
        self.mark(Phase::Backward, what, block, mb, true, inside);
    }

    /// Lands a segment's gradients in the buffers; returns the extra transient of the moment
    /// worth an event (summing into existing buffers, or the first casts), if any.
    fn land(&self, live: &mut Breakdown, first: bool, l: Landing) -> Option<u64> {
        if first {
            live.gradients += l.grads.0.div_ceil(self.grad_share);
            live.runtime += l.grads.1;
            if l.summed > 0 {
                // `Trainer::accumulate` sums these first (`DitdLayout::embed_params`), each
                // `old + cast(g)` (the cast a copy of its own when the store's gradient is in
                // the weights' dtype: bf16-pure), before it moves (or casts) the segment's
                // own gradients, which `live` holds already.
                let sum = l.summed * if self.cast_on_landing { 2 } else { 1 };
                return Some(sum.saturating_sub(l.grads.0.div_ceil(self.grad_share)));
            }
            self.cast_on_landing.then_some(0)
        } else {
            Some(l.largest.max(l.summed))
        }
    }

    /// The landing of a segment's gradients as an event of its own, when it is worth one.
    fn land_event(
        &mut self,
        live: &mut Breakdown,
        mb: u32,
        l: Landing,
        what: String,
        block: Option<u32>,
    ) {
        if let Some(t) = self.land(live, mb == 0, l) {
            let mut inside = *live;
            inside.workspace += t;
            if mb == 0 && self.cast_on_landing && self.spec.recipe.lora.is_none() {
                // In place of `land`'s summing transient: the casts' own worst moment.
                inside.workspace = (inside.workspace + l.cast.0).saturating_sub(t + l.cast.1);
            }
            self.mark(Phase::Backward, what, block, mb, true, inside);
        }
    }

    /// Forward of microbatch `mb`: the embed segment, each block (stored on a leaf copy, or
    /// recomputed without tracking), the final layer and the loss.
    fn forward(&mut self, live: &mut Breakdown, mb: u32) {
        let sims = self.sims;
        let depth = self.spec.model.depth;

        // Embed.
        let es = &sims.embed;
        let mut inside = *live;
        inside.data += sims.embed_scratch;
        inside.activations += es.fwd_peak;
        self.mark(
            Phase::Forward,
            "embed (inside)".into(),
            None,
            mb,
            true,
            inside,
        );
        live.activations += es.activations + es.output + sims.c_leaf;
        live.weight_casts += es.weight_casts;
        self.mark(Phase::Forward, "embed".into(), None, mb, false, *live);

        // Blocks.
        for i in 0..depth {
            let bs = self.seg_of(i);
            let block_kept = bs.activations + bs.leaf + bs.output;
            let mut inside = *live;
            if self.recomputed(i) {
                inside.activations += bs.untracked_peak;
                live.activations += bs.output;
            } else {
                // The leaf copy first, then the input streams released, then the block.
                let released = self.released_input(i);
                inside.activations += bs.fwd_peak.saturating_sub(released).max(bs.leaf);
                live.activations += block_kept - released;
                live.weight_casts += bs.weight_casts;
                if i > 0 && self.recomputed(i - 1) {
                    // The recomputed block's output was only this block's input: copied, freed.
                    live.activations -= self.input_bytes(i);
                }
            }
            let what = format!("block {i} (inside)");
            self.mark(Phase::Forward, what, Some(i), mb, true, inside);
            self.mark(
                Phase::Forward,
                format!("block {i}"),
                Some(i),
                mb,
                false,
                *live,
            );
        }

        // Final layer + loss.
        let fs = &sims.final_layer;
        let mut inside = *live;
        let released = self.released_input(depth);
        inside.activations += fs.fwd_peak.saturating_sub(released).max(fs.leaf);
        live.activations += fs.activations + fs.leaf - released;
        live.weight_casts += fs.weight_casts;
        if depth > 0 && self.recomputed(depth - 1) {
            live.activations -= self.input_bytes(depth);
        }
        self.mark(
            Phase::Forward,
            "final (inside)".into(),
            None,
            mb,
            true,
            inside,
        );
        self.mark(Phase::Forward, "final".into(), None, mb, false, *live);
    }

    /// Backward of microbatch `mb`: the loss, each block from its output gradient (rebuilt
    /// first when recomputed), the embed segment; each lands its gradients in the buffers.
    fn backward(&mut self, live: &mut Breakdown, mb: u32) {
        let sims = self.sims;
        let fs = &sims.final_layer;

        // Backward of the loss.
        self.mark_backward(live, fs, "final (inside)".into(), None, mb);
        // Store left: leaf grad (gx), c grad, weight grads, other leftovers.
        live.workspace += fs.bwd_store;
        live.activations -= fs.activations + fs.leaf;
        live.weight_casts -= fs.weight_casts;
        let what = "final grads (inside)".into();
        self.land_event(live, mb, self.final_layer, what, None);
        // drop(grads): what remains is gx (the leaf's grad) and gc.
        live.workspace -= fs.bwd_store;
        live.workspace += fs.bwd_leaf_grads + self.bd;
        self.mark(Phase::Backward, "final".into(), None, mb, false, *live);

        let gx_bytes = self.backward_blocks(live, mb, fs.bwd_leaf_grads);

        // Embed backward: gx and the conditioning's gradients move into its seeds.
        let es = &sims.embed;
        live.workspace -= gx_bytes + self.bd;
        self.mark_backward(live, es, "embed (inside)".into(), None, mb);
        live.workspace += es.bwd_store;
        let what = "embed grads (inside)".into();
        self.land_event(live, mb, self.embed, what, None);
        // x0, c, gx and gc are dropped; the other locals of `microbatch` (patches, timestep
        // features, t_emb, y_emb and what they still hold) and the microbatch slice (if any)
        // live until the function returns, just after this mark.
        live.workspace -= es.bwd_store;
        live.activations -= es.activations + es.output + sims.c_leaf - self.released_input(0);
        live.weight_casts -= es.weight_casts;
        live.activations += sims.embed_tail.0;
        live.weight_casts += sims.embed_tail.1;
        self.mark(Phase::Backward, "embed".into(), None, mb, false, *live);
        live.activations -= sims.embed_tail.0;
        live.weight_casts -= sims.embed_tail.1;
    }

    /// Backward through the blocks, last first, from the final layer's input gradient of
    /// `gx_bytes`; returns the bytes of the gradient left for the embed segment.
    fn backward_blocks(&mut self, live: &mut Breakdown, mb: u32, mut gx_bytes: u64) -> u64 {
        for i in (0..self.spec.model.depth).rev() {
            let bs = self.seg_of(i);
            let e = self.input_bytes(i);
            if self.recomputed(i) {
                // Leaf copy of the saved input; the input is freed unless the previous block's
                // stored output (or x0) still holds it.
                live.activations += bs.leaf;
                let input_held = i == 0 || !self.recomputed(i - 1);
                if !input_held {
                    live.activations -= e;
                }
                let mut inside = *live;
                inside.activations += bs.fwd_peak - bs.leaf;
                let what = format!("block {i} recompute (inside)");
                self.mark(Phase::Backward, what, Some(i), mb, true, inside);
                live.activations += bs.activations + bs.output;
                live.weight_casts += bs.weight_casts;
            }
            // gx moves into the block's seed (`ops::backward_from`), which frees it once it
            // reaches the output's entry: the segment's backward counts it from here.
            live.workspace -= gx_bytes;
            self.mark_backward(live, bs, format!("block {i} (inside)"), Some(i), mb);
            // After backward: the store; drop(out) frees the graph and the output.
            live.workspace += bs.bwd_store;
            // The output's data went in the forward when its reader was stored.
            live.activations -= bs.activations + bs.output - self.released_input(i + 1);
            live.weight_casts -= bs.weight_casts;
            let what = format!("block {i} grads (inside)");
            self.land_event(live, mb, self.landing_of(i), what, Some(i));
            // gx is the leaf's grad now; drop(grads); drop(leaf).
            live.workspace -= bs.bwd_store;
            live.workspace += bs.bwd_leaf_grads;
            gx_bytes = bs.bwd_leaf_grads;
            live.activations -= bs.leaf;
            let what = format!("block {i}");
            self.mark(Phase::Backward, what, Some(i), mb, false, *live);
        }
        gx_bytes
    }

    /// Optimizer: gradient norm, the update, the EMA (in place, no moment of its own); the
    /// gradient buffers are dropped after it.
    fn optimizer(&mut self, live: &mut Breakdown, table: &[ParamTensor], runtime: u64) {
        let r = &self.spec.recipe;
        let p = r.precision;
        let trained: Vec<u64> = table
            .iter()
            .filter(|t| t.role == ParamRole::Trained)
            .map(ParamTensor::numel)
            .collect();
        let largest = trained.iter().copied().max().unwrap_or(0);
        if largest > 0 {
            // `ops::sum_squares`: one f64 partial sum per chunk of the largest gradient.
            let mut inside = *live;
            inside.workspace += largest.div_ceil(SQUARES_CHUNK) * 8;
            self.ev.push(
                Phase::Optimizer,
                "gradient norm (inside)".into(),
                None,
                0,
                true,
                inside,
            );
            let scaled = p == Precision::Fp16Mixed;
            let mut inside = *live;
            inside.workspace += optimizer_peak(largest, p, r.optimizer, scaled);
            self.ev.push(
                Phase::Optimizer,
                format!("{} (inside)", r.optimizer.name()),
                None,
                0,
                true,
                inside,
            );
            // The EMA update runs in place (`optim.rs`): no moment of its own.
        }
        live.gradients = 0;
        live.runtime = runtime;
        self.ev
            .push(Phase::Optimizer, "optimizer".into(), None, 0, false, *live);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Live data bytes at the end of the first microbatch's embed and at the step start.
    fn data_at_embed(spec: &Spec) -> (u64, u64) {
        let b = crate::estimate(spec).unwrap();
        let ev = &b.timeline.events;
        let embed = ev
            .iter()
            .find(|e| !e.inside && e.label.ends_with("embed"))
            .unwrap();
        (ev[0].live.data, embed.live.data)
    }

    /// One microbatch runs on the step's batch: no slice of it is laid out. Under accumulation
    /// each microbatch is a copy of its samples while it runs.
    #[test]
    fn only_accumulation_lays_out_a_microbatch_slice() {
        let mut spec = Spec::small();
        spec.workload.microbatch = 2;
        spec.workload.batch = 2;
        spec.workload.accumulation = 1;
        let (start, embed) = data_at_embed(&spec);
        assert_eq!(start, batch_bytes(&spec, 2));
        assert_eq!(embed, start);
        spec.workload.batch = 4;
        spec.workload.accumulation = 2;
        let (start, embed) = data_at_embed(&spec);
        assert_eq!(start, batch_bytes(&spec, 4));
        assert_eq!(embed, start + batch_bytes(&spec, 2));
    }
}
