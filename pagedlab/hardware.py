"""GPU presets: memory, bandwidth and peak tensor-core throughput; the links between GPUs.

Chapter 1 draws rooflines from these numbers and computes what fits in memory; the simulator's
cost model turns FLOPs and bytes into time with the same presets.

Units. Memory is in bytes, read as GiB (2**30 bytes) from the datasheet's "GB": the paper
does the same (its 40 GB A100 holds 12 GB of KV cache and 15.7K slots of 800 KB only in
binary units), and the A100 parts report exactly 40 and 80 GiB. Bandwidth is in bytes/s
and throughput in FLOP/s, both decimal as the datasheets print them. Throughput is dense
(without the 2:4 structured-sparsity doubling the datasheets also quote).

An :class:`Interconnect` is the link a tensor-parallel all-reduce crosses (NVLink or PCIe),
with its bandwidth per direction; chapter 14's cost model prices communication with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedlab._checks import check_positive, lookup_preset
from pagedlab.dtypes import dtype_name

KiB, MiB, GiB = 2**10, 2**20, 2**30


@dataclass(frozen=True)
class GPU:
    """One accelerator as a roofline sees it: capacity, bandwidth and peak throughput."""

    name: str
    memory_bytes: int  # HBM capacity
    bandwidth_bytes_per_s: float  # HBM bandwidth
    peak_flops_fp16: float  # dense fp16/bf16 tensor-core FLOP/s
    peak_flops_fp8: float | None = None  # dense fp8 tensor-core FLOP/s; None: no fp8 units

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name={self.name!r} must be a non-empty string")
        check_positive("memory_bytes", self.memory_bytes, integer=True)
        check_positive("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        check_positive("peak_flops_fp16", self.peak_flops_fp16)
        if self.peak_flops_fp8 is not None:
            check_positive("peak_flops_fp8", self.peak_flops_fp8)

    def peak_flops(self, dtype="fp16") -> float:
        """Dense tensor-core FLOP/s for matrix products in ``dtype``."""
        name = dtype_name(dtype)
        if name in ("fp16", "bf16"):
            return self.peak_flops_fp16
        if name == "fp8" and self.peak_flops_fp8 is not None:
            return self.peak_flops_fp8
        field = "peak_flops_fp8" if name == "fp8" else "dtype"
        raise ValueError(f"{field}: {self.name} has no {name} tensor-core peak in its preset")

    def ridge_point(self, dtype="fp16") -> float:
        """Intensity (FLOP/byte) where the roofline turns from memory- to compute-bound."""
        return self.peak_flops(dtype) / self.bandwidth_bytes_per_s

    def attainable_flops(self, intensity, dtype="fp16"):
        """Roofline: FLOP/s reachable at ``intensity`` FLOP/byte (a number or an array)."""
        memory_bound = np.asarray(intensity) * self.bandwidth_bytes_per_s
        return np.minimum(self.peak_flops(dtype), memory_bound)

    def step_time(self, flops: float, bytes_moved: float, dtype="fp16") -> float:
        """Roofline lower bound on the seconds a step takes: compute and traffic fully overlap."""
        return max(flops / self.peak_flops(dtype), bytes_moved / self.bandwidth_bytes_per_s)


GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        # NVIDIA A100 datasheet (SXM): 40 GB HBM2 at 1,555 GB/s; 312 TFLOPS fp16/bf16 dense
        # (624 with sparsity). Ampere has no fp8 tensor cores.
        GPU("A100-40GB", 40 * GiB, 1_555e9, 312e12),
        # Same datasheet, 80 GB SXM part: HBM2e at 2,039 GB/s, same compute.
        GPU("A100-80GB", 80 * GiB, 2_039e9, 312e12),
        # NVIDIA H100 datasheet, SXM: 80 GB HBM3 at 3.35 TB/s; 989 TFLOPS fp16/bf16 dense and
        # 1,979 TFLOPS fp8 dense (the datasheet's 1,979 / 3,958 are with sparsity).
        GPU("H100-SXM", 80 * GiB, 3.35e12, 989e12, 1_979e12),
        # NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s; the H100's compute. 141 GB
        # is read as GiB like the other parts; drivers report slightly less as usable.
        GPU("H200", 141 * GiB, 4.8e12, 989e12, 1_979e12),
    )
}


def get_gpu(gpu) -> GPU:
    """The preset named ``gpu``; a :class:`GPU` passes through unchanged."""
    return lookup_preset("gpu", gpu, GPUS, GPU, "GPUs")


# --- Links between GPUs: what a tensor-parallel all-reduce crosses -------------------------


@dataclass(frozen=True)
class Interconnect:
    """The link between the GPUs of one tensor-parallel group, as an all-reduce sees it.

    ``bandwidth_bytes_per_s`` is what one GPU can send (and, at the same time, receive) in one
    direction: half the "total" or bidirectional figure datasheets print. ``latency_s`` is the
    fixed cost of one all-reduce whatever its size (launch, synchronisation, the ring's steps).
    """

    name: str
    bandwidth_bytes_per_s: float  # per GPU, per direction
    latency_s: float  # per all-reduce

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name={self.name!r} must be a non-empty string")
        check_positive("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        check_positive("latency_s", self.latency_s, allow_zero=True)

    @staticmethod
    def ring_bytes(nbytes: float, num_gpus: int) -> float:
        """Bytes each GPU sends in a ring all-reduce of an ``nbytes`` tensor: ``2(N-1)/N`` of
        it (N-1 steps of a reduce-scatter, then N-1 of an all-gather, each moving 1/N)."""
        check_positive("num_gpus", num_gpus, integer=True)
        return 2 * (num_gpus - 1) / num_gpus * nbytes

    def allreduce_time(self, nbytes: float, num_gpus: int) -> float:
        """Seconds one all-reduce of an ``nbytes`` tensor over ``num_gpus`` GPUs takes: its
        ring traffic at the link's bandwidth plus the fixed latency; 0 on one GPU."""
        check_positive("nbytes", nbytes, allow_zero=True)
        if num_gpus == 1:
            return 0.0
        return self.ring_bytes(nbytes, num_gpus) / self.bandwidth_bytes_per_s + self.latency_s


def _pcie_x16(gigatransfers: float) -> float:
    """Bytes/s one direction of a PCIe x16 link carries: 16 lanes at ``gigatransfers`` GT/s,
    one bit a transfer, 128b/130b coding (PCIe 3.0 and later)."""
    return gigatransfers * 1e9 * 16 * 128 / 130 / 8


# Bandwidths per direction from the datasheets; the latencies are this book's assumptions (the
# order of magnitude of a small NCCL all-reduce), not measurements.
INTERCONNECTS: dict[str, Interconnect] = {
    link.name: link
    for link in (
        # NVIDIA H100 and H200 datasheets (SXM): fourth-generation NVLink, 900 GB/s per GPU,
        # counted in both directions: 450 GB/s each way. Through NVSwitch (HGX/DGX boards)
        # every GPU reaches every other at that rate.
        Interconnect("NVLink-4", 450e9, 10e-6),
        # NVIDIA A100 datasheet (SXM): third-generation NVLink, 600 GB/s, 300 GB/s each way.
        Interconnect("NVLink-3", 300e9, 10e-6),
        # PCI-SIG, PCI Express Base Specification 4.0: 16 GT/s a lane, 128b/130b coding:
        # 31.5 GB/s each way on x16 (the A100 datasheet's "PCIe Gen4: 64 GB/s" counts both).
        # GPUs on a PCIe bus share the host's switches; this is one link's ceiling.
        Interconnect("PCIe-4-x16", _pcie_x16(16), 25e-6),
        # PCI Express Base Specification 5.0: 32 GT/s a lane: 63 GB/s each way on x16 (the
        # H100 datasheet's "PCIe Gen5: 128 GB/s" counts both directions).
        Interconnect("PCIe-5-x16", _pcie_x16(32), 25e-6),
    )
}


def get_interconnect(link) -> Interconnect:
    """The preset named ``link``; an :class:`Interconnect` passes through unchanged."""
    return lookup_preset("interconnect", link, INTERCONNECTS, Interconnect, "interconnects")
