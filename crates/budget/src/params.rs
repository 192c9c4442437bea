//! Parameters per module: every tensor of the DiT with its shape, whether it is trained, and
//! its dtype under the recipe.
//!
//! Names follow the PyTorch reference (`facebookresearch/DiT` `models.py`), so a count here can be
//! held against `sum(p.numel() for p in model.parameters())` there.
//!
//! Twin: the engine's `model.rs` (`param_shapes`), which builds the same tensors under the same
//! names.

use serde::Serialize;

use crate::spec::{BaseQuant, Dtype, LoraTarget, Precision, Spec};

/// Whether the optimizer updates a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ParamRole {
    Trained,
    /// Counted by `model.parameters()` but never updated (the sin-cos table, a LoRA base).
    Frozen,
}

/// The module a parameter belongs to, for per-module totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Module {
    PatchEmbed,
    PosEmbed,
    TimestepEmbed,
    LabelEmbed,
    Blocks,
    FinalLayer,
    Lora,
    /// A diffusers model's caption / text projections.
    TextEmbed,
    /// A diffusers model's transformer blocks (Flux: its double-stream blocks).
    TransformerBlocks,
    /// Flux's single-stream blocks.
    SingleBlocks,
}

impl Module {
    pub const fn name(self) -> &'static str {
        match self {
            Module::PatchEmbed => "patch embed",
            Module::PosEmbed => "pos embed (sin-cos, frozen)",
            Module::TimestepEmbed => "timestep embedder",
            Module::LabelEmbed => "label embedder",
            Module::Blocks => "DiT blocks",
            Module::FinalLayer => "final layer",
            Module::Lora => "LoRA adapters",
            Module::TextEmbed => "text / caption embed",
            Module::TransformerBlocks => "transformer blocks",
            Module::SingleBlocks => "single-stream blocks",
        }
    }
}

/// One parameter tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ParamTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub role: ParamRole,
    pub module: Module,
    /// Block index for block parameters.
    pub block: Option<u32>,
    /// A buffer (`register_buffer`: a fixed position or RoPE table), not a parameter: not in
    /// `model.parameters()`, counted in [`ParamCounts::buffers`].
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub buffer: bool,
}

impl ParamTensor {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// The linears of a block: (name, out, in). LoRA targets are named after them.
pub(crate) fn block_linears(spec: &Spec) -> [(LoraTarget, &'static str, u64, u64); 5] {
    let d = u64::from(spec.model.hidden);
    let m = u64::from(spec.model.mlp_hidden());
    [
        (LoraTarget::Qkv, "attn.qkv", 3 * d, d),
        (LoraTarget::Proj, "attn.proj", d, d),
        (LoraTarget::Fc1, "mlp.fc1", m, d),
        (LoraTarget::Fc2, "mlp.fc2", d, m),
        (LoraTarget::Adaln, "adaLN_modulation.1", 6 * d, d),
    ]
}

/// Every parameter tensor of the model under the spec, in module order.
///
/// Token count only enters through the frozen position table, so the resolution must be valid
/// (the spec is validated before this is called).
pub fn param_table(spec: &Spec) -> Vec<ParamTensor> {
    let m = &spec.model;
    let d = u64::from(m.hidden);
    let p2 = u64::from(m.patch) * u64::from(m.patch);
    let c_in = u64::from(m.in_channels);
    let c_out = u64::from(m.out_channels());
    let tokens = spec.tokens().unwrap_or(0);
    let lora = spec.recipe.lora.as_ref();
    // Under LoRA the whole base model is frozen; only the adapters train.
    let base = if lora.is_some() {
        ParamRole::Frozen
    } else {
        ParamRole::Trained
    };
    let mut t = TableBuilder::default();
    t.linear(
        "x_embedder.proj",
        d,
        c_in * p2,
        base,
        Module::PatchEmbed,
        None,
    );
    let pos = "pos_embed".to_string();
    t.tensor(
        pos,
        vec![1, tokens, d],
        ParamRole::Frozen,
        Module::PosEmbed,
        None,
    );
    let f = u64::from(m.freq_embed);
    t.linear("t_embedder.mlp.0", d, f, base, Module::TimestepEmbed, None);
    t.linear("t_embedder.mlp.2", d, d, base, Module::TimestepEmbed, None);
    let labels = "y_embedder.embedding_table.weight".to_string();
    t.tensor(
        labels,
        vec![u64::from(m.label_rows()), d],
        base,
        Module::LabelEmbed,
        None,
    );
    for i in 0..m.depth {
        for (target, name, out, inp) in block_linears(spec) {
            let name = format!("blocks.{i}.{name}");
            t.linear(&name, out, inp, base, Module::Blocks, Some(i));
            if let Some(l) = lora.filter(|l| l.targets.contains(&target)) {
                let r = u64::from(l.rank);
                let (a, b) = (format!("{name}.lora_a"), format!("{name}.lora_b"));
                t.tensor(a, vec![r, inp], ParamRole::Trained, Module::Lora, Some(i));
                t.tensor(b, vec![out, r], ParamRole::Trained, Module::Lora, Some(i));
            }
        }
    }
    t.linear(
        "final_layer.linear",
        p2 * c_out,
        d,
        base,
        Module::FinalLayer,
        None,
    );
    let ada = "final_layer.adaLN_modulation.1";
    t.linear(ada, 2 * d, d, base, Module::FinalLayer, None);
    t.0
}

/// The tensors of [`param_table`] in the order they are added.
#[derive(Default)]
struct TableBuilder(Vec<ParamTensor>);

impl TableBuilder {
    fn tensor(
        &mut self,
        name: String,
        shape: Vec<u64>,
        role: ParamRole,
        module: Module,
        block: Option<u32>,
    ) {
        self.0.push(ParamTensor {
            name,
            shape,
            role,
            module,
            block,
            buffer: false,
        });
    }

    /// An `nn.Linear(inp, out)`: `{name}.weight` [out, inp], then `{name}.bias` [out].
    fn linear(
        &mut self,
        name: &str,
        out: u64,
        inp: u64,
        role: ParamRole,
        module: Module,
        block: Option<u32>,
    ) {
        self.tensor(
            format!("{name}.weight"),
            vec![out, inp],
            role,
            module,
            block,
        );
        self.tensor(format!("{name}.bias"), vec![out], role, module, block);
    }
}

/// Parameter totals.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ParamCounts {
    /// Everything `model.parameters()` reports, the frozen position table included.
    pub total: u64,
    pub trained: u64,
    pub frozen: u64,
    /// Elements of the largest trained tensor (sizes the optimizer's per-tensor workspace).
    pub largest_trained: u64,
    /// Elements of buffers (fixed position / RoPE tables registered with `register_buffer`):
    /// held by the model, not counted in `total`.
    #[serde(skip_serializing_if = "is_zero")]
    pub buffers: u64,
    pub per_module: Vec<ModuleCount>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModuleCount {
    pub module: Module,
    pub name: &'static str,
    pub trained: u64,
    pub frozen: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub buffers: u64,
}

pub fn count(table: &[ParamTensor]) -> ParamCounts {
    let mut per: Vec<ModuleCount> = Vec::new();
    let (mut trained, mut frozen, mut largest, mut buffers) = (0u64, 0u64, 0u64, 0u64);
    for t in table {
        let n = t.numel();
        let entry = match per.iter_mut().find(|e| e.module == t.module) {
            Some(e) => e,
            None => {
                per.push(ModuleCount {
                    module: t.module,
                    name: t.module.name(),
                    trained: 0,
                    frozen: 0,
                    buffers: 0,
                });
                per.last_mut().expect("just pushed")
            }
        };
        if t.buffer {
            buffers += n;
            entry.buffers += n;
            continue;
        }
        match t.role {
            ParamRole::Trained => {
                trained += n;
                entry.trained += n;
                largest = largest.max(n);
            }
            ParamRole::Frozen => {
                frozen += n;
                entry.frozen += n;
            }
        }
    }
    ParamCounts {
        total: trained + frozen,
        trained,
        frozen,
        largest_trained: largest,
        buffers,
        per_module: per,
    }
}

/// Dtype a parameter is stored in under a precision policy.
///
/// Trained tensors live in the policy's parameter dtype (fp32 masters under mixed precision).
/// Frozen tensors need no master: under mixed precision they are stored in the compute dtype,
/// as fine-tuning scripts do with a frozen base (`weight_dtype`), except the position table of
/// full fine-tuning, which is added to the fp32 residual stream and stays in the accumulation
/// dtype (under LoRA the stream, and the table with it, is in the compute dtype).
/// A buffer follows the model: kept in the parameter dtype, cast with the frozen base under
/// LoRA (the scripts' `transformer.to(dtype=weight_dtype)` casts buffers too).
pub(crate) fn stored_dtype(t: &ParamTensor, precision: Precision, lora: bool) -> Dtype {
    if t.buffer {
        return if lora {
            precision.compute_dtype()
        } else {
            precision.param_dtype()
        };
    }
    match t.role {
        ParamRole::Trained => precision.param_dtype(),
        // Added to the residual stream, in its dtype.
        ParamRole::Frozen if t.module == Module::PosEmbed => precision.stream_dtype(lora),
        ParamRole::Frozen => precision.compute_dtype(),
    }
}

/// Whether a tensor is a Linear weight inside the transformer blocks: what a quantized LoRA
/// base stores quantized (bitsandbytes replaces the blocks' `nn.Linear` modules; embedders,
/// norms and biases stay in the compute dtype).
pub(crate) fn quantizable(t: &ParamTensor) -> bool {
    matches!(
        t.module,
        Module::Blocks | Module::TransformerBlocks | Module::SingleBlocks
    ) && t.shape.len() == 2
        && t.name.ends_with(".weight")
        && !t.buffer
}

/// Bytes a tensor is stored in under the recipe: its dtype, or its quantized storage when it is
/// a frozen base's block Linear and the base is quantized.
pub(crate) fn stored_bytes(
    t: &ParamTensor,
    precision: Precision,
    lora: bool,
    quant: BaseQuant,
) -> u64 {
    if t.role == ParamRole::Frozen && quantizable(t) {
        if let Some(b) = quant.weight_bytes(t.shape[0], t.shape[1]) {
            return b;
        }
    }
    t.numel() * stored_dtype(t, precision, lora).size()
}

/// [`stored_bytes`] under a recipe: a trained tensor in [`crate::spec::Recipe::trained_dtype`]
/// (LoRA adapters kept in the weight dtype are not fp32).
pub(crate) fn stored_bytes_in(t: &ParamTensor, r: &crate::spec::Recipe) -> u64 {
    if t.role == ParamRole::Trained && !t.buffer {
        return t.numel() * r.trained_dtype().size();
    }
    stored_bytes(t, r.precision, r.lora.is_some(), r.base_quant)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{LoraSpec, ModelSpec};

    fn spec(preset: &str, res: u32) -> Spec {
        let mut s = Spec::default_xl();
        s.model = ModelSpec::preset(preset).unwrap();
        s.workload.height = res;
        s.workload.width = res;
        s
    }

    #[test]
    fn published_parameter_counts() {
        for (preset, total, trained) in [
            ("dit-s-2", 32_963_360, 32_865_056),
            ("dit-b-2", 130_512_416, 130_315_808),
            ("dit-l-2", 458_102_816, 457_840_672),
            ("dit-xl-2", 675_129_632, 674_834_720),
        ] {
            let c = count(&param_table(&spec(preset, 256)));
            assert_eq!(c.total, total, "{preset} total");
            assert_eq!(c.trained, trained, "{preset} trained");
            assert_eq!(c.frozen, total - trained, "{preset} frozen = pos table");
        }
        assert_eq!(
            count(&param_table(&spec("dit-xl-4", 256))).total,
            675_074_432
        );
        assert_eq!(
            count(&param_table(&spec("dit-xl-8", 256))).total,
            675_683_072
        );
    }

    #[test]
    fn block_count_matches_formula() {
        let s = spec("dit-xl-2", 256);
        let d = u64::from(s.model.hidden);
        let block0: u64 = param_table(&s)
            .iter()
            .filter(|t| t.block == Some(0))
            .map(ParamTensor::numel)
            .sum();
        assert_eq!(block0, 18 * d * d + 15 * d);
        assert_eq!(block0, 23_905_152);
    }

    #[test]
    fn no_learn_sigma_removes_output_half() {
        let mut s = spec("dit-xl-2", 256);
        s.model.learn_sigma = false;
        assert_eq!(count(&param_table(&s)).total, 675_129_632 - 18_448);
    }

    #[test]
    fn lora_freezes_base_and_trains_adapters() {
        let mut s = spec("dit-s-2", 256);
        s.recipe.lora = Some(LoraSpec {
            dtype: Default::default(),
            rank: 8,
            targets: vec![LoraTarget::Qkv],
            modules: Vec::new(),
        });
        let c = count(&param_table(&s));
        let d = 384u64;
        assert_eq!(c.trained, 12 * (8 * d + 3 * d * 8));
        assert_eq!(c.frozen, 32_963_360);
    }
}
