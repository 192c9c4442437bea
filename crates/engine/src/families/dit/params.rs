//! The original DiT's parameter inventory (facebookresearch/DiT `models.py`), with the PyTorch
//! names; the initialisation rules are in [`crate::model`]'s docs.

use ditmem_spec::{LoraTarget, Spec};

use crate::shapes::{Dims, Init, ParamShape};

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
/// layer): the embedders' and the final layer's as tables, each block's linears (and their
/// LoRA factors after the bias) in a loop. Names are made as they always were (`into` for the
/// tables' fixed names, one `format!` each in the loop): their heap blocks are part of the
/// measured peak of `ditmem run`.
pub(crate) fn param_shapes(spec: &Spec, d: &Dims) -> Vec<ParamShape> {
    let lora = spec.recipe.lora.as_ref();
    let t = lora.is_none();
    let small = Init::Normal(0.02);
    let (h, xavier, zeros) = (d.hidden, Init::XavierUniform, Init::Zeros);
    let mut v = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, init: Init, trainable: bool| {
        v.push(ParamShape {
            name,
            shape,
            init,
            trainable,
        })
    };
    let (rows, cols) = (d.rows, d.cols);
    let embed = [
        ("x_embedder.proj.weight", vec![h, d.patch_in()], xavier, t),
        ("x_embedder.proj.bias", vec![h], zeros, t),
        (
            "pos_embed",
            vec![d.tokens, h],
            Init::SinCos2d { rows, cols },
            false,
        ),
        ("t_embedder.mlp.0.weight", vec![h, d.freq], small, t),
        ("t_embedder.mlp.0.bias", vec![h], zeros, t),
        ("t_embedder.mlp.2.weight", vec![h, h], small, t),
        ("t_embedder.mlp.2.bias", vec![h], zeros, t),
        (
            "y_embedder.embedding_table.weight",
            vec![d.label_rows, h],
            small,
            t,
        ),
    ];
    for (name, shape, init, trainable) in embed {
        push(name.into(), shape, init, trainable);
    }
    for i in 0..d.depth {
        for (name, target) in BLOCK_LINEARS {
            let (out, inp) = block_linear_shape(d, target);
            let w = if target == LoraTarget::Adaln {
                small
            } else {
                xavier
            };
            push(format!("blocks.{i}.{name}.weight"), vec![out, inp], w, t);
            push(format!("blocks.{i}.{name}.bias"), vec![out], zeros, t);
            if let Some(l) = lora.filter(|l| l.targets.contains(&target)) {
                let r = l.rank as usize;
                let a = Init::Uniform(1.0 / (inp as f64).sqrt());
                push(format!("blocks.{i}.{name}.lora_a"), vec![r, inp], a, true);
                push(
                    format!("blocks.{i}.{name}.lora_b"),
                    vec![out, r],
                    zeros,
                    true,
                );
            }
        }
    }
    let out = d.patch_out();
    let final_layer = [
        ("final_layer.linear.weight", vec![out, h], small),
        ("final_layer.linear.bias", vec![out], zeros),
        (
            "final_layer.adaLN_modulation.1.weight",
            vec![2 * h, h],
            small,
        ),
        ("final_layer.adaLN_modulation.1.bias", vec![2 * h], zeros),
    ];
    for (name, shape, init) in final_layer {
        push(name.into(), shape, init, t);
    }
    v
}
