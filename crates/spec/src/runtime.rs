//! Where the step runs ([`Runtime`]): the `ditmem-cpu` engine or PyTorch on a device
//! ([`TorchDevice`]) with an SDPA kernel ([`SdpaBackend`]), and a CUDA device's section
//! ([`CudaSpec`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::SpecError;
use crate::named::text_form;

/// Where the PyTorch step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TorchDevice {
    Cpu,
    Cuda,
}

impl TorchDevice {
    pub const fn name(self) -> &'static str {
        match self {
            TorchDevice::Cpu => "cpu",
            TorchDevice::Cuda => "cuda",
        }
    }
}

/// Which `scaled_dot_product_attention` kernel runs when the spec's attention is
/// `memory-efficient` (the `materialized` mode is the explicit `softmax(q·kᵀ)·v` of timm's
/// non-fused path, whatever this says).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SdpaBackend {
    /// PyTorch's own choice: CPU flash on the CPU; on CUDA flash for fp16/bf16, memory-efficient
    /// for fp32/fp64.
    Auto,
    Flash,
    Efficient,
    Cudnn,
    Math,
}

impl SdpaBackend {
    pub const ALL: [SdpaBackend; 5] = [
        SdpaBackend::Auto,
        SdpaBackend::Flash,
        SdpaBackend::Efficient,
        SdpaBackend::Cudnn,
        SdpaBackend::Math,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            SdpaBackend::Auto => "auto",
            SdpaBackend::Flash => "flash",
            SdpaBackend::Efficient => "efficient",
            SdpaBackend::Cudnn => "cudnn",
            SdpaBackend::Math => "math",
        }
    }
}

/// The executor whose memory the budget describes.
///
/// Each runtime has its own rules for what an op saves and allocates (see
/// the budget's `RuntimeModel` trait, `runtime/model.rs`); adding one means adding a variant and its rules.
/// Written as a string: `ditmem-cpu`, or `pytorch[:cpu|:cuda][:sdpa-auto|flash|efficient|cudnn|math]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(try_from = "String", into = "String")]
pub enum Runtime {
    /// The ditmem engine (candle) on the CPU.
    #[default]
    DitmemCpu,
    /// PyTorch eager autograd (see `runtime::pytorch`).
    Pytorch {
        device: TorchDevice,
        sdpa: SdpaBackend,
    },
}

impl Runtime {
    pub const fn name(self) -> &'static str {
        match self {
            Runtime::DitmemCpu => "ditmem-cpu",
            Runtime::Pytorch { .. } => "pytorch",
        }
    }
}

impl fmt::Display for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Runtime::DitmemCpu => f.write_str("ditmem-cpu"),
            Runtime::Pytorch { device, sdpa } => {
                write!(f, "pytorch:{}", device.name())?;
                if *sdpa != SdpaBackend::Auto {
                    write!(f, ":sdpa-{}", sdpa.name())?;
                }
                Ok(())
            }
        }
    }
}

text_form!(Runtime);

impl FromStr for Runtime {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        let bad = |why: String| {
            SpecError::invalid(
                "runtime",
                format!("'{s}' {why}; allowed: ditmem-cpu, pytorch[:cpu|:cuda][:sdpa-auto|sdpa-flash|sdpa-efficient|sdpa-cudnn|sdpa-math] (the sdpa- prefix may be left out)"),
            )
        };
        match s {
            "ditmem-cpu" | "ditmem" | "engine" => return Ok(Runtime::DitmemCpu),
            _ => {}
        }
        let mut parts = s.split(':');
        if parts.next() != Some("pytorch") {
            return Err(bad("is not a runtime".into()));
        }
        let (mut device, mut sdpa) = (TorchDevice::Cpu, SdpaBackend::Auto);
        for opt in parts {
            match opt {
                "cpu" => device = TorchDevice::Cpu,
                "cuda" => device = TorchDevice::Cuda,
                _ => {
                    // `sdpa-efficient` or, as the README writes it, `efficient`.
                    let name = opt.strip_prefix("sdpa-").unwrap_or(opt);
                    sdpa = SdpaBackend::ALL
                        .into_iter()
                        .find(|b| b.name() == name)
                        .ok_or_else(|| bad(format!("has an unknown option '{opt}'")))?;
                }
            }
        }
        Ok(Runtime::Pytorch { device, sdpa })
    }
}

/// Where a `pytorch:cuda` step runs: a GPU of the catalog (`ditmem gpus`) and the caching
/// allocator's `PYTORCH_CUDA_ALLOC_CONF`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CudaSpec {
    /// A catalog name (`h100-80gb`, `rtx-4090`, …); absent: no capacity to fit against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// `PYTORCH_CUDA_ALLOC_CONF` syntax, e.g. `expandable_segments:True` or
    /// `max_split_size_mb:128,roundup_power2_divisions:4`; empty: PyTorch's defaults.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub alloc_conf: String,
    /// The card's `total_memory` in bytes as the user's own torch prints it
    /// (`torch.cuda.get_device_properties(0).total_memory`, `--gpu-memory`): replaces the
    /// catalog's capacity; absent: the catalog's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_backends_with_or_without_the_sdpa_prefix() {
        for (text, long) in [
            ("pytorch:cuda:efficient", "pytorch:cuda:sdpa-efficient"),
            ("pytorch:cuda:math", "pytorch:cuda:sdpa-math"),
            ("pytorch:cuda:flash", "pytorch:cuda:sdpa-flash"),
        ] {
            assert_eq!(
                text.parse::<Runtime>().unwrap(),
                long.parse::<Runtime>().unwrap()
            );
        }
        assert!("pytorch:cuda:fast".parse::<Runtime>().is_err());
    }
}
