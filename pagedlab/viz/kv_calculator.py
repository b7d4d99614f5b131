"""An ipywidgets KV-cache calculator: bytes per token and per request, and what fits on GPUs.

The text comes from :func:`kv_summary`, a pure function, so a notebook can print it for the
defaults (what nbval sees) beside the live widget. A published page has no kernel behind its
controls, so :func:`kv_presets` tabulates every model preset for the book to show as well.
"""

from __future__ import annotations

import ipywidgets as widgets

from pagedlab.dtypes import DTYPE_BYTES
from pagedlab.footprint import (
    MODELS, get_model, kv_bytes, kv_bytes_per_token, kv_capacity, weight_bytes,
)
from pagedlab.hardware import GPUS, GiB, KiB
from pagedlab.viz.tables import Table

DEFAULTS = dict(
    model="OPT-13B", dtype="fp16", gpu="A100-40GB", context_len=2048, num_gpus=1,
    weight_dtype="fp16",
)


def kv_summary(
    model: str, dtype: str, gpu: str, context_len: int, num_gpus: int, weight_dtype: str
) -> str:
    """What one token and one request cost, and how many requests fit beside the weights."""
    m = get_model(model)
    per_token = kv_bytes_per_token(m, dtype)
    per_request = kv_bytes(m, context_len, dtype)
    cap = kv_capacity(m, gpu, num_gpus=num_gpus, dtype=dtype, weight_dtype=weight_dtype)
    lines = [
        f"{m.name} ({m.attention.upper()}), KV cache in {dtype}, on {num_gpus} x {gpu}",
        f"KV per token:    {per_token:,} bytes ({per_token / KiB:,.1f} KiB)",
        f"KV per request:  {per_request / GiB:,.3f} GiB for {context_len:,} tokens",
        f"Weights:         {cap.weight_bytes / GiB:,.1f} GiB in {weight_dtype}"
        f" of a {cap.budget_bytes / GiB:,.1f} GiB budget",
    ]
    if not cap.weights_fit:
        return "\n".join([*lines, f"The weights alone do not fit on {num_gpus} x {gpu}."])
    return "\n".join([
        *lines,
        f"KV room:         {cap.kv_bytes / GiB:,.2f} GiB = {cap.token_slots:,} token slots",
        f"Max sequences:   {cap.token_slots // context_len:,} of {context_len:,} tokens at once",
    ])


def kv_presets(gpu: str = DEFAULTS["gpu"], context_len: int = DEFAULTS["context_len"],
               dtype: str = DEFAULTS["dtype"], weight_dtype: str = DEFAULTS["weight_dtype"]) -> Table:
    """Every model preset on the fewest of ``gpu`` (1, 2, 4 or 8) that hold its weights."""
    rows = []
    for name in MODELS:
        m = get_model(name)
        fits = [(n, cap) for n in (1, 2, 4, 8) if (cap := kv_capacity(
            m, gpu, num_gpus=n, dtype=dtype, weight_dtype=weight_dtype)).weights_fit]
        gpus, seqs = (f"{fits[0][0]}", f"{fits[0][1].token_slots // context_len:,}") if fits \
            else ("> 8", "")
        rows.append([m.name, m.attention.upper(), f"{kv_bytes_per_token(m, dtype) / KiB:,.1f}",
                     f"{kv_bytes(m, context_len, dtype) / GiB:,.3f}",
                     f"{weight_bytes(m, weight_dtype) / GiB:,.1f}", gpus, seqs])
    return Table(["model", "attention", "KV per token (KiB)",
                  f"KV per {context_len:,}-token request (GiB)", f"weights in {weight_dtype} (GiB)",
                  f"{gpu}s needed", f"sequences of {context_len:,} tokens"], rows)


def kv_calculator(**initial) -> widgets.VBox:
    """The calculator, starting from :data:`DEFAULTS` updated with ``initial``."""
    start = {**DEFAULTS, **initial}

    def dropdown(key, options, label):
        return widgets.Dropdown(options=options, value=start[key], description=label)

    controls = dict(
        model=dropdown("model", list(MODELS), "model"),
        dtype=dropdown("dtype", list(DTYPE_BYTES), "KV dtype"),
        gpu=dropdown("gpu", list(GPUS), "GPU"),
        num_gpus=dropdown("num_gpus", [1, 2, 4, 8], "GPUs"),
        weight_dtype=dropdown("weight_dtype", ["fp16", "bf16", "fp8"], "weights"),
        context_len=widgets.BoundedIntText(
            value=start["context_len"], min=1, max=1 << 20, step=1024, description="context"
        ),
    )
    output = widgets.interactive_output(lambda **kw: print(kv_summary(**kw)), controls)
    items = list(controls.values())
    return widgets.VBox([widgets.HBox(items[:3]), widgets.HBox(items[3:]), output])
