"""pagedlab where Triton cannot be imported, as on macOS and Windows (Triton ships Linux wheels
only): Triton is blocked in a child process (``tools/no_triton.py``) and the engine there is
held token for token to the same model served with the Triton kernels in another.

Each side runs in a fresh process, so neither inherits the other's imports. Tests that launch
the Triton side need Triton installed (on Linux it is a dependency, so they run).
"""

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"

# Modules that define Triton kernels and import Triton to do so; every other module of the
# package must import without it. A new module belongs in one group or the other.
TRITON_ONLY = {f"pagedlab.kernels.{name}" for name in
               ("cache_ops", "decode", "fp8", "mla", "tiles", "two_pass", "varlen")}


def _installed(distribution: str) -> bool:
    """Installed, whether or not this process blocks its import."""
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_triton = pytest.mark.skipif(not _installed("triton"), reason="needs Triton installed")


def python(code: str, *, block: bool, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, with Triton blocked first if ``block``; this
    directory and tools/ are importable there."""
    prelude = f"import sys; sys.path[:0] = [{str(TOOLS)!r}, {str(ROOT / 'tests')!r}]\n"
    if block:
        prelude += "import no_triton; no_triton.block()\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("PAGEDLAB_BLOCK_TRITON", None)  # only `block` decides
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=600)


def python_json(code: str, *, block: bool):
    """What ``code`` prints as JSON on its last line of output; fails with its stderr."""
    done = python(code, block=block)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


# --- the blocker ----------------------------------------------------------------------------


def test_the_blocker_makes_triton_unimportable_and_absent():
    done = python("""
        import importlib.util
        try:
            import triton.language
        except ImportError as e:
            print(type(e).__name__)
        assert importlib.util.find_spec("triton") is None
        from transformers.utils import is_triton_available
        assert not is_triton_available()  # libraries that probe before importing see it absent
    """, block=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ModuleNotFoundError"


@needs_triton
def test_blocking_after_triton_is_imported_is_an_error():
    done = python("import triton, no_triton; no_triton.block()", block=False)
    assert "triton is already imported" in done.stderr


@needs_triton
def test_run_chapters_and_conftest_block_triton_when_asked(tmp_path):
    """The variable, not the test's own prelude: a chapter run by tools/run_chapters.py and a
    test run under tests/conftest.py cannot import Triton with it, and can without it."""
    notebook = tmp_path / "chXX.ipynb"
    notebook.write_text(json.dumps({"cells": [{"cell_type": "code",
                                               "source": ["import triton"]}]}))
    probe = tmp_path / "test_probe.py"
    probe.write_text("def test_probe():\n    import triton\n")
    commands = {
        "chapter": [str(TOOLS / "run_chapters.py"), str(notebook)],
        "pytest": ["-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", str(probe)],
    }
    for name, args in commands.items():
        for asked in ("1", ""):
            env = {**os.environ, "PAGEDLAB_BLOCK_TRITON": asked,
                   "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"),
                                                  os.environ.get("PYTHONPATH", "")])}
            done = subprocess.run([sys.executable, *args], env=env, cwd=tmp_path,
                                  capture_output=True, text=True, timeout=300)
            assert (done.returncode != 0) == bool(asked), (name, asked, done.stdout[-2000:])
            if asked:
                assert "No module named 'triton'" in done.stdout or \
                    "import of triton halted" in done.stdout, (name, done.stdout[-2000:])


# --- what imports, and what it says ---------------------------------------------------------


def test_llm_imports_and_describe_says_triton_is_unavailable():
    done = python("""
        import sys
        from pagedlab import LLM, SamplingParams
        import pagedlab
        print(pagedlab.device.describe())
        assert sys.modules["triton"] is None
    """, block=True)
    assert done.returncode == 0, done.stderr
    assert "Triton unavailable" in done.stdout and "reference" in done.stdout, done.stdout


@needs_triton
def test_describe_says_triton_kernels_run_where_triton_imports():
    done = python("import pagedlab; print(pagedlab.device.describe())", block=False)
    assert "Triton kernels" in done.stdout and "unavailable" not in done.stdout, done.stdout


def test_every_module_but_the_triton_kernels_imports_without_triton():
    failed = python_json("""
        import importlib, json, pkgutil
        import pagedlab
        failed = {}
        for module in pkgutil.walk_packages(pagedlab.__path__, "pagedlab."):
            try:
                importlib.import_module(module.name)
            except ImportError as e:
                failed[module.name] = str(e)
        print(json.dumps(failed))
    """, block=True)
    assert set(failed) == TRITON_ONLY, "a module imports Triton where it need not, or a " \
        "Triton kernel module is missing from TRITON_ONLY"
    assert all("triton" in error for error in failed.values()), failed


def test_kernels_say_what_is_missing_and_name_their_reference():
    """Without Triton each of pagedlab.kernels' names raises an ImportError that names Triton
    and a torch reference that exists; so does asking the model for the Triton kernels."""
    report = python_json("""
        import importlib, json
        import pagedlab.kernels as kernels
        assert callable(kernels.mla_reference.mla_decode)  # a module, found as an attribute
        from pagedlab import LLM
        from pagedlab.model import ModelArgs, PagedLlama
        errors = {}
        for name in kernels.__all__:
            try:
                getattr(kernels, name)
            except ImportError as e:
                errors[name] = str(e)
        args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16)
        for name, make in (("model", lambda: PagedLlama(args, kernels="triton")),
                           ("LLM", lambda: LLM(PagedLlama(args), kernels="triton",
                                               num_gpu_blocks=4))):
            try:
                make()
            except ImportError as e:
                errors[name] = str(e)
        print(json.dumps(errors))
    """, block=True)
    import pagedlab.kernels

    assert set(report) == {*pagedlab.kernels.__all__, "model", "LLM"}, report
    for name, error in report.items():
        assert "needs Triton, which cannot be imported here" in error, error
    for name in pagedlab.kernels.__all__:
        reference = report[name].split("use pagedlab.kernels.")[1].split(",")[0]
        module, function = reference.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(f"pagedlab.kernels.{module}"), function))
    assert "kernels='reference'" in report["model"] and "kernels='reference'" in report["LLM"]


@needs_triton
def test_kernels_package_still_exports_the_triton_kernels():
    """Where Triton imports, ``from pagedlab.kernels import paged_attention`` is the Triton
    kernel, as before the package imported them lazily."""
    same = python_json("""
        import json
        from importlib import import_module
        from pagedlab import kernels
        assert callable(kernels.two_pass.paged_attention_two_pass)  # as when all were imported
        from pagedlab.kernels import paged_attention
        assert paged_attention is kernels.decode.paged_attention
        print(json.dumps({name: getattr(kernels, name) is getattr(
            import_module(f"pagedlab.kernels.{module}"), name)
            for name, (module, _) in kernels._KERNELS.items()}))
    """, block=False)
    assert len(same) == 11 and all(same.values()), same


# --- the same tokens ------------------------------------------------------------------------


def serve_tiny(kernels=None) -> dict:
    """A tiny random Llama served greedily with chunked prefill (a budget of 16 tokens, under
    the prompts' lengths) and prefix caching (prompts share 20 tokens): its tokens, and what
    ran."""
    from _tiny import random_prompts, tiny_hf

    from pagedlab import LLM, SamplingParams
    from pagedlab.device import DEVICE
    from pagedlab.model import from_hf

    model = from_hf(tiny_hf("llama-gqa-d64").to(DEVICE))
    shared = random_prompts([20], model.args.vocab_size, seed=7)[0]
    prompts = [shared + tail for tail in random_prompts([5, 11, 2, 9], model.args.vocab_size)]
    llm = LLM(model, block_size=4, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=16,
              enable_prefix_caching=True, kernels=kernels)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return dict(kernels=llm.model.kernels, tokens=[o.outputs[0].token_ids for o in outs],
                prompt_lens=[len(p) for p in prompts], prefix_hits=llm.stats.prefix_hits,
                max_prefill=max(s.prefill_tokens for s in llm.stats.steps))


@needs_triton
def test_tiny_llama_generates_the_same_tokens_without_triton():
    code = "import json, test_without_triton as t; print(json.dumps(t.serve_tiny({})))"
    without = python_json(code.format("None"), block=True)
    triton = python_json(code.format("'triton'"), block=False)
    assert (without["kernels"], triton["kernels"]) == ("reference", "triton")
    assert without["tokens"] == triton["tokens"]
    tokens = without["tokens"]  # the comparison could fail: completions differ and vary
    assert len({tuple(t) for t in tokens}) == len(tokens) and all(len(set(t)) >= 4 for t in tokens)
    assert without["prefix_hits"] > 0 and triton["prefix_hits"] == without["prefix_hits"]
    assert without["max_prefill"] <= 16 < min(without["prompt_lens"])  # prompts were chunked


def serve_smollm2(kernels=None) -> dict:
    """SmolLM2-135M-Instruct's greedy replies to two short chat questions asked one after the
    other, chunked by a 16-token budget, the second reusing the cached system prompt."""
    from pagedlab import LLM, SamplingParams
    from pagedlab.checkpoints import smollm2

    llm = LLM(smollm2(), kernels=kernels, num_gpu_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=16, enable_prefix_caching=True)
    replies, hits = [], 0
    for question in ("What is the capital of France?", "Name three primary colors."):
        out = llm.chat([{"role": "user", "content": question}],
                       SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        replies.append(out.outputs[0].token_ids)
        hits += llm.stats.prefix_hits
    return dict(kernels=llm.model.kernels, tokens=replies, prefix_hits=hits)


@pytest.mark.slow  # about 30 s: the Triton side runs SmolLM2 through the interpreter on a CPU
@needs_triton
def test_smollm2_answers_the_same_without_triton():
    from pagedlab.checkpoints import ModelNotInstalled, smollm2

    try:
        smollm2()
    except ModelNotInstalled as missing:
        pytest.skip(str(missing))
    code = "import json, test_without_triton as t; print(json.dumps(t.serve_smollm2({})))"
    without = python_json(code.format("None"), block=True)
    triton = python_json(code.format("'triton'"), block=False)
    assert (without["kernels"], triton["kernels"]) == ("reference", "triton")
    assert without["tokens"] == triton["tokens"]
    assert without["tokens"][0] != without["tokens"][1] and without["prefix_hits"] > 0


# --- the book's fallback: the kernels' references, and their modules readable -----------------


def small_outputs(names=("paged_attention", "paged_attention_two_pass", "paged_attention_fp8",
                         "paged_attention_varlen", "mla_attention")) -> dict:
    """What ``kernel_or_reference`` gives for each of ``names`` on a small seeded input, with
    the launch-only arguments the chapters pass (``num_splits``, ``logits``): the outputs as
    lists, and where each function was defined."""
    import torch

    from pagedlab.kernels import fp8_reference, kernel_or_reference, mla_reference
    from pagedlab.kernels.inputs import random_paged_inputs, random_varlen_inputs

    x = random_paged_inputs([5, 16, 37], num_heads=4, num_kv_heads=2, head_dim=16,
                            block_size=8, seed=3)
    xv = random_varlen_inputs([5, 9], [3, 1], num_heads=4, num_kv_heads=2, head_dim=16,
                              block_size=8, seed=4)
    xm = mla_reference.random_mla_inputs([5, 11], num_heads=16, kv_lora_rank=32, rope_dim=16,
                                         nope_dim=16, v_head_dim=16, block_size=8, seed=5)
    calls = {
        "paged_attention": lambda f: f(*x.args(), num_splits=2),
        "paged_attention_two_pass": lambda f: f(*x.args(), logits="scratch"),
        "paged_attention_fp8": lambda f: f(*fp8_reference.quantize_inputs(x)),
        "paged_attention_varlen": lambda f: f(*xv.args()),
        "mla_attention": lambda f: f(*xm.args(), scale=xm.scale),
    }
    out = {}
    for name in names:
        function = kernel_or_reference(name)
        result = calls[name](function).float()
        out[name] = dict(module=getattr(function, "__wrapped__", function).__module__,
                         values=result.tolist(), finite=bool(torch.isfinite(result).all()))
    return out


def test_kernel_or_reference_gives_the_references_without_triton():
    """Blocked, each name is its torch reference (never a function of a Triton module), takes
    the kernel's launch-only arguments, and says once that it ran instead."""
    done = python("""
        import json, sys, test_without_triton as t
        out = t.small_outputs()
        out["sys"] = sys.modules["triton"] is None
        print(json.dumps(out))
    """, block=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report.pop("sys") is True
    import pagedlab.kernels

    for name, got in report.items():
        assert got["module"].endswith("_reference") or got["module"] == \
            "pagedlab.kernels.reference", (name, got["module"])
        assert got["module"].removeprefix("pagedlab.kernels.") not in \
            pagedlab.kernels.TRITON_MODULES and got["finite"], name
        assert done.stdout.count(f"ran in place of the kernel {name}.") == 1, done.stdout


@needs_triton
def test_kernel_or_reference_gives_the_kernels_output_with_and_without_triton():
    """With Triton the kernels themselves (their own modules); blocked, the references; on the
    same small inputs the two agree."""
    code = "import json, test_without_triton as t; print(json.dumps(t.small_outputs()))"
    triton = python_json(code, block=False)
    without = python_json(code, block=True)
    import torch

    for name in triton:
        assert triton[name]["module"].removeprefix("pagedlab.kernels.") in \
            ("decode", "two_pass", "fp8", "varlen", "mla"), triton[name]["module"]
        assert without[name]["module"] != triton[name]["module"]
        a, b = (torch.tensor(side[name]["values"]) for side in (triton, without))
        assert a.shape == b.shape and torch.allclose(a, b, atol=2e-2, rtol=0), name


def test_the_kernel_modules_read_the_same_without_triton():
    """``pagedlab.kernels.decode`` and its siblings, blocked: their constants and plain
    functions as with Triton, every kernel's source readable (``.fn``), a launch an
    ImportError that names Triton, and ``import pagedlab.kernels.decode`` still failing."""
    report = python_json("""
        import importlib, inspect, json
        from pagedlab import kernels
        from pagedlab.book import show_source
        out = {"modules": sorted(kernels.TRITON_MODULES)}
        d = kernels.decode
        out["constants"] = [d.TILE_TOKENS, d.MIN_DOT, d.MAX_SPLITS, d.MIN_TOKENS_PER_SPLIT,
                            kernels.mla.HEADS_PER_PROGRAM,
                            d.choose_num_splits(1, 8, 32768, 132),
                            kernels.varlen.choose_query_tile(8, 2, 4)]
        out["sources"] = {m: [n for n, v in vars(getattr(kernels, m)).items()
                              if inspect.isfunction(getattr(v, "fn", None))
                              and "@triton.jit" in str(show_source(v))]
                          for m in sorted(kernels.TRITON_MODULES)}
        try:
            d._paged_attention_kernel[(1,)]()
        except ImportError as e:
            out["launch"] = str(e)
        try:
            importlib.import_module("pagedlab.kernels.decode")
        except ImportError as e:
            out["import"] = str(e)
        print(json.dumps(out))
    """, block=True)
    from pagedlab import kernels

    assert {f"pagedlab.kernels.{m}" for m in report["modules"]} == TRITON_ONLY
    if _installed("triton") and kernels.has_triton():
        from pagedlab.kernels import decode, mla, varlen

        assert report["constants"] == [
            decode.TILE_TOKENS, decode.MIN_DOT, decode.MAX_SPLITS, decode.MIN_TOKENS_PER_SPLIT,
            mla.HEADS_PER_PROGRAM, decode.choose_num_splits(1, 8, 32768, 132),
            varlen.choose_query_tile(8, 2, 4)]
    assert "_paged_attention_kernel" in report["sources"]["decode"]
    assert all(report["sources"][m] for m in report["sources"]), report["sources"]
    assert "needs Triton" in report["launch"] and "triton" in report["import"]
