"""GPU presets: memory, bandwidth and peak tensor-core throughput.

Chapter 1 draws rooflines from these numbers and computes what fits in memory; the simulator's
cost model turns FLOPs and bytes into time with the same presets.

Units. Memory is in bytes, read as GiB (2**30 bytes) from the datasheet's "GB": the paper
does the same (its 40 GB A100 holds 12 GB of KV cache and 15.7K slots of 800 KB only in
binary units), and the A100 parts report exactly 40 and 80 GiB. Bandwidth is in bytes/s
and throughput in FLOP/s, both decimal as the datasheets print them. Throughput is dense
(without the 2:4 structured-sparsity doubling the datasheets also quote).
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
