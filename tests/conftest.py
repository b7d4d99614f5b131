"""Shared test configuration: GPU-marked tests run only where CUDA is present, MPS-marked ones
only on Apple's GPU; on a CPU torch runs on one thread. ``PAGEDLAB_BLOCK_TRITON=1`` makes Triton
unimportable first (``tools/no_triton.py``), as on macOS and Windows. Randomized tests (Hypothesis
tests, and tests that pick their own seeds through ``seed_offset``) are marked ``randomized``;
``PAGEDLAB_TEST_SEED`` shifts the seeds of the latter (``make seeds``)."""

import importlib.util
import os
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "no_triton", Path(__file__).resolve().parents[1] / "tools" / "no_triton.py")
no_triton = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(no_triton)
no_triton.block_if_asked()  # before torch, pagedlab or transformers could import Triton

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import is_hypothesis_test  # noqa: E402

if not torch.cuda.is_available():
    # Two OpenMP threads on two cores that other programs share spin while they wait for each
    # other: measured here, a real-model test took 78 s with a neighbour running, 7.6 s on one
    # thread. One thread per process keeps the suite's time steady on a busy machine.
    torch.set_num_threads(1)


@pytest.fixture
def seed_offset():
    """What a randomized test that picks its own seeds adds to each of them: the environment's
    ``PAGEDLAB_TEST_SEED``, 0 unless set (``make seeds`` runs them with 0 to 29)."""
    return int(os.environ.get("PAGEDLAB_TEST_SEED", "0"))


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:  # a state machine run inside a test is marked by hand
        if is_hypothesis_test(getattr(item, "obj", None)) or "seed_offset" in getattr(
                item, "fixturenames", ()):
            item.add_marker(pytest.mark.randomized)
    needs = {"gpu": (torch.cuda.is_available(), "needs a CUDA device"),
               "mps": (torch.backends.mps.is_available(), "needs Apple's GPU (MPS)")}
    for item in items:
        for marker, (available, reason) in needs.items():
            if marker in item.keywords and not available:
                item.add_marker(pytest.mark.skip(reason=reason))
