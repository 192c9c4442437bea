//! `ditmem_recipe.py`: the code a `--launcher custom` plan needs in your own train script for
//! what no diffusers script flag does — exactly blocks i…j checkpointed, an NF4 base, the LoRA
//! targets — written by ditmem (not copied from elsewhere). `bench/ecosystem/check.py` compiles
//! it.

use crate::spec::{BaseQuant, Recompute, Spec};

/// The module's text for `spec`: the plan's constants, then [`RECIPE_FUNCTIONS`].
pub(crate) fn recipe_py(spec: &Spec, model_id: Option<&str>) -> String {
    let r = &spec.recipe;
    let depth = spec.model.depth;
    let blocks: Vec<String> = match &r.recompute {
        Recompute::None | Recompute::AttentionOnly => Vec::new(),
        rc => (0..depth)
            .filter(|&i| rc.recomputes_block(i))
            .map(|i| i.to_string())
            .collect(),
    };
    let lora = match &r.lora {
        Some(l) => format!(
            "LORA_RANK = {}\nLORA_TARGETS = [{}]  # PEFT target_modules; empty: the family's default\n",
            l.rank,
            l.modules
                .iter()
                .map(|m| format!("{m:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        None => "LORA_RANK = None\nLORA_TARGETS = []\n".to_string(),
    };
    format!(
        r#""""Code for a ditmem plan that no diffusers script flag realises: import it in your own
train script. Written by `ditmem plan --launcher custom --emit-dir`.

Plan: {name} at {h}x{w}, microbatch {micro}, accumulation {acc}, {ranks} process(es),
precision {prec}, recompute {rc}, base {quant}.
"""
import torch
from torch.utils.checkpoint import checkpoint

MODEL_ID = {model_id}
# The blocks the plan recomputes, counted in the order forward runs them.
RECOMPUTE_BLOCKS = [{blocks}]
BASE_QUANT = {base_quant}
{lora}"#,
        name = spec.model.name,
        h = spec.workload.height,
        w = spec.workload.width,
        micro = spec.workload.microbatch,
        acc = spec.workload.accumulation,
        ranks = spec.workload.ranks,
        prec = r.precision,
        rc = r.recompute,
        quant = r.base_quant.name(),
        model_id = match model_id {
            Some(id) => format!("{id:?}"),
            None => "None  # your checkpoint".to_string(),
        },
        blocks = blocks.join(", "),
        base_quant = if r.base_quant == BaseQuant::Nf4 {
            "\"nf4\""
        } else {
            "None"
        },
    ) + RECIPE_FUNCTIONS
}

/// The functions of `ditmem_recipe.py`, which read the plan's constants above them: written
/// top to bottom as the file holds them.
const RECIPE_FUNCTIONS: &str = r#"

def transformer_blocks(transformer):
    """Every transformer block in the order forward runs them (Flux: the double-stream
    `transformer_blocks`, then `single_transformer_blocks`)."""
    blocks = []
    for name in ("transformer_blocks", "single_transformer_blocks", "blocks"):
        blocks.extend(list(getattr(transformer, name, None) or []))
    return blocks


def checkpoint_blocks(transformer, indices=RECOMPUTE_BLOCKS):
    """Recompute exactly these blocks in backward (torch.utils.checkpoint, non-reentrant),
    keeping the others' activations; the parameter names do not change. Do not also call
    transformer.enable_gradient_checkpointing(), which checkpoints every block."""
    blocks = transformer_blocks(transformer)
    for i in indices:
        block = blocks[i]
        forward = block.forward

        def run(*args, _forward=forward, _block=block, **kwargs):
            if torch.is_grad_enabled() and _block.training:
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return _forward(*args, **kwargs)

        block.forward = run
    return transformer


def load_transformer(transformer_cls, model_id=MODEL_ID, weight_dtype=torch.bfloat16):
    """The frozen base as the plan stores it: NF4 with double quantization (bitsandbytes, as
    QLoRA) when BASE_QUANT is "nf4", else in weight_dtype."""
    kwargs = dict(subfolder="transformer", torch_dtype=weight_dtype)
    if BASE_QUANT == "nf4":
        from diffusers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=weight_dtype,
        )
    transformer = transformer_cls.from_pretrained(model_id, **kwargs)
    transformer.requires_grad_(False)
    return transformer


def add_lora(transformer, rank=LORA_RANK, targets=LORA_TARGETS):
    """LoRA adapters of the plan's rank on the plan's targets (PEFT), the base frozen."""
    from peft import LoraConfig

    config = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                        target_modules=list(targets))
    transformer.add_adapter(config)
    return transformer
"#;
