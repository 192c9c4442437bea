//! LoRA on a diffusers family's linears, as PEFT adds it (`LoraConfig(target_modules=…)` on the
//! transformer): one piece every family shares.
//!
//! - Which linears: a module is adapted when its full name equals a key of the recipe's module
//!   list (`ditmem_budget::denoiser::lora_modules`: the recipe's, or the diffusers training
//!   script's default) or ends with `.key` (PEFT's `check_target_module_exists`). Only 2-D
//!   weights (`nn.Linear`) are adapted; a conv weight (Sana's 1×1 convs) is not, as in the
//!   budget's table.
//! - Names and order: `{module}.lora_A.default.weight` (r × in) and
//!   `{module}.lora_B.default.weight` (out × r) right after the adapted weight, so the
//!   engine's inventory equals the budget's table (`ditmem_budget::denoiser::param_table`).
//! - Init: A uniform(±1/√in) (PEFT's kaiming-uniform with a = √5), B zeros, so the first
//!   forward is the base model's.
//! - The base is frozen (no gradient, no optimizer state, no EMA); the adapters train. The base
//!   and the branch run as one node (`LinearW::forward` → [`crate::ops::lora_linear`]:
//!   `x·Wᵀ + b + (x·Aᵀ)·Bᵀ`, scale 1 as `lora_alpha = rank` in the scripts).

use ditmem_spec::Spec;

use crate::shapes::{Init, ParamShape};

/// LoRA's rank and the module keys it adapts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraPlan {
    pub rank: usize,
    pub modules: Vec<String>,
}

impl LoraPlan {
    /// The plan of a family spec's recipe; None trains the full model.
    pub fn of(spec: &Spec) -> Option<LoraPlan> {
        spec.recipe.lora.as_ref().map(|l| LoraPlan {
            rank: l.rank as usize,
            modules: ditmem_budget::denoiser::lora_modules(spec),
        })
    }

    /// Whether LoRA adapts the linear `module` (its full name).
    pub fn adapts(&self, module: &str) -> bool {
        self.modules
            .iter()
            .any(|k| ditmem_budget::denoiser::matches_module(module, k))
    }
}

/// PEFT's names of the LoRA factors of the linear `module`: A (r × in), B (out × r).
pub(crate) fn lora_names(module: &str) -> [String; 2] {
    [
        format!("{module}.lora_A.default.weight"),
        format!("{module}.lora_B.default.weight"),
    ]
}

/// The indices of `module`'s adapters (A, B) when the model has them; `index` finds a tensor by
/// name.
pub(crate) fn factor_indices(
    index: &dyn Fn(&str) -> Option<usize>,
    module: &str,
) -> Option<(usize, usize)> {
    let [a, b] = lora_names(module);
    Some((index(&a)?, index(&b)?))
}

/// A family's full-model inventory under `plan`: every tensor frozen, each adapted linear
/// weight followed by its A and B (trained). Without a plan the inventory is returned as is.
pub(crate) fn adapt(shapes: Vec<ParamShape>, plan: Option<&LoraPlan>) -> Vec<ParamShape> {
    let Some(plan) = plan else {
        return shapes;
    };
    let mut v = Vec::with_capacity(shapes.len());
    for mut p in shapes {
        p.trainable = false;
        let adapted = match (p.name.strip_suffix(".weight"), p.shape.as_slice()) {
            (Some(m), &[out, inp]) if plan.adapts(m) => Some((lora_names(m), out, inp)),
            _ => None,
        };
        v.push(p);
        if let Some(([a, b], out, inp)) = adapted {
            let r = plan.rank;
            let bound = 1.0 / (inp as f64).sqrt();
            for (name, shape, init) in [
                (a, vec![r, inp], Init::Uniform(bound)),
                (b, vec![out, r], Init::Zeros),
            ] {
                v.push(ParamShape {
                    name,
                    shape,
                    init,
                    trainable: true,
                });
            }
        }
    }
    v
}
