"""Shared test configuration: GPU-marked tests run only where CUDA is present; on a CPU torch
runs on one thread."""

import pytest
import torch

if not torch.cuda.is_available():
    # Two OpenMP threads on two cores that other programs share spin while they wait for each
    # other: measured here, a real-model test took 78 s with a neighbour running, 7.6 s on one
    # thread. One thread per process keeps the suite's time steady on a busy machine.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
