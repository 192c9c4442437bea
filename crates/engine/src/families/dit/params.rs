//! The original DiT's parameter inventory (facebookresearch/DiT `models.py`), with the PyTorch
//! names; the initialisation rules are in [`crate::model`]'s docs.

use ditmem_spec::{LoraTarget, Spec};

use crate::shapes::{Dims, Init, Inventory, ParamShape};

/// The original DiT: everything it needs beyond [`Dims`] is in the spec's `model` section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dit;

/// The linears of a block, in forward order, with their PyTorch names and LoRA target.
pub(crate) const BLOCK_LINEARS: [(&str, LoraTarget); 5] = [
    ("adaLN_modulation.1", LoraTarget::Adaln),
    ("attn.qkv", LoraTarget::Qkv),
    ("attn.proj", LoraTarget::Proj),
    ("mlp.fc1", LoraTarget::Fc1),
    ("mlp.fc2", LoraTarget::Fc2),
];

/// (out, in) of a block linear.
pub(crate) fn block_linear_shape(d: &Dims, target: LoraTarget) -> (usize, usize) {
    let h = d.hidden;
    match target {
        LoraTarget::Adaln => (6 * h, h),
        LoraTarget::Qkv => (3 * h, h),
        LoraTarget::Proj => (h, h),
        LoraTarget::Fc1 => (d.mlp_hidden, h),
        LoraTarget::Fc2 => (h, d.mlp_hidden),
    }
}

/// Every parameter of the DiT of `spec` (dims `d`), in a fixed order (embedders, blocks, final
/// layer). Under LoRA the base is frozen and each adapted block linear's factors follow its
/// bias, trained.
pub(crate) fn param_shapes(spec: &Spec, d: &Dims) -> Vec<ParamShape> {
    let lora = spec.recipe.lora.as_ref();
    let small = Init::Normal(0.02);
    let h = d.hidden;
    let mut inv = Inventory::default();
    inv.linear("x_embedder.proj", h, d.patch_in(), Init::XavierUniform);
    inv.shapes.push(ParamShape {
        name: "pos_embed".into(),
        shape: vec![d.tokens, h],
        init: Init::SinCos2d {
            rows: d.rows,
            cols: d.cols,
        },
        trainable: false,
    });
    inv.linear("t_embedder.mlp.0", h, d.freq, small);
    inv.linear("t_embedder.mlp.2", h, h, small);
    inv.tensor(
        "y_embedder.embedding_table.weight".into(),
        vec![d.label_rows, h],
        small,
    );
    let mut factors = Vec::new();
    for i in 0..d.depth {
        for (name, target) in BLOCK_LINEARS {
            let (out, inp) = block_linear_shape(d, target);
            let w = if target == LoraTarget::Adaln {
                small
            } else {
                Init::XavierUniform
            };
            let prefix = format!("blocks.{i}.{name}");
            inv.linear(&prefix, out, inp, w);
            if let Some(l) = lora.filter(|l| l.targets.contains(&target)) {
                let r = l.rank as usize;
                let bound = 1.0 / (inp as f64).sqrt();
                factors.extend([inv.shapes.len(), inv.shapes.len() + 1]);
                inv.tensor(
                    format!("{prefix}.lora_a"),
                    vec![r, inp],
                    Init::Uniform(bound),
                );
                inv.tensor(format!("{prefix}.lora_b"), vec![out, r], Init::Zeros);
            }
        }
    }
    inv.linear("final_layer.linear", d.patch_out(), h, small);
    inv.linear("final_layer.adaLN_modulation.1", 2 * h, h, small);
    if lora.is_some() {
        for (k, p) in inv.shapes.iter_mut().enumerate() {
            p.trainable = factors.contains(&k);
        }
    }
    inv.shapes
}
