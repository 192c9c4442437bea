//! The time model: predicted seconds of one optimizer step from FLOPs and bytes moved.
//!
//! Matmul FLOPs come from the spec (forward, backward = two matmuls per trained linear and one per
//! frozen one, recompute adds the forward of what is rebuilt, memory-efficient attention re-forms
//! its scores in backward). Elementwise work comes from the op inventory (every buffer an op writes
//! is written once and read about once more). A microbatch adds a fixed overhead, sharding adds
//! communication over a stated link bandwidth. The rates belong to a [`DeviceProfile`]; the
//! ranking of plans depends on their ratios, the absolute seconds on the machine.

use serde::{Deserialize, Serialize};

use crate::denoiser::param_table;
use crate::params::ParamRole;
use crate::runtime::{model_for, Shape};
use crate::segment::{Segment, TensorKind};
use crate::spec::{AttentionMode, Dtype, LoraTarget, Optimizer, Recompute, Spec};

/// Throughputs of the machine a plan is ranked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceProfile {
    pub name: String,
    /// Matmul FLOP/s by compute dtype.
    pub matmul_f64: f64,
    pub matmul_f32: f64,
    /// fp32 matmuls and convolutions on TF32 tensor cores, where the device has them (absent:
    /// the fp32 rate). Used for fp32 matmuls when the recipe allows TF32 (`recipe.tf32`) and for
    /// fp32 convolutions always (cuDNN's `torch.backends.cudnn.allow_tf32` defaults to True).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matmul_tf32: Option<f64>,
    pub matmul_bf16: f64,
    pub matmul_f16: f64,
    /// Elementwise elements/s by dtype (half types are emulated on CPUs without half units).
    pub elementwise_f64: f64,
    pub elementwise_f32: f64,
    pub elementwise_half: f64,
    /// Fixed cost of one forward+backward pass (dispatch, allocation, thread barriers).
    pub microbatch_overhead_s: f64,
    /// Bytes/s per direction between the ranks of a node for gradient reduction and ZeRO /
    /// FSDP gathers.
    pub link_bytes_per_s: f64,
    /// Bytes/s per direction between nodes (rings over more than
    /// [`crate::gpu::GPUS_PER_NODE`] ranks run at the slower of the two); default InfiniBand
    /// NDR.
    #[serde(default = "default_inter_node")]
    pub inter_node_bytes_per_s: f64,
    /// Bytes/s per direction between device and host (offload's copies); default PCIe 4.0 x16.
    #[serde(default = "default_host_link")]
    pub host_link_bytes_per_s: f64,
}

fn default_inter_node() -> f64 {
    crate::gpu::IB_NDR.bytes_per_s
}

fn default_host_link() -> f64 {
    crate::gpu::PCIE4_X16.bytes_per_s
}

/// Share of a GPU's dense matmul peak the GPU profile assumes (see [`DeviceProfile::for_gpu`]).
pub(crate) const GPU_MATMUL_EFFICIENCY: f64 = 0.6;
/// Share of a GPU's memory bandwidth elementwise ops are assumed to reach.
pub(crate) const GPU_BANDWIDTH_EFFICIENCY: f64 = 0.8;
/// Kernel-launch cost of one forward+backward pass on a GPU (≈ 2,000 launches × 5 µs).
pub(crate) const GPU_PASS_OVERHEAD_S: f64 = 0.01;

impl DeviceProfile {
    /// The rate a ring collective over `ranks` ranks runs at: the slowest link it crosses (the
    /// node's link, and between nodes beyond [`crate::gpu::GPUS_PER_NODE`] ranks the slower of it
    /// and the inter-node link).
    pub(crate) fn ring_bytes_per_s(&self, ranks: u32) -> f64 {
        if ranks > crate::gpu::GPUS_PER_NODE {
            self.link_bytes_per_s.min(self.inter_node_bytes_per_s)
        } else {
            self.link_bytes_per_s
        }
    }

    /// The 2-core CPU this project runs on, measured by
    /// `cargo bench -p ditmem-engine --bench calibrate` (see that bench for the method).
    ///
    /// Conditions: AMD EPYC, 2 vCPUs (candle's default threading), candle 0.11 CPU, release
    /// build, median of 5 runs after a warm-up, while other builds shared the machine (load ≈ 2;
    /// a run under load ≈ 6.5 gave 25–30 % lower matmul rates — the ranking of plans depends on
    /// the ratios, which held). Matmul: geometric mean over a block's qkv and fc1 shapes at
    /// D = 384 and 1152 and the batched attention scores. Elementwise: geometric mean of add,
    /// mul, exp, gelu, a row sum and a cast, as 2·elements/s (the model charges two passes per
    /// element an op writes); `elementwise_half` is the mean of bf16 (0.72) and f16 (0.29).
    /// Microbatch overhead: a tiny step in 8 passes vs 1, per extra pass. The link rate is not
    /// measured (one machine): 10 GB/s stands for a PCIe-class link.
    pub fn cpu_default() -> DeviceProfile {
        DeviceProfile {
            name: "cpu-2core (candle 0.11, measured)".into(),
            matmul_f64: 44.4e9,
            matmul_f32: 84.3e9,
            matmul_tf32: None,
            matmul_bf16: 86.1e9,
            matmul_f16: 68.0e9,
            elementwise_f64: 0.58e9,
            elementwise_f32: 2.36e9,
            elementwise_half: 0.51e9,
            microbatch_overhead_s: 0.0029,
            link_bytes_per_s: 10e9,
            inter_node_bytes_per_s: default_inter_node(),
            host_link_bytes_per_s: default_host_link(),
        }
    }

    /// A catalog GPU as a roofline: the catalog's dense FLOP/s and bandwidth (datasheets, with
    /// their sources in `ditmem gpus NAME`) times efficiency factors that are **assumptions of
    /// this model, not measurements of this project** (no GPU was lent to it):
    /// - matmuls at [`GPU_MATMUL_EFFICIENCY`] of the dense peak (large cuBLAS GEMMs in published
    ///   benchmarks reach 60–80 % of it; attention and small shapes less). fp32 matmuls run at the
    ///   card's TF32 tensor-core rate when the recipe allows TF32 (`recipe.tf32`, on by default
    ///   as DiT's `train.py` and the diffusers scripts' `--allow_tf32` set it; PyTorch's own
    ///   default is off since 1.12), else at the fp32 rate; fp32 convolutions (a VAE encoder)
    ///   at the TF32 rate always: cuDNN's `allow_tf32` defaults to True. The catalog has no fp64
    ///   rate: fp64 is taken at 1/64 of fp32 (the GeForce / L-series ratio; A100 and H100 run it
    ///   at half of fp32 — fp64 training on a GPU is not what this profile is for);
    /// - elementwise ops bandwidth-bound at [`GPU_BANDWIDTH_EFFICIENCY`] of the peak, one read
    ///   and one write of the element (the model charges two passes per element an op writes);
    /// - [`GPU_PASS_OVERHEAD_S`] per forward+backward pass for kernel launches;
    /// - the links of the card (`gpu::links_for`): NVLink within a node where the board has
    ///   it, else PCIe; InfiniBand between nodes; PCIe to the host — datasheet rates per
    ///   direction, no efficiency factor.
    pub fn for_gpu(g: &crate::gpu::Gpu) -> DeviceProfile {
        let m = GPU_MATMUL_EFFICIENCY;
        let bw = g.bandwidth * GPU_BANDWIDTH_EFFICIENCY;
        let links = crate::gpu::links_for(g.name);
        let fp32 = g.flops.fp32;
        DeviceProfile {
            name: format!(
                "{} (roofline: datasheet peaks × {m} matmul, × {GPU_BANDWIDTH_EFFICIENCY} bandwidth; assumed, not measured)",
                g.name
            ),
            matmul_f64: fp32 / 64.0 * m,
            matmul_f32: fp32 * m,
            matmul_tf32: g.flops.tf32.map(|t| t * m),
            // Without bf16 units (T4, V100) PyTorch computes bf16 through fp32.
            matmul_bf16: g.flops.bf16.unwrap_or(fp32) * m,
            matmul_f16: g.flops.fp16.unwrap_or(fp32) * m,
            elementwise_f64: bw / 8.0,
            elementwise_f32: bw / 4.0,
            elementwise_half: bw / 2.0,
            microbatch_overhead_s: GPU_PASS_OVERHEAD_S,
            link_bytes_per_s: links.intra_node.bytes_per_s,
            inter_node_bytes_per_s: links.inter_node.bytes_per_s,
            host_link_bytes_per_s: links.host.bytes_per_s,
        }
    }

    /// Read a profile from TOML (or JSON by extension); every field is required and checked.
    pub fn from_file(path: &std::path::Path) -> Result<DeviceProfile, crate::error::SpecError> {
        use crate::error::SpecError;
        let text = std::fs::read_to_string(path).map_err(|e| SpecError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let is_json = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"));
        let p: DeviceProfile = if is_json {
            serde_json::from_str(&text).map_err(|e| SpecError::Parse {
                format: "JSON",
                message: format!("device profile: {e}"),
                location: String::new(),
            })?
        } else {
            toml::from_str(&text).map_err(|e| SpecError::Parse {
                format: "TOML",
                message: format!("device profile: {}", e.message().replace('\n', " ")),
                location: String::new(),
            })?
        };
        p.validate()?;
        Ok(p)
    }

    /// Every rate must be a positive finite number, the overhead finite and not negative.
    pub fn validate(&self) -> Result<(), crate::error::SpecError> {
        let rates = [
            ("matmul_f64", self.matmul_f64),
            ("matmul_f32", self.matmul_f32),
            ("matmul_bf16", self.matmul_bf16),
            ("matmul_f16", self.matmul_f16),
            ("elementwise_f64", self.elementwise_f64),
            ("elementwise_f32", self.elementwise_f32),
            ("elementwise_half", self.elementwise_half),
            ("link_bytes_per_s", self.link_bytes_per_s),
            ("inter_node_bytes_per_s", self.inter_node_bytes_per_s),
            ("host_link_bytes_per_s", self.host_link_bytes_per_s),
        ];
        let tf32 = self.matmul_tf32.map(|v| ("matmul_tf32", v));
        for (name, v) in rates.into_iter().chain(tf32) {
            if !(v.is_finite() && v > 0.0) {
                return Err(crate::error::SpecError::invalid(
                    format!("profile.{name}"),
                    format!("{v} is not a rate; allowed: a positive number per second"),
                ));
            }
        }
        if !(self.microbatch_overhead_s.is_finite() && self.microbatch_overhead_s >= 0.0) {
            return Err(crate::error::SpecError::invalid(
                "profile.microbatch_overhead_s",
                format!(
                    "{} is out of range; allowed: seconds ≥ 0",
                    self.microbatch_overhead_s
                ),
            ));
        }
        Ok(())
    }

    pub fn matmul_rate(&self, d: Dtype) -> f64 {
        match d {
            Dtype::F64 => self.matmul_f64,
            Dtype::F32 => self.matmul_f32,
            Dtype::Bf16 => self.matmul_bf16,
            Dtype::F16 | Dtype::U8 => self.matmul_f16,
        }
    }

    /// [`Self::matmul_rate`] with fp32 on TF32 tensor cores when `tf32` (and the device has them).
    pub(crate) fn matmul_rate_tf32(&self, d: Dtype, tf32: bool) -> f64 {
        match (d, tf32, self.matmul_tf32) {
            (Dtype::F32, true, Some(r)) => r,
            _ => self.matmul_rate(d),
        }
    }

    pub(crate) fn elementwise_rate(&self, d: Dtype) -> f64 {
        match d {
            Dtype::F64 => self.elementwise_f64,
            Dtype::F32 | Dtype::U8 => self.elementwise_f32,
            Dtype::Bf16 | Dtype::F16 => self.elementwise_half,
        }
    }
}

/// FLOPs of one block's forward on one microbatch, split into linears and the attention core.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BlockFlops {
    pub linears: f64,
    pub attention: f64,
    /// LoRA branches (always trained).
    pub lora: f64,
}

pub fn block_flops(spec: &Spec) -> BlockFlops {
    let d = Shape::new(spec);
    let (b, s, h) = (d.b as f64, d.s as f64, d.d as f64);
    let m = d.mlp as f64;
    let rows = b * s;
    let linears = 2.0 * rows * h * (3.0 * h + h + 2.0 * m) + 2.0 * b * h * 6.0 * h;
    let attention = 2.0 * 2.0 * b * s * s * h;
    let lora = match &spec.recipe.lora {
        Some(l) => {
            let r = f64::from(l.rank);
            l.targets
                .iter()
                .map(|t| {
                    let (i, o) = match t {
                        LoraTarget::Qkv => (h, 3.0 * h),
                        LoraTarget::Proj => (h, h),
                        LoraTarget::Fc1 => (h, m),
                        LoraTarget::Fc2 => (m, h),
                        LoraTarget::Adaln => (h, 6.0 * h),
                    };
                    let n = if *t == LoraTarget::Adaln { b } else { rows };
                    2.0 * n * r * (i + o)
                })
                .sum()
        }
        None => 0.0,
    };
    BlockFlops {
        linears,
        attention,
        lora,
    }
}

/// Predicted time of one step, by part.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepTime {
    pub forward_s: f64,
    pub backward_s: f64,
    pub recompute_s: f64,
    pub optimizer_s: f64,
    pub overhead_s: f64,
    pub communication_s: f64,
    pub encode_s: f64,
    pub total_s: f64,
}

/// The parts of a step's time that cost a table or graph build to compute. The planner computes
/// them once per combination of the levers they depend on and reuses them across candidates.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct TimeInputs {
    /// Trained parameter count (depends on the model and LoRA).
    pub trained_params: f64,
    /// Parameters a mixed policy casts to the compute dtype every forward: the trained ones
    /// (frozen weights are stored in the compute dtype already).
    pub cast_params: f64,
    /// Frozen block weights stored quantized (`recipe.base_quant`), dequantized to the compute
    /// dtype by bitsandbytes at every use: forward, a recomputed forward, backward (the input's
    /// gradient reads W).
    pub dequant_params: f64,
    /// Elementwise seconds of the embedder, one block and the final layer's forward, for one
    /// microbatch (depends on precision, attention, microbatch, LoRA and attention-only).
    pub elementwise_s: (f64, f64, f64),
}

impl TimeInputs {
    pub(crate) fn of(spec: &Spec, profile: &DeviceProfile) -> TimeInputs {
        let table = param_table(spec);
        let trained = table
            .iter()
            .filter(|t| t.role == ParamRole::Trained)
            .map(|t| t.numel() as f64)
            .sum();
        TimeInputs {
            trained_params: trained,
            cast_params: trained,
            dequant_params: dequant_params(spec, &table),
            elementwise_s: elementwise_forward_s(spec, profile),
        }
    }
}

/// Parameters a quantized base dequantizes at each use (0 without `recipe.base_quant`).
pub(crate) fn dequant_params(spec: &Spec, table: &[crate::params::ParamTensor]) -> f64 {
    if spec.recipe.base_quant.is_none() {
        return 0.0;
    }
    table
        .iter()
        .filter(|t| t.role == ParamRole::Frozen && crate::params::quantizable(t))
        .map(|t| t.numel() as f64)
        .sum()
}

/// Elementwise seconds of each segment's forward (embedder, one block, final layer).
pub(crate) fn elementwise_forward_s(spec: &Spec, profile: &DeviceProfile) -> (f64, f64, f64) {
    let rt = model_for(spec);
    let dims = Shape::new(spec);
    let seg_time = |seg: Segment| -> f64 {
        seg.ops
            .iter()
            .map(|op| {
                let t = &seg.tensors[op.output];
                if t.kind == TensorKind::Alloc {
                    // Written once and read about once: two passes over the elements.
                    2.0 * t.elems as f64 / profile.elementwise_rate(t.dtype)
                } else {
                    0.0
                }
            })
            .sum()
    };
    (
        seg_time(rt.embed_segment(&dims)),
        seg_time(rt.block_segment(&dims)),
        seg_time(rt.final_segment(&dims)),
    )
}

/// Predict the step time of a spec on a device.
pub fn step_time(spec: &Spec, profile: &DeviceProfile) -> StepTime {
    step_time_with(spec, profile, &TimeInputs::of(spec, profile))
}

/// [`step_time`] with its expensive inputs precomputed (they must come from
/// [`TimeInputs::of`] on a spec that agrees with `spec` in model, LoRA, precision, attention,
/// microbatch and whether recompute is attention-only).
pub(crate) fn step_time_with(
    spec: &Spec,
    profile: &DeviceProfile,
    inputs: &TimeInputs,
) -> StepTime {
    let r = &spec.recipe;
    let w = &spec.workload;
    let d = Shape::new(spec);
    let cd = r.precision.compute_dtype();
    let mm = profile.matmul_rate_tf32(cd, r.tf32);
    let f = block_flops(spec);
    let frozen_base = r.lora.is_some();
    let (ew_embed, ew_block, ew_final) = inputs.elementwise_s;
    let depth = f64::from(spec.model.depth);

    // Per microbatch.
    let block_fwd = (f.linears + f.attention + f.lora) / mm + ew_block;
    // Backward: input and weight gradients (2×) for trained linears, input only for a frozen
    // base; attention backward is two matmuls per forward matmul; elementwise about 2×.
    let lin_bwd = if frozen_base { 1.0 } else { 2.0 };
    let mut block_bwd =
        (lin_bwd * f.linears + 2.0 * f.attention + 2.0 * f.lora) / mm + 2.0 * ew_block;
    if r.attention == AttentionMode::MemoryEfficient {
        // Scores are formed again chunk by chunk in backward.
        block_bwd += 0.5 * f.attention / mm;
    }
    let recomputed = f64::from(r.recompute.recomputed_count(spec.model.depth));
    let mut recompute = recomputed * block_fwd;
    if r.recompute == Recompute::AttentionOnly {
        // The attention core's matmuls again; its elementwise share is not separated here.
        recompute += depth * (f.attention / mm);
    }
    let rows = d.b as f64 * d.s as f64;
    let outer_flops = 2.0 * rows * d.d as f64 * (d.c_in * d.patch2 + d.patch2 * d.c_out) as f64;
    let outer_fwd = outer_flops / mm + ew_embed + ew_final;
    let fwd = depth * block_fwd + outer_fwd;
    let bwd = depth * block_bwd + lin_bwd * outer_flops / mm + 2.0 * (ew_embed + ew_final);
    let acc = f64::from(w.accumulation);

    let trained = inputs.trained_params;
    let od = r.precision.optimizer_dtype();
    let per_elem_ops = match r.optimizer {
        Optimizer::AdamW => 12.0,
        // Dequantise m and v, update, requantise with a block absmax.
        Optimizer::AdamW8bit => 16.0,
        Optimizer::Sgd => 2.0,
    } + if r.ema.enabled { 3.0 } else { 0.0 };
    // The update, plus one gradient-accumulation add per microbatch.
    let optimizer = trained * per_elem_ops / profile.elementwise_rate(od)
        + acc * trained / profile.elementwise_rate(od);
    // Mixed precision casts the weights to the compute dtype on every forward (and again for a
    // recomputed block's forward).
    let recast = recomputed / depth.max(1.0);
    let casts = if r.precision.is_mixed() {
        acc * (1.0 + recast) * inputs.cast_params / profile.elementwise_rate(cd)
    } else {
        0.0
    } + acc * (2.0 + recast) * inputs.dequant_params / profile.elementwise_rate(cd);
    // Bytes moved between ranks and to the host (`sharding::comm_volume`, with its rules); ring
    // collectives over more than one node run at the slower link; nothing is assumed to overlap
    // with compute. Offload's host-side optimizer update is timed at the device's rates (no host
    // rate in the profile).
    let vol = crate::sharding::comm_volume(spec, trained, recomputed / depth.max(1.0));
    let link = profile.ring_bytes_per_s(w.ranks);
    let comm = vol.link_bytes / link + vol.host_bytes / profile.host_link_bytes_per_s;
    // The frozen encoders of each microbatch, each in its own dtype, priced as the transformer's
    // matmuls are (FLOPs at the card's rate × the same efficiency): a VAE's convolutions in fp32
    // on TF32 tensor cores (cuDNN's `allow_tf32` defaults to True, `torch/backends/cudnn`), a
    // text encoder's linears as the recipe's TF32 setting says.
    let encode: f64 = crate::encoders::encoder_runs(spec)
        .iter()
        .map(|e| acc * e.flops / profile.matmul_rate_tf32(e.dtype, e.conv || r.tf32))
        .sum();
    let overhead = acc * profile.microbatch_overhead_s;
    let t = StepTime {
        forward_s: acc * fwd + casts,
        backward_s: acc * bwd,
        recompute_s: acc * recompute,
        optimizer_s: optimizer,
        overhead_s: overhead,
        communication_s: comm,
        encode_s: encode,
        total_s: 0.0,
    };
    StepTime {
        total_s: t.forward_s
            + t.backward_s
            + t.recompute_s
            + t.optimizer_s
            + t.overhead_s
            + t.communication_s
            + t.encode_s,
        ..t
    }
}

#[cfg(test)] // the rows a test recomputes GPU_TIME_ERROR over
/// A published step time the time model is held against.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct PublishedStep {
    pub label: &'static str,
    pub precision: crate::spec::Precision,
    pub latents: crate::spec::Latents,
    /// The published training speed, steps per second.
    pub steps_per_s: f64,
}

#[cfg(test)] // the rows a test recomputes GPU_TIME_ERROR over
/// fast-DiT's A100 table (github.com/chuanyangjin/fast-DiT, README, "Improved Training
/// Performance"): DiT-XL/2 at 256², global batch 128 on one A100 (80 GB: the fp32 row holds
/// 44,045 MB), EMA, gradient checkpointing on every row, AdamW; its `train.py` sets
/// `torch.backends.cuda.matmul.allow_tf32 = True` (and cuDNN's) at the top. "mixed precision"
/// is `accelerate launch --mixed_precision fp16`; "feature pre-extraction" = cached latents.
pub(crate) const FAST_DIT_A100: [PublishedStep; 3] = [
    PublishedStep {
        label: "checkpointing, fp32, VAE in the step",
        precision: crate::spec::Precision::Fp32,
        latents: crate::spec::Latents::Encode,
        steps_per_s: 0.43,
    },
    PublishedStep {
        label: "checkpointing, fp16 mixed, VAE in the step",
        precision: crate::spec::Precision::Fp16Mixed,
        latents: crate::spec::Latents::Encode,
        steps_per_s: 0.56,
    },
    PublishedStep {
        label: "checkpointing, fp16 mixed, latents pre-extracted",
        precision: crate::spec::Precision::Fp16Mixed,
        latents: crate::spec::Latents::Cached,
        steps_per_s: 0.84,
    },
];

#[cfg(test)] // the rows a test recomputes GPU_TIME_ERROR over
/// The spec of a [`FAST_DIT_A100`] row on `pytorch:cuda` on an A100-80GB.
pub(crate) fn fast_dit_spec(row: &PublishedStep) -> Spec {
    let mut s = Spec::default_xl();
    s.workload.batch = 128;
    s.workload.microbatch = 128;
    s.workload.accumulation = 1;
    s.recipe.precision = row.precision;
    s.recipe.latents = row.latents;
    s.recipe.recompute = Recompute::All;
    s.recipe.ema.enabled = true;
    s.recipe.tf32 = true;
    s.runtime = "pytorch:cuda".parse().expect("a runtime name");
    s.cuda = Some(crate::spec::CudaSpec {
        gpu: Some("a100-80gb".into()),
        alloc_conf: String::new(),
        gpu_memory: None,
    });
    s
}

/// The largest relative error of the GPU time model over [`FAST_DIT_A100`]
/// (|predicted / published − 1|), stated beside every predicted time on a card; a test
/// recomputes it. No rate or efficiency of the model was fitted to these rows.
pub const GPU_TIME_ERROR: f64 = 0.092;

/// How far a predicted time on `profile` is known to be off, in words for the CLI.
pub fn time_error_note(profile: &DeviceProfile) -> String {
    if profile.name.contains("roofline") {
        format!(
            "±{:.0} %, held against fast-DiT's 3 A100 rows",
            100.0 * GPU_TIME_ERROR
        )
    } else if *profile == DeviceProfile::cpu_default() {
        "calibrated on this 2-core CPU; not held against a GPU run".into()
    } else {
        "your --profile; error not known".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_over_two_nodes_runs_at_the_inter_node_link() {
        // 8 H100 SXM on one node ring over NVLink; 16 cross InfiniBand NDR.
        let p = DeviceProfile::for_gpu(crate::gpu::lookup("h100-sxm").unwrap());
        assert_eq!(p.ring_bytes_per_s(8), 450e9);
        assert_eq!(p.ring_bytes_per_s(16), 50e9);
        for g in crate::gpu::all() {
            let p = DeviceProfile::for_gpu(g);
            assert!(
                p.ring_bytes_per_s(16) <= p.ring_bytes_per_s(8),
                "{}",
                g.name
            );
        }
    }

    #[test]
    fn fast_dit_rows_within_the_stated_error() {
        let g = crate::gpu::lookup("a100-80gb").unwrap();
        let p = DeviceProfile::for_gpu(g);
        let mut worst = 0.0f64;
        for row in &FAST_DIT_A100 {
            let s = fast_dit_spec(row);
            s.validate().unwrap();
            let predicted = step_time(&s, &p).total_s;
            let published = 1.0 / row.steps_per_s;
            let ratio = predicted / published;
            eprintln!(
                "fast-DiT {}: predicted {predicted:.3} s, published {published:.3} s, ratio {ratio:.3}",
                row.label
            );
            assert!(
                (1.0 / 1.5..=1.5).contains(&ratio),
                "{}: {predicted} s vs {published} s",
                row.label
            );
            worst = worst.max((ratio - 1.0).abs());
        }
        assert!(
            (worst - GPU_TIME_ERROR).abs() < 0.005,
            "the stated error {GPU_TIME_ERROR} is not the worst row's {worst:.3}"
        );
    }

    #[test]
    fn tf32_prices_fp32_matmuls_at_the_tensor_core_rate() {
        let g = crate::gpu::lookup("a100-80gb").unwrap();
        let p = DeviceProfile::for_gpu(g);
        let mut s = fast_dit_spec(&FAST_DIT_A100[0]);
        s.recipe.latents = crate::spec::Latents::Cached;
        let on = step_time(&s, &p);
        s.recipe.tf32 = false;
        let off = step_time(&s, &p);
        // A100: 156 TF32 vs 19.5 fp32 TFLOP/s; the elementwise share is the same in both.
        assert!(off.total_s > 3.0 * on.total_s, "{off:?} vs {on:?}");
        // The VAE's convolutions run on TF32 either way (cuDNN's default).
        s.recipe.latents = crate::spec::Latents::Encode;
        let enc_off = step_time(&s, &p).encode_s;
        s.recipe.tf32 = true;
        assert_eq!(enc_off, step_time(&s, &p).encode_s);
        // A card without TF32 units and the CPU keep the fp32 rate.
        let t4 = DeviceProfile::for_gpu(crate::gpu::lookup("t4").unwrap());
        assert_eq!(t4.matmul_rate_tf32(Dtype::F32, true), t4.matmul_f32);
        let cpu = DeviceProfile::cpu_default();
        assert_eq!(cpu.matmul_rate_tf32(Dtype::F32, true), cpu.matmul_f32);
    }

    #[test]
    fn recompute_costs_time() {
        let p = DeviceProfile::cpu_default();
        let mut s = Spec::default_xl();
        let base = step_time(&s, &p).total_s;
        s.recipe.recompute = Recompute::All;
        let all = step_time(&s, &p).total_s;
        assert!(
            all > base * 1.2,
            "full recompute adds about a forward: {all} vs {base}"
        );
    }

    #[test]
    fn gmac_matches_the_paper() {
        // DiT-XL/2 at 256²: 118.6 GMAC forward (the paper's "Gflops"), at batch 1.
        let mut s = Spec::default_xl();
        s.workload.batch = 1;
        s.workload.microbatch = 1;
        let f = block_flops(&s);
        let d = 1152.0f64;
        let t = 256.0f64;
        let outer = t * d * 4.0 * (4.0 + 8.0) + 256.0 * d + d * d + 2.0 * d * d;
        let gmac = (28.0 * (f.linears + f.attention) / 2.0 + outer) / 1e9;
        assert!((gmac - 118.62).abs() < 0.01, "{gmac}");
    }
}
