//! The `pytorch` step over several ranks: what DDP, DeepSpeed ZeRO and FSDP2 change in the
//! step replay (`step.rs`) and its allocation sequence (`trace.rs`). The model states a rank
//! keeps are `crate::sharding::rank_states` (with the sources of every rule); this file holds
//! what happens inside the step:
//!
//! - **the module in the compute dtype**: under mixed precision DeepSpeed runs a bf16/fp16
//!   module (`engine.py` casts it when `bf16`/`fp16` is enabled) and FSDP2 all-gathers
//!   parameters in `MixedPrecisionPolicy.param_dtype`: autocast then finds no fp32 parameter to
//!   copy (`cached_cast` casts only fp32 leaves), and the gradients the backward makes are in the
//!   compute dtype. Every stage's trained fp32 parameters become compute-dtype parameters and
//!   their autocast copies become views of them ([`low_precision_module`]). The activations
//!   keep the autocast rules of the segment builders (an assumption: DeepSpeed's bf16 mode runs
//!   without autocast, where norms and softmax would stay in bf16);
//! - **gathers** (ZeRO-3, FSDP2): a block's parameters are all-gathered (in the compute dtype)
//!   before its forward, its recompute and its backward, together with the blocks its prefetch
//!   window names ([`crate::sharding::Prefetch`]), and freed after it (FSDP2 without
//!   `reshard_after_forward` keeps them from the forward to the block's backward). The
//!   parameters outside the blocks (FSDP2's root, which is not resharded after forward;
//!   DeepSpeed's embedders and final layer, an upper bound there) stay gathered from the
//!   forward's start to the backward's end;
//! - **gradients**: DDP, ZeRO-1 and one rank keep each block's gradients; ZeRO-2/3 and FSDP2
//!   reduce them and keep a partition (made when the first backward starts, freed after the
//!   step), so a block's full gradients live only inside its backward; stage 1/2's IPG buffers
//!   live through each backward; DeepSpeed's fp32 gradient partition is a transient of `step()`.

use crate::runtime::pytorch::stages::Stages;
use crate::segment::{TensorKind, TensorRole};
use crate::sharding::{Prefetch, RankStates};
use crate::spec::Precision;

/// Turn the stages of a step into those of a module held in the compute dtype: trained fp32
/// parameters become compute-dtype parameters, their autocast copies views of them.
pub(crate) fn low_precision_module(stages: &mut Stages, precision: Precision) {
    let (pd, cd) = (precision.param_dtype(), precision.compute_dtype());
    if pd == cd {
        return;
    }
    for st in &mut stages.stages {
        let seg = &mut st.seg;
        for t in seg.tensors.iter_mut() {
            if matches!(t.kind, TensorKind::Param { trained: true }) && t.dtype == pd {
                t.dtype = cd;
            }
        }
        for k in 0..seg.ops.len() {
            let (out, inputs) = (seg.ops[k].output, seg.ops[k].inputs.clone());
            let from_param = inputs.len() == 1
                && matches!(seg.tensors[inputs[0]].kind, TensorKind::Param { .. })
                && seg.tensors[inputs[0]].dtype == seg.tensors[out].dtype;
            if from_param && seg.tensors[out].role == TensorRole::WeightCast {
                seg.tensors[out].kind = TensorKind::View;
            }
        }
    }
}

/// The gathered bytes of a step's block instances in forward order, from the rank's per-block
/// gathers (block indices run across the stacks, as the replay numbers them).
pub(crate) fn block_gathers(rs: &RankStates, blocks: u32) -> Vec<u64> {
    (0..blocks as usize)
        .map(|b| rs.gathered_blocks.get(b).copied().unwrap_or(0))
        .collect()
}

/// Which block gathers are live, as the replay walks the blocks in one direction: `order` is
/// the blocks in execution order, `reshard` whether a block's gather is freed after it.
#[derive(Debug, Clone)]
pub(crate) struct GatherWalk {
    /// Bytes per block (by block index).
    bytes: Vec<u64>,
    /// Whether each block's gather is allocated now.
    live: Vec<bool>,
    prefetch: Prefetch,
}

impl GatherWalk {
    pub(crate) fn new(bytes: Vec<u64>, prefetch: Prefetch) -> GatherWalk {
        let n = bytes.len();
        GatherWalk {
            bytes,
            live: vec![false; n],
            prefetch,
        }
    }

    /// Before block `order[i]` runs: gather it and its prefetch window (blocks `order[j]` for
    /// the window's j). Returns the blocks newly gathered, in order.
    pub(crate) fn before(&mut self, order: &[usize], i: usize) -> Vec<usize> {
        let seq: Vec<u64> = order.iter().map(|&b| self.bytes[b]).collect();
        let mut out = Vec::new();
        for j in std::iter::once(i).chain(self.prefetch.window(&seq, i)) {
            let b = order[j];
            if !self.live[b] && self.bytes[b] > 0 {
                self.live[b] = true;
                out.push(b);
            }
        }
        out
    }

    /// After block `b` ran: free its gather when the scheme reshards. Returns whether it freed.
    pub(crate) fn after(&mut self, b: usize, reshard: bool) -> bool {
        if reshard && self.live[b] {
            self.live[b] = false;
            true
        } else {
            false
        }
    }

    /// Bytes of block `b`'s gather.
    pub(crate) fn bytes(&self, b: usize) -> u64 {
        self.bytes[b]
    }

    /// Blocks still gathered.
    pub(crate) fn live_blocks(&self) -> Vec<usize> {
        (0..self.live.len()).filter(|&b| self.live[b]).collect()
    }

    /// Forget every gather (after freeing them).
    pub(crate) fn clear(&mut self) {
        self.live.iter_mut().for_each(|l| *l = false);
    }
}
