//! The step as a sequence of stages, as PyTorch runs it: the input side, each stack of
//! transformer blocks, the output side with the loss. The original DiT has three (embed, its
//! blocks, the final layer); a diffusers family lays out its own (Flux: double-stream and
//! single-stream stacks; SD3: its joint blocks and the context-pre-only last block).
//!
//! Between two stages pass the **streams** (the residual streams: the next stage's
//! `stream_in`, the previous one's outputs); every block also reads **broadcast** tensors the
//! input side made (the conditioning vector, a text context, RoPE tables), kept until the input
//! side's backward, whose gradients accumulate from the first stage that reads them in backward.

use crate::runtime::pytorch::allocator::{simulate, SegCost};
use crate::runtime::pytorch::device::PyTorch;
use crate::runtime::shape::Shape;
use crate::segment::{Segment, TensorKind, Tid};
use crate::spec::Spec;

/// One stage: a segment and how many times it runs in a row.
#[derive(Debug, Clone)]
pub(crate) struct Stage {
    pub seg: Segment,
    /// Instances: 1 for the input and output sides, the block count of a stack.
    pub count: u32,
    /// Whether its instances are transformer blocks (numbered across stacks for the recompute
    /// policy and labelled `"{label} {i}"`).
    pub blocks: bool,
    /// The label of its events.
    pub label: &'static str,
    /// Tensors of the segment other than its outputs that receive a gradient from later stages
    /// (the input side's broadcast outputs).
    pub extra_grads: Vec<Tid>,
}

impl Stage {
    /// The input side's stage: one instance; `extra_grads` are its broadcast outputs that receive a
    /// gradient from the blocks.
    pub(crate) fn embed(seg: Segment, extra_grads: Vec<Tid>) -> Self {
        Self {
            seg,
            count: 1,
            blocks: false,
            label: "embed",
            extra_grads,
        }
    }

    /// A stack of `count` transformer blocks of one segment, labelled `label`.
    pub(crate) fn blocks(seg: Segment, count: u32, label: &'static str) -> Self {
        Self {
            seg,
            count,
            blocks: true,
            label,
            extra_grads: Vec::new(),
        }
    }

    /// The output side with the loss.
    pub(crate) fn final_loss(seg: Segment) -> Self {
        Self {
            seg,
            count: 1,
            blocks: false,
            label: "final + loss",
            extra_grads: Vec::new(),
        }
    }
}

/// The data of a microbatch outside the model, as the training script holds it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Data {
    /// Alive until the step's backward ends (the loss target, timesteps).
    pub kept: u64,
    /// Freed when the forward ends (the clean latents, the noise, the text embeddings).
    pub forward_only: u64,
}

/// The stages of a spec's step.
#[derive(Debug, Clone, Default)]
pub(crate) struct Stages {
    pub stages: Vec<Stage>,
    pub data: Data,
}

/// A stage with its costs under PyTorch's rules.
#[derive(Debug, Clone)]
pub(crate) struct StageCost {
    pub cost: SegCost,
    pub count: u32,
    pub blocks: bool,
    pub label: &'static str,
    /// Broadcast inputs that receive a gradient (name, bytes).
    pub bcast: Vec<(String, u64)>,
    /// Bytes of the gradients of the stage's stream inputs.
    pub stream_in_grad: u64,
}

/// The broadcast inputs of a segment that receive a gradient: inputs needing one that are not
/// its streams.
pub(crate) fn broadcast_inputs(seg: &Segment) -> impl Iterator<Item = Tid> + '_ {
    seg.tensors.iter().enumerate().filter_map(|(t, d)| {
        let needs = matches!(
            d.kind,
            TensorKind::Input {
                requires_grad: true
            }
        );
        (needs && !seg.stream_in.contains(&t)).then_some(t)
    })
}

/// Gradient bytes entering a segment's backward: every output's.
pub(crate) fn grad_in(seg: &Segment) -> u64 {
    seg.outputs().iter().map(|&o| seg.tensors[o].bytes()).sum()
}

impl Stages {
    /// Each stage simulated under PyTorch's release rule.
    pub(crate) fn costs(&self) -> Vec<StageCost> {
        self.stages
            .iter()
            // A stack of no blocks (Flux with num_layers 0) hands its input on untouched.
            .filter(|st| st.count > 0)
            .map(|st| {
                let seg = &st.seg;
                let bcast = broadcast_inputs(seg)
                    .map(|t| (seg.tensors[t].name.clone(), seg.tensors[t].bytes()))
                    .collect();
                StageCost {
                    cost: simulate(seg, grad_in(seg), &st.extra_grads),
                    count: st.count,
                    blocks: st.blocks,
                    label: st.label,
                    bcast,
                    stream_in_grad: seg.stream_in.iter().map(|&t| seg.tensors[t].bytes()).sum(),
                }
            })
            .collect()
    }
}

/// The stages of the original DiT: embed (its conditioning vector c broadcast to every block
/// and the final layer), `depth` blocks, the final layer with the loss.
pub(crate) fn dit(rt: &PyTorch, spec: &Spec) -> Stages {
    let dims = Shape::new(spec);
    let embed = rt.embed(&dims);
    let c = embed
        .ops
        .iter()
        .map(|o| o.output)
        .find(|&t| embed.tensors[t].name.starts_with("c = "))
        .map(|t| vec![t])
        .unwrap_or_default();
    let pd = dims.precision.param_dtype().size();
    let target = if spec.recipe.prediction == crate::spec::Prediction::V {
        dims.latent * pd
    } else {
        0
    };
    // x0, noise (the ε target) and ᾱ_t go with the forward; t and y (int64) and a v target stay.
    let kept = dims.latent * pd + 8 * dims.b + target;
    Stages {
        stages: vec![
            Stage::embed(embed, c),
            Stage::blocks(rt.block(&dims), spec.model.depth, "block"),
            Stage::final_loss(rt.final_layer(&dims)),
        ],
        data: Data {
            kept,
            forward_only: dims.latent * pd + dims.b * (pd + 8),
        },
    }
}
