//! Flux's segments for the family schedule ([`crate::trainer::family`]).
//!
//! Embed: `x_embedder` on the 2×2-packed latent tokens (the image stream (b, s, D)),
//! `context_embedder` on the cached T5 embeddings (the text stream (b, T, D)), `time_text_embed`
//! (the timestep MLP, the guidance MLP when the config has one, the pooled-text MLP; their sum
//! is temb), and the RoPE tables over [text; image]. The conditioning is `[silu(temb), cos,
//! sin]`: every AdaLayerNorm's linear reads silu(temb) (b, D) in the compute dtype (its leaf
//! gathers their gradients); cos and sin are fixed tables (no leaf, no gradient).
//!
//! Blocks: the double-stream blocks on [image, text], then the single-stream blocks on the
//! joint stream; the first single-stream block joins the two streams itself (it reads two and
//! returns one). The final layer reads the image tokens of the joint stream.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::diffusion::Batch;
use crate::error::{EngineError, Result};
use crate::families::flux::block::{
    double_forward, final_forward, image_tokens, join_streams, mlp_silu, single_forward, unpack,
    DoubleWeights, FinalWeights, SingleWeights,
};
use crate::families::flux::params::{
    rope_ids, FluxGeom, DOUBLE_LINEARS, DOUBLE_NORMS, FLUX_FREQ, GUIDANCE, ROPE_THETA,
    SINGLE_LINEARS, SINGLE_NORMS,
};
use crate::layers::cast;
use crate::model::{patchify, timestep_features};
use crate::ops::RopeTable;
use crate::shapes::Dims;
use crate::trainer::family::{check_pooled_text, params_of, BlockIn, Embedded, FamilyStep};
use crate::trainer::state::{FamilyLayout, LinearIdx, ModelLayout, ParamIndex, Trainer};

/// Where one Flux block's parameters sit: its linears and q/k norm weights in the order of
/// [`DOUBLE_LINEARS`] / [`SINGLE_LINEARS`] and their norms.
#[derive(Debug, Clone)]
pub(crate) struct FluxBlockIdx {
    lin: Vec<LinearIdx>,
    norms: Vec<usize>,
}

/// Where Flux's parameters sit in `Trainer::params`.
#[derive(Debug, Clone)]
pub(crate) struct FluxLayout {
    x_embedder: LinearIdx,
    context_embedder: LinearIdx,
    /// timestep_embedder, guidance_embedder (if any), text_embedder: (linear_1, linear_2).
    embedders: Vec<[LinearIdx; 2]>,
    double: Vec<FluxBlockIdx>,
    single: Vec<FluxBlockIdx>,
    norm_out: LinearIdx,
    proj_out: LinearIdx,
    geom: FluxGeom,
}

impl FluxLayout {
    pub(crate) fn new(p: &ParamIndex<'_>, geom: FluxGeom) -> Result<FluxLayout> {
        let block = |prefix: String, lins: &[&str], norms: &[&str]| -> Result<FluxBlockIdx> {
            Ok(FluxBlockIdx {
                lin: lins
                    .iter()
                    .map(|n| p.lin(&format!("{prefix}.{n}")))
                    .collect::<Result<_>>()?,
                norms: norms
                    .iter()
                    .map(|n| p.idx(&format!("{prefix}.{n}.weight")))
                    .collect::<Result<_>>()?,
            })
        };
        let double = (0..geom.double)
            .map(|i| {
                block(
                    format!("transformer_blocks.{i}"),
                    &DOUBLE_LINEARS,
                    &DOUBLE_NORMS,
                )
            })
            .collect::<Result<_>>()?;
        let single = (0..geom.single)
            .map(|i| {
                block(
                    format!("single_transformer_blocks.{i}"),
                    &SINGLE_LINEARS,
                    &SINGLE_NORMS,
                )
            })
            .collect::<Result<_>>()?;
        let tte = "time_text_embed";
        let mut names = vec!["timestep_embedder"];
        if geom.guidance {
            names.push("guidance_embedder");
        }
        names.push("text_embedder");
        let embedders = names
            .iter()
            .map(|n| {
                Ok([
                    p.lin(&format!("{tte}.{n}.linear_1"))?,
                    p.lin(&format!("{tte}.{n}.linear_2"))?,
                ])
            })
            .collect::<Result<_>>()?;
        Ok(FluxLayout {
            x_embedder: p.lin("x_embedder")?,
            context_embedder: p.lin("context_embedder")?,
            embedders,
            double,
            single,
            norm_out: p.lin("norm_out.linear")?,
            proj_out: p.lin("proj_out")?,
            geom,
        })
    }

    fn block_idx(&self, i: usize) -> &FluxBlockIdx {
        if i < self.double.len() {
            &self.double[i]
        } else {
            &self.single[i - self.double.len()]
        }
    }
}

impl FamilyStep for FluxLayout {
    fn block_linears(&self, i: usize) -> Vec<LinearIdx> {
        self.block_idx(i).lin.clone()
    }

    fn final_linears(&self) -> Vec<LinearIdx> {
        vec![self.norm_out, self.proj_out]
    }

    fn embed(&self, tr: &Trainer, mb: &Batch) -> Result<Embedded> {
        let d = tr.dims;
        let (cd, ad) = (tr.cfg.compute, tr.cfg.accum);
        let b = mb.n;
        let g = &self.geom;
        check_pooled_text(mb, g.text_tokens, g.text_width, g.pooled_width)?;
        let (xp, xe) = tr.patch_embed(mb, self.x_embedder, |xt| patchify(xt, &d))?;
        let x0 = cast(xe, ad)?.reshape((b, d.tokens, d.hidden))?;
        let cap = mb.text_tensor(cd, &tr.dev)?;
        let ce = tr.linear(self.context_embedder, true)?.forward(&cap)?;
        let c0 = cast(ce, ad)?.reshape((b, g.text_tokens, d.hidden))?;
        // time_text_embed: Σ of the timestep, guidance and pooled-text MLPs (compute dtype).
        let mut hold = vec![xp, cap];
        let mut temb: Option<Tensor> = None;
        for (k, [l1, l2]) in self.embedders.iter().enumerate() {
            // The sinusoids are made in the accumulation dtype and cast, as PixArt's.
            let input = if k + 1 == self.embedders.len() {
                mb.pooled_tensor(cd, &tr.dev)?
            } else if k == 0 {
                cast(
                    timestep_features(&mb.timesteps, FLUX_FREQ, ad, &tr.dev)?,
                    cd,
                )?
            } else {
                let gs = vec![GUIDANCE as u32; b];
                cast(timestep_features(&gs, FLUX_FREQ, ad, &tr.dev)?, cd)?
            };
            let e = mlp_silu(&input, &tr.linear(*l1, true)?, &tr.linear(*l2, true)?)?;
            hold.push(input);
            temb = Some(match temb {
                None => e,
                Some(t) => (t + e)?,
            });
        }
        let temb = temb.ok_or_else(|| EngineError::bad_input("embed", "no timestep embedder"))?;
        let st = temb.silu()?;
        // RoPE tables in the attention's accumulation type.
        let td = if cd == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let table = RopeTable::new(&rope_ids(g.text_tokens, &d), &g.axes, ROPE_THETA, td)?;
        Ok(Embedded {
            streams: vec![x0, c0],
            conds: vec![st, table.cos, table.sin],
            hold,
        })
    }

    fn depth(&self) -> usize {
        self.double.len() + self.single.len()
    }

    fn block(&self, tr: &Trainer, i: usize, b: BlockIn<'_>) -> Result<Vec<Tensor>> {
        let BlockIn { x, c, track } = b;
        let bi = self.block_idx(i);
        let lin = bi
            .lin
            .iter()
            .map(|l| tr.linear(*l, track))
            .collect::<Result<Vec<_>>>()?;
        let norm = |k: usize| tr.raw_weight(bi.norms[k], track);
        let table = Arc::new(RopeTable {
            cos: c[1].clone(),
            sin: c[2].clone(),
        });
        if i < self.double.len() {
            let w = DoubleWeights {
                lin,
                norms: [norm(0), norm(1), norm(2), norm(3)],
            };
            let (xo, co) = double_forward(&x[0], &x[1], &c[0], &table, &w, &tr.cfg)?;
            return Ok(vec![xo, co]);
        }
        let w = SingleWeights {
            lin,
            norms: [norm(0), norm(1)],
        };
        let out = match x {
            [joint] => single_forward(joint, &c[0], &table, &w, &tr.cfg)?,
            [img, txt] => {
                let joint = join_streams(img, txt)?;
                single_forward(&joint, &c[0], &table, &w, &tr.cfg)?
            }
            _ => {
                return Err(EngineError::bad_input(
                    "flux block",
                    "expects one or two streams",
                ))
            }
        };
        Ok(vec![out])
    }

    fn final_layer(&self, tr: &Trainer, x: &[Tensor], c: &[Tensor], mb: &Batch) -> Result<Tensor> {
        let d = tr.dims;
        let fw = FinalWeights {
            norm_out: tr.linear(self.norm_out, true)?,
            proj_out: tr.linear(self.proj_out, true)?,
        };
        let img = image_tokens(&x[0], d.tokens)?;
        let out = final_forward(&img, &c[0], &fw, tr.cfg.compute, tr.cfg.accum)?;
        let pred = unpack(&out, mb.n, &d)?;
        drop(fw);
        Ok(pred)
    }

    fn embed_linears(&self) -> Vec<LinearIdx> {
        let mut embed = vec![self.x_embedder, self.context_embedder];
        embed.extend(self.embedders.iter().flatten().copied());
        embed
    }

    fn block_params(&self, i: usize) -> Vec<usize> {
        let bi = self.block_idx(i);
        let mut idx = params_of(&bi.lin);
        idx.extend(bi.norms.iter().copied());
        idx
    }

    fn fixed_conds(&self) -> usize {
        2
    }
}

impl FamilyLayout for FluxGeom {
    fn layout(&self, p: &ParamIndex<'_>, _d: &Dims) -> Result<Arc<dyn ModelLayout>> {
        Ok(Arc::new(FluxLayout::new(p, self.clone())?))
    }
}
