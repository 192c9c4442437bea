//! The links between ranks and to the host: what a step's collectives (DDP all-reduce, ZeRO and
//! FSDP all-gathers and reduce-scatters) and offload's copies move over.
//!
//! Rates are **per direction** (a ring collective sends and receives at once, so its time is
//! bytes sent / the per-direction rate), datasheet peaks, not measured here:
//! - **[H100]** NVIDIA H100 Tensor Core GPU datasheet: NVLink 900 GB/s (SXM; bidirectional, 18
//!   links × 50 GB/s), PCIe Gen5 128 GB/s (bidirectional); H100 PCIe: NVLink bridge 600 GB/s
//!   between pairs only, PCIe Gen5. **[H200]** H200 datasheet: NVLink 900 GB/s, PCIe Gen5.
//! - **[A100]** NVIDIA A100 datasheet: NVLink 600 GB/s (SXM), PCIe Gen4 64 GB/s (bidirectional).
//! - **[V100]** NVIDIA V100 datasheet: NVLink 300 GB/s (SXM2), PCIe Gen3 32 GB/s.
//! - **[PCIE]** PCI-SIG base specifications: ×16 at 8 / 16 / 32 GT/s with 128b/130b encoding is
//!   15.75 / 31.5 / 63 GB/s per direction (Gen3 / Gen4 / Gen5).
//! - **[IB]** NVIDIA ConnectX-7 / Quantum-2 (InfiniBand NDR): 400 Gb/s per port = 50 GB/s per
//!   direction; HDR 200 Gb/s = 25 GB/s.
//! - GeForce and L-series boards (L40S, L4, A10G, RTX 4090/5090, RTX A6000, T4) have no NVLink
//!   between more than two boards (the RTX 4090 and L40S none at all): their ranks talk over PCIe
//!   ([ADA], [L40S], [L4], [A10], [RTXBW], [GA102], [T4] in `catalog.rs`).

use serde::Serialize;

const G: f64 = 1e9;

/// A link and its rate per direction.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Link {
    pub name: &'static str,
    /// Bytes/s per direction.
    pub bytes_per_s: f64,
    pub source: &'static str,
}

pub(crate) const NVLINK4: Link = Link::per_direction_gbs(
    "NVLink 4 (H100/H200 SXM, 900 GB/s bidirectional)",
    450.0,
    "NVIDIA H100 / H200 datasheets: NVLink 900 GB/s",
);
pub(crate) const NVLINK3: Link = Link::per_direction_gbs(
    "NVLink 3 (A100 SXM, 600 GB/s bidirectional)",
    300.0,
    "NVIDIA A100 datasheet: NVLink 600 GB/s",
);
pub(crate) const NVLINK2: Link = Link::per_direction_gbs(
    "NVLink 2 (V100 SXM2, 300 GB/s bidirectional)",
    150.0,
    "NVIDIA V100 datasheet: NVLink 300 GB/s",
);
pub(crate) const PCIE3_X16: Link = Link::per_direction_gbs(
    "PCIe 3.0 x16",
    15.75,
    "PCI-SIG: 8 GT/s × 16 lanes, 128b/130b",
);
pub(crate) const PCIE4_X16: Link = Link::per_direction_gbs(
    "PCIe 4.0 x16",
    31.5,
    "PCI-SIG: 16 GT/s × 16 lanes, 128b/130b",
);
pub(crate) const PCIE5_X16: Link = Link::per_direction_gbs(
    "PCIe 5.0 x16",
    63.0,
    "PCI-SIG: 32 GT/s × 16 lanes, 128b/130b",
);
pub(crate) const IB_NDR: Link = Link::per_direction_gbs(
    "InfiniBand NDR (400 Gb/s per GPU)",
    50.0,
    "NVIDIA ConnectX-7 / Quantum-2: 400 Gb/s per port",
);
pub(crate) const IB_HDR: Link = Link::per_direction_gbs(
    "InfiniBand HDR (200 Gb/s per GPU)",
    25.0,
    "NVIDIA ConnectX-6 / Quantum: 200 Gb/s per port",
);

impl Link {
    /// A link of `gb_per_s` GB/s (10^9 B/s) per direction, as its datasheet gives it.
    const fn per_direction_gbs(name: &'static str, gb_per_s: f64, source: &'static str) -> Link {
        Link {
            name,
            bytes_per_s: gb_per_s * G,
            source,
        }
    }
}

/// GPUs per node that the intra-node link joins (an HGX / DGX board holds 8).
pub(crate) const GPUS_PER_NODE: u32 = 8;

/// The links of a catalog GPU: between the ranks of one node, and to the host.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GpuLinks {
    pub intra_node: Link,
    pub host: Link,
    /// Between nodes (ranks beyond [`GPUS_PER_NODE`]).
    pub inter_node: Link,
}

/// The links a catalog GPU (by its canonical name) trains over.
pub fn links_for(gpu_name: &str) -> GpuLinks {
    let (intra, host) = match gpu_name {
        "h200" | "h100-sxm" => (NVLINK4, PCIE5_X16),
        "h100-pcie" | "rtx-5090" => (PCIE5_X16, PCIE5_X16),
        "a100-80gb" | "a100-40gb" => (NVLINK3, PCIE4_X16),
        "v100-16gb" | "v100-32gb" => (NVLINK2, PCIE3_X16),
        "t4" => (PCIE3_X16, PCIE3_X16),
        _ => (PCIE4_X16, PCIE4_X16),
    };
    let inter = if intra.bytes_per_s >= NVLINK3.bytes_per_s {
        IB_NDR
    } else {
        IB_HDR
    };
    GpuLinks {
        intra_node: intra,
        host,
        inter_node: inter,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_catalog_gpu_has_links_and_nvlink_is_faster_than_pcie() {
        for g in crate::gpu::all() {
            let l = links_for(g.name);
            assert!(l.intra_node.bytes_per_s >= l.host.bytes_per_s, "{}", g.name);
        }
        assert_eq!(links_for("h100-sxm").intra_node.bytes_per_s, 450e9);
        assert_eq!(links_for("rtx-4090").intra_node, PCIE4_X16);
        // 16 H100 SXM cross InfiniBand NDR between their two nodes (the ring rate,
        // `DeviceProfile::ring_bytes_per_s`, is tested in cost.rs).
        assert_eq!(links_for("h100-sxm").inter_node.bytes_per_s, 50e9);
    }
}
