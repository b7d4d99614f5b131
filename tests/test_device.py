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


@pytest.fixture
def machine(monkeypatch):
    """Say which of CUDA and MPS torch finds, without either being here."""
    monkeypatch.delenv("PAGEDLAB_DEVICE", raising=False)

    def have(cuda=False, mps=False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    return have


@pytest.mark.parametrize("cuda, mps, chosen", [
    (True, True, "cuda"), (True, False, "cuda"), (False, True, "mps"), (False, False, "cpu")])
def test_device_is_cuda_then_mps_then_cpu(machine, cuda, mps, chosen):
    machine(cuda=cuda, mps=mps)
    assert device.select_device() == torch.device(chosen)


def test_pagedlab_device_overrides_the_choice(machine, monkeypatch):
    machine(cuda=True, mps=True)
    for name in ("cpu", "mps", "cuda"):
        monkeypatch.setenv("PAGEDLAB_DEVICE", name)
        assert device.select_device() == torch.device(name)


def test_pagedlab_device_errors_name_the_variable(machine, monkeypatch):
    machine(cuda=False, mps=False)
    monkeypatch.setenv("PAGEDLAB_DEVICE", "gpu")
    with pytest.raises(ValueError, match="PAGEDLAB_DEVICE must be one of .*'gpu'"):
        device.select_device()
    monkeypatch.setenv("PAGEDLAB_DEVICE", "mps")
    with pytest.raises(RuntimeError, match="PAGEDLAB_DEVICE=mps but torch finds no mps device"):
        device.select_device()


def test_the_override_reaches_device_and_the_interpreter_switch():
    """A child process on this machine told to use the CPU: DEVICE, HAS_CUDA and the
    interpreter follow, whatever devices there are."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PAGEDLAB_DEVICE"] = "cpu"
    done = subprocess.run([sys.executable, "-c", "import os, pagedlab.device as d; "
                           "print(d.DEVICE, d.HAS_CUDA, os.environ['TRITON_INTERPRET'])"],
                          env=env, capture_output=True, text=True)
    assert done.stdout.split() == ["cpu", "False", "1"], done.stderr


@pytest.mark.parametrize("where, triton, kernels", [
    ("cuda", True, "triton"), ("cuda", False, "reference"), ("mps", False, "reference"),
    ("cpu", True, "reference"), ("cpu", False, "reference")])
def test_model_uses_triton_only_on_cuda_with_triton(monkeypatch, where, triton, kernels):
    from pagedlab import model

    monkeypatch.setattr(model, "has_triton", lambda: triton)
    assert model.default_kernels(where) == kernels


@pytest.mark.parametrize("where, triton, says", [
    ("mps", False, "pagedlab on MPS (Apple GPU), Triton unavailable: the torch reference "
                   "kernels run instead"),
    ("cpu", False, "pagedlab on CPU, Triton unavailable: the torch reference kernels run instead"),
    ("cpu", True, "pagedlab on CPU, Triton kernels through the interpreter")])
def test_describe_names_the_backend_and_the_kernels(monkeypatch, where, triton, says):
    monkeypatch.setattr(device, "DEVICE", torch.device(where))
    monkeypatch.setattr(device, "HAS_CUDA", False)
    monkeypatch.setattr(device, "INTERPRET", True)
    monkeypatch.setattr(device, "has_triton", lambda: triton)
    assert device.describe().startswith(says + "; size preset: ")


@pytest.mark.mps
def test_engine_on_apples_gpu_decodes_as_on_the_cpu():
    """The reference kernels on MPS, fp32: greedy tokens as the same weights give on the CPU."""
    from _tiny import random_prompts, tiny_hf

    from pagedlab import LLM, SamplingParams
    from pagedlab.model import from_hf

    hf = tiny_hf("llama-gqa-d64")
    prompts = random_prompts([3, 17, 30], hf.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=12)
    tokens = {}
    for where in ("cpu", "mps"):
        llm = LLM(from_hf(tiny_hf("llama-gqa-d64").to(where)), num_gpu_blocks=32, max_num_seqs=4)
        assert llm.model.kernels == "reference"
        tokens[where] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["mps"] == tokens["cpu"]
