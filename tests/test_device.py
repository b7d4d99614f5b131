"""Device selection, the interpreter switch and size presets."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pagedlab import device


def test_pick_follows_the_size_preset(monkeypatch):
    monkeypatch.setenv("PAGEDLAB_SIZE", "small")
    assert device.pick(small=64, large=4096) == 64
    monkeypatch.setenv("PAGEDLAB_SIZE", "large")
    assert device.pick(small=64, large=4096) == 4096


def test_default_preset_is_small_exactly_on_cpu(monkeypatch):
    monkeypatch.delenv("PAGEDLAB_SIZE", raising=False)
    assert device.size_preset() == ("large" if torch.cuda.is_available() else "small")


def test_unknown_preset_names_the_variable(monkeypatch):
    monkeypatch.setenv("PAGEDLAB_SIZE", "huge")
    with pytest.raises(ValueError, match="PAGEDLAB_SIZE.*'huge'"):
        device.pick(1, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is the CPU path")
def test_triton_kernels_run_through_the_interpreter_after_importing_pagedlab(tmp_path):
    """A reader does nothing: `import pagedlab` alone makes a Triton kernel run on a CPU tensor."""
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent("""
        import pagedlab, torch, triton, triton.language as tl

        @triton.jit
        def add(x, y, out, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(out + i, tl.load(x + i, mask=i < n) + tl.load(y + i, mask=i < n), mask=i < n)

        x, y = torch.arange(10.0), torch.ones(10)
        out = torch.empty(10)
        add[(2,)](x, y, out, 10, BLOCK=8)
        assert torch.equal(out, x + y), out
        print(pagedlab.device.describe())
    """))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "through the interpreter" in done.stdout


@pytest.mark.parametrize("capability, dtype", [
    ((7, 0), torch.float16),  # V100
    ((7, 5), torch.float16),  # T4, Colab's free GPU
    ((8, 0), torch.bfloat16),  # A100
    ((8, 6), torch.bfloat16),
    ((9, 0), torch.bfloat16),  # H100, H200
])
def test_half_dtype_is_bf16_only_from_ampere_on(capability, dtype):
    assert device.half_dtype(capability) == dtype


def test_half_dtype_asks_this_gpu_and_is_bf16_on_a_cpu(monkeypatch):
    if not torch.cuda.is_available():
        assert device.half_dtype() == torch.bfloat16
    monkeypatch.setattr(device, "HAS_CUDA", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert device.half_dtype() == torch.float16
