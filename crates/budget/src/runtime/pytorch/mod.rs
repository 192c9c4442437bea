//! PyTorch eager autograd as the executor: what each op of the DiT step saves for backward.
//!
//! Sources of the rules (each rule in this folder names its source):
//! - **[AG]** PyTorch's autograd formulas (`tools/autograd/derivatives.yaml`): a node saves only
//!   what its backward reads — `addmm`/`mm`/`bmm` save both operands, `mul` saves the operand
//!   the other's gradient needs, `add`/`sub`, views and scalar multiplications save nothing,
//!   `native_layer_norm` saves its input plus per-row mean and rstd, `gelu` and `silu` save their
//!   input, `_softmax` saves its **output**, `embedding` saves the indices. A storage is freed as
//!   soon as no saved variable nor live tensor references it.
//! - **[MM]** `at::matmul` on 4-D operands expands and **reshapes to 3-D before `bmm`**; a
//!   permuted q/k/v slice of the fused qkv output cannot be viewed that way, so the reshape
//!   copies and `bmm` saves the copies (q·scale, kᵀ and v each become one new E-sized tensor).
//!   `attn.transpose(1, 2).reshape(b, s, D)` of a contiguous (b, a, s, d) result copies too.
//! - **[AC]** Autocast (`aten/src/ATen/autocast_mode.cpp`): `linear`/`addmm`/`matmul`/`bmm`/
//!   `conv2d`/`scaled_dot_product_attention` run in the low dtype, so each Linear saves an
//!   autocast-**cast copy** of its input and of its weight; casts of fp32 leaf parameters are kept
//!   in the autocast weight cache (`cached_cast`) until the autocast region exits, and stay alive
//!   while a saved variable references them. On CUDA `layer_norm`, `softmax` and `mse_loss` are on
//!   the fp32 list (softmax of bf16 scores saves a fp32 P, and the following `P @ v` saves a bf16
//!   copy of it); the CPU autocast list has no `softmax` entry, so P stays bf16 there. Everything
//!   else follows type promotion: the residual stream stays fp32 (fp32 x + bf16 branch).
//! - **[SDPA]** `scaled_dot_product_attention`: the fused kernels (CPU flash
//!   `_scaled_dot_product_flash_attention_for_cpu`, CUDA flash, memory-efficient, cuDNN) save
//!   q, k, v (views of the qkv output), their output and an fp32 log-sum-exp of b·a·s rows
//!   (memory-efficient pads s to a multiple of 32); their output is laid out (b, s, a, d), so the
//!   transpose + reshape before `proj` is a view. The math backend is composite (scaled q and k,
//!   `matmul`, `softmax`, `matmul`; see [MM]) and since PyTorch 2.5 upcasts fp16/bf16 inputs to
//!   fp32 on CUDA (pytorch/pytorch #128922).
//! - **[CK]** `torch.utils.checkpoint(block, x, c, use_reentrant=False)`: the forward keeps only
//!   the block's inputs; backward recomputes the block under the same autocast state and then
//!   backpropagates it.
//! - **[OPT]** `torch.optim.AdamW(foreach=True)` (`torch/optim/adam.py`, `_multi_tensor_adam`):
//!   `lerp_`, `mul_`, `addcmul_`, `div_`, `add_`, `addcdiv_` are in place; `_foreach_sqrt(exp_avg_sq)`
//!   makes one new state-sized tensor for **every** parameter of the group at once. SGD without
//!   momentum updates in place.
//! - **[CUDA]** The CUDA caching allocator (`c10/cuda/CUDACachingAllocator.cpp`) rounds every
//!   block up to 512 B; requests ≤ 1 MiB come from 2 MiB segments, requests below 10 MiB from
//!   20 MiB segments, larger ones are rounded to 2 MiB. The CUDA context (driver, cuBLAS/cuDNN
//!   workspaces, kernels) is memory the device shows but the allocator does not count.
//!
//! Measured against real PyTorch runs by `bench/torch_peer` (see its README and `grid.py`); the
//! saved-tensor lists were checked with `bench/torch_peer/saved.py` (saved-tensor hooks).

//!
//! Layout: [`device`] (which PyTorch: device and SDPA kernel), [`rules`] (the segment graphs, op
//! by op, with what each op saves), [`allocator`] (PyTorch's release rule over a segment and the
//! CUDA caching allocator's rounding), [`step`] (the step replay of `bench/torch_peer/peer.py`).
//! The model of the runtime's memory is checked by the unit tests in `tests.rs`.

pub(crate) mod allocator;
pub(crate) mod caching_allocator;
pub(crate) mod cuda;
pub(crate) mod device;
pub(crate) mod families;
pub(crate) mod ops;
pub(crate) mod rules;
pub(crate) mod sharding;
pub(crate) mod stages;
pub(crate) mod step;
#[cfg(test)]
mod tests;
pub(crate) mod trace;

use crate::events::{Event, StaticBytes};
use crate::params::ParamTensor;
use crate::runtime::costs::{GenericCosts, SegmentCosts};
use crate::runtime::model::RuntimeModel;
use crate::runtime::shape::Shape;
use crate::segment::{simulate, Segment, Tid};
use crate::spec::Spec;
use device::PyTorch;
use rules::SAVED;

impl RuntimeModel for PyTorch {
    fn name(&self) -> &'static str {
        "pytorch"
    }

    fn embed_segment(&self, shape: &Shape) -> Segment {
        self.embed(shape)
    }

    fn block_segment(&self, shape: &Shape) -> Segment {
        self.block(shape)
    }

    fn final_segment(&self, shape: &Shape) -> Segment {
        self.final_layer(shape)
    }

    fn keeps_all_outputs(&self) -> bool {
        false
    }

    fn saves(&self, seg: &Segment, t: Tid) -> bool {
        seg.tensors[t].name.ends_with(SAVED)
    }

    /// A family's input side, its first stack of blocks and its output side; the original
    /// DiT's three segments otherwise.
    fn segment_costs(&self, spec: &Spec) -> SegmentCosts {
        let Some(segs) = families::family_segments(spec) else {
            let shape = Shape::new(spec);
            let saved = |seg: &Segment, t| self.saves(seg, t);
            return SegmentCosts::Generic(GenericCosts {
                embed: simulate(&self.embed(&shape), false, &saved),
                block: simulate(&self.block(&shape), false, &saved),
                final_layer: simulate(&self.final_layer(&shape), false, &saved),
            });
        };
        let saved = |seg: &Segment, t| self.saves(seg, t);
        let sim = |i: usize| {
            segs.get(i)
                .map(|s| simulate(s, false, &saved))
                .unwrap_or_default()
        };
        SegmentCosts::Generic(GenericCosts {
            embed: sim(0),
            block: sim(1),
            final_layer: sim(segs.len().saturating_sub(1)),
        })
    }

    /// PyTorch replays its own step (graphs released op by op, foreach optimizer, autocast
    /// cache) from its own segment costs; the generic costs only feed the inventory.
    fn replay(
        &self,
        spec: &Spec,
        table: &[ParamTensor],
        st: &StaticBytes,
        _costs: &SegmentCosts,
        max_microbatches: u32,
    ) -> Vec<Event> {
        step::replay(spec, table, st, max_microbatches)
    }
}
