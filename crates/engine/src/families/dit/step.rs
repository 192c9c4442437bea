//! The original DiT's step: its parameters by role ([`DitLayout`]) and its own schedule over the
//! embed segment, the adaLN-Zero blocks (stored or recomputed) and the final layer (see
//! [`crate::trainer`] for the schedule in words). The diffusers families run the shared family
//! schedule ([`crate::trainer::family`]) instead; the DiT keeps this one, whose order of
//! allocations and frees the `ditmem-cpu` budget replays (`ditmem_cpu/step.rs`, `block.rs`).

use std::sync::Arc;

use candle_core::{DType, Tensor, Var};

use super::block::{block_forward, final_forward, BlockSeeds, BlockWeights, FinalWeights};
use super::params::BLOCK_LINEARS;
use crate::diffusion::Batch;
use crate::error::{EngineError, Result};
use crate::layers::cast;
use crate::measure::{Phase, Recorder};
use crate::model::{patchify, unpatchify};
use crate::rng::derive_seed;
use crate::shapes::Dims;
use crate::trainer::family::leaf_grad;
use crate::trainer::state::{
    grad_dtype, FamilyLayout, LinearIdx, ModelLayout, ParamIndex, SegmentTag, Trainer,
};

#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockIdx {
    lin: [LinearIdx; 5],
}

/// Where the original DiT's parameters sit in `Trainer::params`.
#[derive(Debug, Clone)]
pub(crate) struct DitLayout {
    embed_idx: [LinearIdx; 3],
    table: usize,
    pos: usize,
    blocks: Vec<BlockIdx>,
    final_idx: [LinearIdx; 2],
}

impl DitLayout {
    pub(crate) fn new(p: &ParamIndex<'_>, depth: usize) -> Result<DitLayout> {
        let blocks = (0..depth)
            .map(|i| {
                let names = BLOCK_LINEARS.map(|(name, _)| name);
                Ok(BlockIdx {
                    lin: p.lins(&format!("blocks.{i}"), names)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DitLayout {
            embed_idx: [
                p.lin("x_embedder.proj")?,
                p.lin("t_embedder.mlp.0")?,
                p.lin("t_embedder.mlp.2")?,
            ],
            table: p.idx("y_embedder.embedding_table.weight")?,
            pos: p.idx("pos_embed")?,
            blocks,
            final_idx: [
                p.lin("final_layer.adaLN_modulation.1")?,
                p.lin("final_layer.linear")?,
            ],
        })
    }
}

impl ModelLayout for DitLayout {
    fn linears(&self) -> Vec<LinearIdx> {
        self.embed_idx
            .iter()
            .chain(self.blocks.iter().flat_map(|b| b.lin.iter()))
            .chain(self.final_idx.iter())
            .copied()
            .collect()
    }

    fn microbatch(
        &self,
        tr: &mut Trainer,
        mb: &Batch,
        micro: usize,
        accum: usize,
        rec: &mut Recorder<'_>,
    ) -> Result<f64> {
        tr.dit_microbatch(self, mb, SegmentTag { micro, accum }, rec)
    }
}

/// What the forward pass keeps of a block until its backward: the leaf the block ran on and
/// its output, or its input only.
type Saved = crate::trainer::family::Saved<Var, Tensor>;

/// The embed segment's outputs (kept until the end of the backward).
struct DitEmbed {
    /// The tokens entering block 0.
    x0: Tensor,
    /// The conditioning (embedded timestep + label) and its leaf, which every block and the
    /// final layer read.
    c: Tensor,
    c_leaf: Var,
    /// The embed's locals its graph references; they live until the microbatch returns (an
    /// array: a `Vec` would be a heap block the step's measured peak would count).
    hold: [Tensor; 6],
}

impl Trainer {
    fn block_weights(&self, b: &BlockIdx, track: bool) -> Result<BlockWeights> {
        let l = &b.lin;
        Ok(BlockWeights {
            adaln: self.linear(l[0], track)?,
            qkv: self.linear(l[1], track)?,
            proj: self.linear(l[2], track)?,
            fc1: self.linear(l[3], track)?,
            fc2: self.linear(l[4], track)?,
        })
    }

    fn seeds(&self, micro: usize, block: usize) -> BlockSeeds {
        let base = [self.steps, micro as u64, block as u64];
        BlockSeeds {
            attn: derive_seed(self.opts.seed, &[base[0], base[1], base[2], 1]),
            mlp: derive_seed(self.opts.seed, &[base[0], base[1], base[2], 2]),
        }
    }

    /// One microbatch of the DiT: embed, blocks, final layer and loss, then the backward in
    /// reverse. Returns the loss.
    fn dit_microbatch(
        &mut self,
        lay: &DitLayout,
        mb: &Batch,
        tag: SegmentTag,
        rec: &mut Recorder<'_>,
    ) -> Result<f64> {
        let d = self.dims;
        let (cd, ad) = (self.cfg.compute, self.cfg.accum);
        let ld = grad_dtype(self.precision);
        let b = mb.n;

        let DitEmbed {
            x0,
            c,
            c_leaf,
            hold,
        } = self.dit_embed(lay, mb)?;
        rec.mark(tag.at("embed".into()));
        let (mut saved, cur) = self.dit_blocks_forward(lay, &x0, &c_leaf, tag, rec)?;

        // Final layer and loss.
        let final_leaf = Var::from_tensor(&cur.detach())?;
        drop(cur);
        let fw = FinalWeights {
            adaln: self.linear(lay.final_idx[0], true)?,
            linear: self.linear(lay.final_idx[1], true)?,
        };
        // `out` is dropped as soon as the prediction is built, so that the final layer's graph
        // is owned by the loss alone and freed with it.
        let pred = {
            let out = final_forward(final_leaf.as_tensor(), c_leaf.as_tensor(), &fw, cd, ad)?;
            unpatchify(&out, b, &d)?.narrow(1, 0, d.in_channels)?
        };
        drop(fw);
        let pred = cast(pred, ld)?;
        let target = mb.target(&self.acp, self.spec.recipe.prediction, ld, &self.dev)?;
        let loss = (pred - target)?.sqr()?.mean_all()?;
        let loss_value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        rec.mark(tag.at("final".into()));

        rec.enter(Phase::Backward);
        let factor = self.grad_scale / tag.accum as f64;
        let grads = loss.affine(factor, 0.0)?.backward()?;
        drop(loss);
        let mut final_params = Self::linear_params(&lay.final_idx[0]);
        final_params.extend(Self::linear_params(&lay.final_idx[1]));
        self.accumulate(&final_params, &grads)?;
        let gx = leaf_grad(&grads, &final_leaf, "the final layer input")?;
        let gc = match grads.get(c_leaf.as_tensor()) {
            Some(g) => cast(g.detach(), ld)?,
            None => Tensor::zeros((b, d.hidden), ld, &self.dev)?,
        };
        drop(grads);
        drop(final_leaf);
        rec.mark(tag.at("final".into()));

        let (gx, gc) = self.dit_blocks_backward(lay, &mut saved, (gx, gc), &c_leaf, tag, rec)?;

        // Embed segment backward, from the known gradients of x0 and c, one seed each (a
        // composed root sum(x0·gx) + sum(c·gc) made x0-sized products in forward and backward:
        // at DiT-S/2 256² batch 2 with block recompute the step's worst moment).
        let gc = cast(gc, c.dtype())?;
        let grads = crate::ops::backward_from_many(&[x0.clone(), c.clone()], vec![gx, gc])?;
        let mut idx = Vec::new();
        for l in &lay.embed_idx {
            idx.extend(Self::linear_params(l));
        }
        idx.push(lay.table);
        self.accumulate(&idx, &grads)?;
        drop(grads);
        drop((x0, c));
        rec.mark(tag.at("embed".into()));
        drop((c_leaf, hold));
        Ok(loss_value)
    }

    /// The embed segment: patch embedding + positions, timestep MLP, label table (the label
    /// dropped to the null class where the batch says so).
    fn dit_embed(&self, lay: &DitLayout, mb: &Batch) -> Result<DitEmbed> {
        let d = self.dims;
        let ad = self.cfg.accum;
        let b = mb.n;
        let (xp, xe) = self.patch_embed(mb, lay.embed_idx[0], |xt| patchify(xt, &d))?;
        let pos = self.raw_weight(lay.pos, true);
        let x0 = cast(xe, ad)?
            .reshape((b, d.tokens, d.hidden))?
            .broadcast_add(&pos)?;
        let [tf, t1, temb] = self.timestep_mlp(mb, d.freq, [lay.embed_idx[1], lay.embed_idx[2]])?;
        let null = (d.label_rows > d.num_classes).then_some(d.num_classes as u32);
        let ids = super::class_ids(mb, null, &self.dev)?;
        let table = self.raw_weight(lay.table, true);
        let yemb = cast(table.index_select(&ids, 0)?, ad)?;
        let c = (temb + yemb)?;
        let c_leaf = Var::from_tensor(&c.detach())?;
        Ok(DitEmbed {
            x0,
            c,
            c_leaf,
            hold: [xp, pos, tf, t1, ids, table],
        })
    }

    /// The blocks' forward from `x0`: what each keeps for its backward, and the last output.
    fn dit_blocks_forward(
        &self,
        lay: &DitLayout,
        x0: &Tensor,
        c_leaf: &Var,
        tag: SegmentTag,
        rec: &mut Recorder<'_>,
    ) -> Result<(Vec<Saved>, Tensor)> {
        let depth = self.dims.depth;
        let mut saved: Vec<Saved> = Vec::with_capacity(depth);
        let mut cur = x0.clone();
        for i in 0..depth {
            let seeds = self.seeds(tag.micro, i);
            if self.spec.recipe.recompute.recomputes_block(i as u32) {
                let input = cur.detach();
                let w = self.block_weights(&lay.blocks[i], false)?;
                cur = block_forward(&input, &c_leaf.as_detached_tensor(), &w, &self.cfg, seeds)?;
                saved.push(Saved::Recompute { inputs: input });
            } else {
                let leaf = Var::from_tensor(&cur.detach())?;
                let w = self.block_weights(&lay.blocks[i], true)?;
                let out =
                    block_forward(leaf.as_tensor(), c_leaf.as_tensor(), &w, &self.cfg, seeds)?;
                cur = out.clone();
                saved.push(Saved::Stored {
                    leaves: leaf,
                    outs: out,
                });
            }
            rec.mark(tag.at(format!("block {i}")));
        }
        Ok((saved, cur))
    }

    /// The blocks' backward from the last one down, recomputing where the forward did not
    /// store: (gradient of x0, the conditioning's summed gradient) from those of the last
    /// output and of the final layer's conditioning.
    fn dit_blocks_backward(
        &mut self,
        lay: &DitLayout,
        saved: &mut Vec<Saved>,
        (mut gx, mut gc): (Tensor, Tensor),
        c_leaf: &Var,
        tag: SegmentTag,
        rec: &mut Recorder<'_>,
    ) -> Result<(Tensor, Tensor)> {
        let ld = grad_dtype(self.precision);
        for i in (0..self.dims.depth).rev() {
            let s = saved
                .pop()
                .ok_or_else(|| EngineError::bad_input("backward", "block state missing"))?;
            let (leaf, out) = match s {
                Saved::Stored { leaves, outs } => (leaves, outs),
                Saved::Recompute { inputs: input } => {
                    let leaf = Var::from_tensor(&input)?;
                    drop(input);
                    let w = self.block_weights(&lay.blocks[i], true)?;
                    let seeds =
                        if crate::mutation::active(crate::mutation::Mutation::RecomputeDropoutMask)
                        {
                            // The planted bug: the replay draws from the next block's seeds.
                            self.seeds(tag.micro, i + 1)
                        } else {
                            self.seeds(tag.micro, i)
                        };
                    let out =
                        block_forward(leaf.as_tensor(), c_leaf.as_tensor(), &w, &self.cfg, seeds)?;
                    (leaf, out)
                }
            };
            // gx moves into the seed and is freed once it reaches out's entry.
            let grads = crate::ops::backward_from(&out, gx)?;
            drop(out);
            let mut idx = Vec::new();
            for l in &lay.blocks[i].lin {
                idx.extend(Self::linear_params(l));
            }
            self.accumulate(&idx, &grads)?;
            gx = leaf_grad(&grads, &leaf, format_args!("block {i}'s input"))?;
            if let Some(g) = grads.get(c_leaf.as_tensor()) {
                gc = (gc + cast(g.detach(), ld)?)?;
            }
            drop(grads);
            drop(leaf);
            rec.mark(tag.at(format!("block {i}")));
        }
        Ok((gx, gc))
    }
}

impl FamilyLayout for super::params::Dit {
    fn layout(&self, p: &ParamIndex<'_>, d: &Dims) -> Result<Arc<dyn ModelLayout>> {
        Ok(Arc::new(DitLayout::new(p, d.depth)?))
    }
}
