//! The parameter table of a model: every tensor with its diffusers name, shape, kind and module
//! group ([`FamilyTensor`]), the builder the family files fill ([`Table`]), and the totals per
//! group ([`FamilyCounts`]) and in bytes for the common recipes ([`StateBytes`]).

use serde::Serialize;

/// Whether a tensor is a parameter or a buffer, as diffusers registers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TensorKind {
    /// `nn.Parameter`: counted by `model.parameters()`.
    Param,
    /// A buffer in the state dict (SD3's cropped position table).
    Buffer,
    /// A non-persistent buffer (`persistent=False`): recomputed at init, not in the checkpoint.
    BufferNonPersistent,
}

impl TensorKind {
    /// The peer's spelling (`count_params.py`).
    pub const fn peer_name(self) -> &'static str {
        match self {
            TensorKind::Param => "param",
            TensorKind::Buffer => "buffer",
            TensorKind::BufferNonPersistent => "buffer-np",
        }
    }

    /// In a checkpoint's safetensors (the state dict).
    pub const fn in_state_dict(self) -> bool {
        !matches!(self, TensorKind::BufferNonPersistent)
    }
}

/// The module group of a tensor, for per-group totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Group {
    PatchEmbed,
    PosEmbed,
    TimeEmbed,
    ClassEmbed,
    TextEmbed,
    Blocks,
    SingleBlocks,
    FinalLayer,
    Rope,
}

impl Group {
    pub const fn name(self) -> &'static str {
        match self {
            Group::PatchEmbed => "patch embed",
            Group::PosEmbed => "position table (fixed sin-cos)",
            Group::TimeEmbed => "timestep / guidance embed",
            Group::ClassEmbed => "label embed",
            Group::TextEmbed => "text / caption embed",
            Group::Blocks => "transformer blocks",
            Group::SingleBlocks => "single-stream blocks",
            Group::FinalLayer => "final layer",
            Group::Rope => "RoPE tables (fixed)",
        }
    }
}

/// One tensor of a family's model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FamilyTensor {
    /// The diffusers / PEFT module name (`transformer_blocks.0.attn.to_q.weight`).
    pub name: String,
    pub shape: Vec<u64>,
    pub kind: TensorKind,
    pub group: Group,
    /// Block index within its ModuleList, for block tensors.
    pub block: Option<u32>,
    /// A parameter that is never trained (`requires_grad=False`: the original DiT's sin-cos table).
    pub fixed: bool,
}

impl FamilyTensor {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Totals of one module group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GroupCount {
    pub group: Group,
    pub name: &'static str,
    pub parameters: u64,
    pub buffers: u64,
}

/// Totals of a family's table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FamilyCounts {
    /// `sum(p.numel() for p in model.parameters())`.
    pub parameters: u64,
    /// Parameters with `requires_grad=True` (all but the original DiT's fixed table).
    pub trainable: u64,
    /// `sum(b.numel() for b in model.buffers())`: fixed position / RoPE tables.
    pub buffers: u64,
    /// The buffers a checkpoint stores (persistent).
    pub persistent_buffers: u64,
    pub tensors: usize,
    pub per_group: Vec<GroupCount>,
}

/// Totals of a table, groups in first-seen order.
pub fn count(table: &[FamilyTensor]) -> FamilyCounts {
    let mut c = FamilyCounts {
        parameters: 0,
        trainable: 0,
        buffers: 0,
        persistent_buffers: 0,
        tensors: table.len(),
        per_group: Vec::new(),
    };
    for t in table {
        let n = t.numel();
        let i = match c.per_group.iter().position(|g| g.group == t.group) {
            Some(i) => i,
            None => {
                c.per_group.push(GroupCount {
                    group: t.group,
                    name: t.group.name(),
                    parameters: 0,
                    buffers: 0,
                });
                c.per_group.len() - 1
            }
        };
        match t.kind {
            TensorKind::Param => {
                c.parameters += n;
                c.per_group[i].parameters += n;
                if !t.fixed {
                    c.trainable += n;
                }
            }
            TensorKind::Buffer | TensorKind::BufferNonPersistent => {
                c.buffers += n;
                c.per_group[i].buffers += n;
                if t.kind.in_state_dict() {
                    c.persistent_buffers += n;
                }
            }
        }
    }
    c
}

/// Bytes of the model state under one common recipe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StateBytes {
    pub recipe: &'static str,
    /// What is counted, in words.
    pub what: &'static str,
    pub bytes: u64,
}

/// The model state of the common recipes (weights, gradients and optimizer state; no activations).
///
/// - bf16 weights: every parameter and buffer in bf16 (2 B), as a frozen base or for inference.
/// - fp32 weights: 4 B each.
/// - full fine-tune with AdamW under mixed precision: fp32 master weights, fp32 gradients and
///   AdamW's m and v (4 + 4 + 4 + 4 = 16 B per trainable parameter); fixed parameters and buffers
///   4 B (fp32, no gradient, no state).
pub fn state_bytes(c: &FamilyCounts) -> Vec<StateBytes> {
    let fixed = c.parameters - c.trainable;
    vec![
        StateBytes {
            recipe: "bf16-weights",
            what: "parameters + buffers in bf16 (2 B)",
            bytes: 2 * (c.parameters + c.buffers),
        },
        StateBytes {
            recipe: "fp32-weights",
            what: "parameters + buffers in fp32 (4 B)",
            bytes: 4 * (c.parameters + c.buffers),
        },
        StateBytes {
            recipe: "adamw-full-fine-tune",
            what:
                "fp32 master + fp32 grads + AdamW m, v (16 B per trained parameter); buffers fp32",
            bytes: 16 * c.trainable + 4 * (fixed + c.buffers),
        },
    ]
}

/// The table being built: helpers that name tensors as diffusers does.
#[derive(Default)]
pub(crate) struct Table(pub(crate) Vec<FamilyTensor>);

impl Table {
    pub(crate) fn push(&mut self, name: String, shape: Vec<u64>, group: Group, block: Option<u32>) {
        self.0.push(FamilyTensor {
            name,
            shape,
            kind: TensorKind::Param,
            group,
            block,
            fixed: false,
        });
    }

    pub(crate) fn buffer(&mut self, name: &str, shape: Vec<u64>, kind: TensorKind, group: Group) {
        self.0.push(FamilyTensor {
            name: name.into(),
            shape,
            kind,
            group,
            block: None,
            fixed: false,
        });
    }

    /// `nn.Linear(inp, out, bias)` at `prefix` (`prefix.weight` (out, inp), `prefix.bias` (out)).
    pub(crate) fn linear(
        &mut self,
        prefix: &str,
        out: u64,
        inp: u64,
        bias: bool,
        group: Group,
        block: Option<u32>,
    ) {
        self.push(format!("{prefix}.weight"), vec![out, inp], group, block);
        if bias {
            self.push(format!("{prefix}.bias"), vec![out], group, block);
        }
    }

    /// A norm with a weight of `dim` (RMSNorm) and optionally a bias (LayerNorm).
    pub(crate) fn norm(
        &mut self,
        prefix: &str,
        dim: u64,
        bias: bool,
        group: Group,
        block: Option<u32>,
    ) {
        self.push(format!("{prefix}.weight"), vec![dim], group, block);
        if bias {
            self.push(format!("{prefix}.bias"), vec![dim], group, block);
        }
    }

    /// `nn.Linear(inp, out)` with a bias, outside the blocks.
    pub(crate) fn top_linear(&mut self, prefix: &str, out: u64, inp: u64, group: Group) {
        self.linear(prefix, out, inp, true, group, None);
    }

    /// `nn.Conv2d` / `nn.Conv3d(inp, out, kernel, groups)` at `prefix`: `prefix.weight` of `shape`
    /// (out, inp / groups, *kernel), `prefix.bias` (out).
    pub(crate) fn conv(
        &mut self,
        prefix: &str,
        shape: Vec<u64>,
        bias: bool,
        group: Group,
        block: Option<u32>,
    ) {
        let out = shape[0];
        self.push(format!("{prefix}.weight"), shape, group, block);
        if bias {
            self.push(format!("{prefix}.bias"), vec![out], group, block);
        }
    }
}
