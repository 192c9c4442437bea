//! Which PyTorch the budget describes: the device and the `scaled_dot_product_attention` kernel
//! that really runs [SDPA] (the rule sources are listed in the folder's `mod.rs`).

use crate::spec::{Dtype, Precision, Runtime, SdpaBackend, Spec, TorchDevice};

/// The PyTorch runtime on one device with one SDPA backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PyTorch {
    pub device: TorchDevice,
    pub sdpa: SdpaBackend,
}

/// Bytes of a CUDA context with cuBLAS and cuDNN handles loaded, as `nvidia-smi` shows it beside
/// the caching allocator's reserved memory. An order of magnitude, not a measurement of this
/// project: it depends on the driver, the GPU and the loaded kernels (typically 300–600 MiB).
pub(crate) const CUDA_CONTEXT_BYTES: u64 = 500 << 20;

impl PyTorch {
    /// The instance for a device and backend (a `'static` reference, as `model_for` returns).
    pub(crate) fn instance(device: TorchDevice, sdpa: SdpaBackend) -> &'static PyTorch {
        use SdpaBackend as S;
        use TorchDevice as D;
        match (device, sdpa) {
            (D::Cpu, S::Auto) => &PyTorch {
                device: D::Cpu,
                sdpa: S::Auto,
            },
            (D::Cpu, S::Flash) => &PyTorch {
                device: D::Cpu,
                sdpa: S::Flash,
            },
            (D::Cpu, S::Efficient) => &PyTorch {
                device: D::Cpu,
                sdpa: S::Efficient,
            },
            (D::Cpu, S::Cudnn) => &PyTorch {
                device: D::Cpu,
                sdpa: S::Cudnn,
            },
            (D::Cpu, S::Math) => &PyTorch {
                device: D::Cpu,
                sdpa: S::Math,
            },
            (D::Cuda, S::Auto) => &PyTorch {
                device: D::Cuda,
                sdpa: S::Auto,
            },
            (D::Cuda, S::Flash) => &PyTorch {
                device: D::Cuda,
                sdpa: S::Flash,
            },
            (D::Cuda, S::Efficient) => &PyTorch {
                device: D::Cuda,
                sdpa: S::Efficient,
            },
            (D::Cuda, S::Cudnn) => &PyTorch {
                device: D::Cuda,
                sdpa: S::Cudnn,
            },
            (D::Cuda, S::Math) => &PyTorch {
                device: D::Cuda,
                sdpa: S::Math,
            },
        }
    }

    /// The SDPA kernel that really runs for this precision (\[SDPA\]): the CPU has one fused kernel
    /// (flash); CUDA flash needs fp16/bf16, so `auto` picks memory-efficient for fp32.
    pub(crate) fn effective_sdpa(&self, precision: Precision) -> SdpaBackend {
        let half = matches!(precision.compute_dtype(), Dtype::Bf16 | Dtype::F16);
        match (self.device, self.sdpa) {
            (_, SdpaBackend::Math) => SdpaBackend::Math,
            (TorchDevice::Cpu, _) => SdpaBackend::Flash,
            (TorchDevice::Cuda, SdpaBackend::Auto) if half => SdpaBackend::Flash,
            (TorchDevice::Cuda, SdpaBackend::Auto) => SdpaBackend::Efficient,
            (TorchDevice::Cuda, SdpaBackend::Flash) if !half => SdpaBackend::Efficient,
            (TorchDevice::Cuda, b) => b,
        }
    }
}

/// The runtime a spec names (the CPU default when the spec names another runtime).
pub(crate) fn for_spec(spec: &Spec) -> &'static PyTorch {
    match spec.runtime {
        Runtime::Pytorch { device, sdpa } => PyTorch::instance(device, sdpa),
        _ => PyTorch::instance(TorchDevice::Cpu, SdpaBackend::Auto),
    }
}
