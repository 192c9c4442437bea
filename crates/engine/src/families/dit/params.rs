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
/// layer).
// Over 100 lines as rustfmt lays out its 22 named tensors one call each; it is a list, read
// top to bottom in the order of DiT's `state_dict`.
pub(crate) fn param_shapes(spec: &Spec, d: &Dims) -> Vec<ParamShape> {
    let lora = spec.recipe.lora.as_ref();
    let base_trainable = lora.is_none();
    let small = Init::Normal(0.02);
    let mut v = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, init: Init, trainable: bool| {
        v.push(ParamShape {
            name,
            shape,
            init,
            trainable,
        })
    };
    let h = d.hidden;
    push(
        "x_embedder.proj.weight".into(),
        vec![h, d.patch_in()],
        Init::XavierUniform,
        base_trainable,
    );
    push(
        "x_embedder.proj.bias".into(),
        vec![h],
        Init::Zeros,
        base_trainable,
    );
    push(
        "pos_embed".into(),
        vec![d.tokens, h],
        Init::SinCos2d {
            rows: d.rows,
            cols: d.cols,
        },
        false,
    );
    push(
        "t_embedder.mlp.0.weight".into(),
        vec![h, d.freq],
        small,
        base_trainable,
    );
    push(
        "t_embedder.mlp.0.bias".into(),
        vec![h],
        Init::Zeros,
        base_trainable,
    );
    push(
        "t_embedder.mlp.2.weight".into(),
        vec![h, h],
        small,
        base_trainable,
    );
    push(
        "t_embedder.mlp.2.bias".into(),
        vec![h],
        Init::Zeros,
        base_trainable,
    );
    push(
        "y_embedder.embedding_table.weight".into(),
        vec![d.label_rows, h],
        small,
        base_trainable,
    );
    for i in 0..d.depth {
        for (name, target) in BLOCK_LINEARS {
            let (out, inp) = block_linear_shape(d, target);
            let w_init = if target == LoraTarget::Adaln {
                small
            } else {
                Init::XavierUniform
            };
            push(
                format!("blocks.{i}.{name}.weight"),
                vec![out, inp],
                w_init,
                base_trainable,
            );
            push(
                format!("blocks.{i}.{name}.bias"),
                vec![out],
                Init::Zeros,
                base_trainable,
            );
            if let Some(l) = lora {
                if l.targets.contains(&target) {
                    let r = l.rank as usize;
                    let bound = 1.0 / (inp as f64).sqrt();
                    push(
                        format!("blocks.{i}.{name}.lora_a"),
                        vec![r, inp],
                        Init::Uniform(bound),
                        true,
                    );
                    push(
                        format!("blocks.{i}.{name}.lora_b"),
                        vec![out, r],
                        Init::Zeros,
                        true,
                    );
                }
            }
        }
    }
    push(
        "final_layer.linear.weight".into(),
        vec![d.patch_out(), h],
        small,
        base_trainable,
    );
    push(
        "final_layer.linear.bias".into(),
        vec![d.patch_out()],
        Init::Zeros,
        base_trainable,
    );
    push(
        "final_layer.adaLN_modulation.1.weight".into(),
        vec![2 * h, h],
        small,
        base_trainable,
    );
    push(
        "final_layer.adaLN_modulation.1.bias".into(),
        vec![2 * h],
        Init::Zeros,
        base_trainable,
    );
    v
}
