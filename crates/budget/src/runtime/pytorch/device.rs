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

/// Every instance: the CPU's, one per backend in [`SdpaBackend::ALL`]'s order, then CUDA's.
static INSTANCES: [[PyTorch; SdpaBackend::ALL.len()]; 2] =
    [on_device(TorchDevice::Cpu), on_device(TorchDevice::Cuda)];

/// The instances of `device`, one per backend in [`SdpaBackend::ALL`]'s order.
const fn on_device(device: TorchDevice) -> [PyTorch; SdpaBackend::ALL.len()] {
    let mut row = [PyTorch {
        device,
        sdpa: SdpaBackend::Auto,
    }; SdpaBackend::ALL.len()];
    let mut i = 0;
    while i < row.len() {
        row[i].sdpa = SdpaBackend::ALL[i];
        i += 1;
    }
    row
}

impl PyTorch {
    /// The instance for a device and backend (a `'static` reference, as `model_for` returns).
    pub(crate) fn instance(device: TorchDevice, sdpa: SdpaBackend) -> &'static PyTorch {
        let row = match device {
            TorchDevice::Cpu => &INSTANCES[0],
            TorchDevice::Cuda => &INSTANCES[1],
        };
        row.iter()
            .find(|p| p.sdpa == sdpa)
            .expect("every backend is in SdpaBackend::ALL")
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
