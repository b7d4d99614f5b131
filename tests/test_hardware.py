"""GPU presets against their datasheets, the roofline helpers, and bad inputs."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedlab.hardware import GPU, GPUS, get_gpu

# (name, bytes, bytes/s, fp16 FLOP/s, fp8 FLOP/s) typed from the NVIDIA datasheets.
DATASHEET = [
    ("A100-40GB", 42_949_672_960, 1.555e12, 312e12, None),
    ("A100-80GB", 85_899_345_920, 2.039e12, 312e12, None),
    ("H100-SXM", 85_899_345_920, 3.35e12, 989e12, 1979e12),
    ("H200", 151_397_597_184, 4.8e12, 989e12, 1979e12),
]


@pytest.mark.parametrize("name, memory, bandwidth, fp16, fp8", DATASHEET)
def test_presets_match_datasheets(name, memory, bandwidth, fp16, fp8):
    gpu = get_gpu(name)
    assert gpu.memory_bytes == memory
    assert gpu.bandwidth_bytes_per_s == pytest.approx(bandwidth)
    assert gpu.peak_flops_fp16 == pytest.approx(fp16)
    assert gpu.peak_flops_fp8 == (None if fp8 is None else pytest.approx(fp8))


def test_every_preset_is_checked():
    assert sorted(GPUS) == sorted(row[0] for row in DATASHEET)


def test_peak_by_dtype():
    h100 = get_gpu("H100-SXM")
    assert h100.peak_flops("bf16") == h100.peak_flops(torch.float16) == 989e12
    assert h100.peak_flops(torch.float8_e4m3fn) == 1979e12


def test_ridge_points():
    # Peak over bandwidth, by hand: 312e12 / 1.555e12 and 989e12 / 3.35e12.
    assert get_gpu("A100-40GB").ridge_point() == pytest.approx(200.643, rel=1e-4)
    assert get_gpu("H100-SXM").ridge_point() == pytest.approx(295.224, rel=1e-4)
    assert get_gpu("H100-SXM").ridge_point("fp8") == pytest.approx(590.746, rel=1e-4)


def test_roofline_sides():
    a100 = get_gpu("A100-40GB")
    assert a100.attainable_flops(10.0) == pytest.approx(15.55e12)  # memory-bound side
    assert a100.attainable_flops(1000.0) == pytest.approx(312e12)  # compute-bound side
    # A decode step of 26 GB of weights at batch 1: bandwidth-bound, 26e9 / 1.555e12 s.
    assert a100.step_time(flops=52e9, bytes_moved=26e9) == pytest.approx(16.72e-3, rel=1e-3)
    assert a100.step_time(flops=312e15, bytes_moved=1.0) == pytest.approx(1000.0)


@given(st.sampled_from(list(GPUS)), st.floats(1e-3, 1e4), st.floats(1e-3, 1e4))
def test_roofline_monotone_and_capped(name, a, b):
    gpu = get_gpu(name)
    lo, hi = sorted((a, b))
    assert gpu.attainable_flops(lo) <= gpu.attainable_flops(hi) <= gpu.peak_flops_fp16


def test_get_gpu_passes_custom_gpus_through():
    mine = GPU("toy", 2**30, 1e11, 1e13)
    assert get_gpu(mine) is mine


def test_presets_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_gpu("H200").memory_bytes = 1


GOOD = dict(name="g", memory_bytes=2**30, bandwidth_bytes_per_s=1e12, peak_flops_fp16=1e14)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(name=""), "name"),
        (dict(memory_bytes=0), "memory_bytes"),
        (dict(memory_bytes=1.5e9), "memory_bytes"),
        (dict(bandwidth_bytes_per_s=-1.0), "bandwidth_bytes_per_s"),
        (dict(peak_flops_fp16=float("nan")), "peak_flops_fp16"),
        (dict(peak_flops_fp8=0.0), "peak_flops_fp8"),
    ],
)
def test_bad_gpu_fields(change, field):
    with pytest.raises(ValueError, match=field):
        GPU(**{**GOOD, **change})


def test_unknown_gpu_lists_the_presets():
    with pytest.raises(ValueError, match="gpu='B200'") as info:
        get_gpu("B200")
    assert all(name in str(info.value) for name in GPUS)


def test_missing_peaks_name_the_field():
    with pytest.raises(ValueError, match="peak_flops_fp8"):
        get_gpu("A100-80GB").peak_flops("fp8")
    with pytest.raises(ValueError, match="dtype"):
        get_gpu("H100-SXM").peak_flops("fp32")  # no preset for TF32/FP32
    with pytest.raises(ValueError, match="dtype=torch.int8"):
        get_gpu("H100-SXM").peak_flops(torch.int8)
