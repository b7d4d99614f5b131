"""A KV-cache calculator: bytes per token and per request, and what fits on GPUs.

The text comes from :func:`kv_summary`, a pure function. :class:`KVCalculator` shows it under
controls that recompute it in the page itself, with no kernel behind them (the HTML book,
Colab, Jupyter): a few lines of JavaScript redo :func:`kv_summary`'s arithmetic from
:func:`calculator_data`, numbers the package computed for every preset, and
``tests/test_browser.py`` holds the page's text equal to :func:`kv_summary`'s.
:func:`kv_presets` tabulates every model preset.
"""

from __future__ import annotations

import itertools
import json
from html import escape

from pagedlab.dtypes import DTYPE_BYTES
from pagedlab.footprint import (
    MODELS, get_model, kv_bytes, kv_bytes_per_token, kv_capacity, kv_copies, weight_bytes,
)
from pagedlab.hardware import GPUS, GiB, KiB
from pagedlab.viz.tables import NOT_APPLICABLE, Table

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
            else ("> 8", NOT_APPLICABLE)
        rows.append([m.name, m.attention.upper(), f"{kv_bytes_per_token(m, dtype) / KiB:,.1f}",
                     f"{kv_bytes(m, context_len, dtype) / GiB:,.3f}",
                     f"{weight_bytes(m, weight_dtype) / GiB:,.1f}", gpus, seqs])
    return Table(["model", "attention", "KV per token (KiB)",
                  f"KV per {context_len:,}-token request (GiB)", f"weights in {weight_dtype} (GiB)",
                  f"{gpu}s needed", f"sequences of {context_len:,} tokens"], rows)


CHOICES = dict(model=list(MODELS), dtype=list(DTYPE_BYTES), gpu=list(GPUS),
               num_gpus=[1, 2, 4, 8], weight_dtype=["fp16", "bf16", "fp8"])
LABELS = dict(model="model", dtype="KV dtype", gpu="GPU", num_gpus="GPUs",
              weight_dtype="weights", context_len="context")
UTILIZATION = 0.9  # kv_capacity's default gpu_memory_utilization, the one kv_summary uses


def calculator_data() -> dict:
    """Everything :func:`kv_summary` reads, per preset: a model's attention, KV bytes per token
    in each KV dtype, weight bytes in each weight dtype and KV copies on 1 to 8 GPUs (or why
    that count cannot split it); a GPU's memory. The page's script only multiplies, subtracts,
    divides and formats these."""
    models = {}
    for name in CHOICES["model"]:
        m = get_model(name)
        copies = {}
        for n in CHOICES["num_gpus"]:
            try:
                copies[n] = kv_copies(m, n)
            except ValueError as err:
                copies[n] = str(err)
        models[name] = dict(
            name=m.name, attention=m.attention.upper(), copies=copies,
            per_token={d: kv_bytes_per_token(m, d) for d in CHOICES["dtype"]},
            weights={d: weight_bytes(m, d) for d in CHOICES["weight_dtype"]})
    return dict(models=models, gpus={g: GPUS[g].memory_bytes for g in CHOICES["gpu"]},
                utilization=UTILIZATION, KiB=KiB, GiB=GiB)


# Recomputes the summary of the calculator rooted at ROOT from DATA whenever a control changes;
# line for line what kv_summary prints (numbers rounded half to even, as Python's format).
_SCRIPT = """
(function () {
  var root = document.getElementById("ROOT"), data = DATA, out = root.querySelector("pre");
  function fixed(x, d) {
    return new Intl.NumberFormat("en-US", {minimumFractionDigits: d, maximumFractionDigits: d,
                                           roundingMode: "halfEven"}).format(x);
  }
  function whole(x) { return x.toLocaleString("en-US"); }
  function summary(v) {
    var m = data.models[v.model], n = +v.num_gpus, ctx = Number(v.context_len);
    if (!Number.isInteger(ctx) || ctx < 1) return "context_len=" + v.context_len + " must be a whole number of tokens >= 1";
    var copies = m.copies[n];
    if (typeof copies === "string") return copies;
    var perToken = m.per_token[v.dtype], weights = m.weights[v.weight_dtype];
    var budget = Math.trunc(data.utilization * data.gpus[v.gpu] * n);
    var lines = [
      m.name + " (" + m.attention + "), KV cache in " + v.dtype + ", on " + n + " x " + v.gpu,
      "KV per token:    " + whole(perToken) + " bytes (" + fixed(perToken / data.KiB, 1) + " KiB)",
      "KV per request:  " + fixed(ctx * perToken / data.GiB, 3) + " GiB for " + whole(ctx) + " tokens",
      "Weights:         " + fixed(weights / data.GiB, 1) + " GiB in " + v.weight_dtype +
        " of a " + fixed(budget / data.GiB, 1) + " GiB budget"];
    if (weights > budget) return lines.concat(["The weights alone do not fit on " + n + " x " + v.gpu + "."]).join("\\n");
    var room = budget - weights, slots = Math.floor(room / (perToken * copies));
    return lines.concat([
      "KV room:         " + fixed(room / data.GiB, 2) + " GiB = " + whole(slots) + " token slots",
      "Max sequences:   " + whole(Math.floor(slots / ctx)) + " of " + whole(ctx) + " tokens at once"
    ]).join("\\n");
  }
  function update() {
    var v = {};
    root.querySelectorAll("[data-key]").forEach(function (c) { v[c.dataset.key] = c.value; });
    out.textContent = summary(v);
  }
  root.querySelectorAll("[data-key]").forEach(function (c) {
    c.addEventListener("input", update); c.addEventListener("change", update);
  });
})();
"""

_ids = itertools.count()


class KVCalculator:
    """The calculator, starting from :data:`DEFAULTS` updated with ``initial``: controls and
    the summary as HTML that recomputes in the page (no kernel needed), the summary alone as
    text (a terminal, the grader)."""

    def __init__(self, **initial):
        unknown = set(initial) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"kv_calculator: unknown setting(s) {sorted(unknown)}; "
                             f"known: {sorted(DEFAULTS)}")
        self.values = {**DEFAULTS, **initial}
        for key, options in CHOICES.items():
            if self.values[key] not in options:
                raise ValueError(f"kv_calculator: {key}={self.values[key]!r} is not one of "
                                 f"{options}")

    def _control(self, key: str) -> str:
        value = self.values[key]
        if key == "context_len":
            field = (f'<input type="number" data-key="{key}" min="1" step="1024" '
                     f'value="{value}" style="width:7em">')
        else:
            options = "".join(f'<option{" selected" if o == value else ""}>{escape(str(o))}'
                              f"</option>" for o in CHOICES[key])
            field = f'<select data-key="{key}">{options}</select>'
        return f'<label style="margin-right:1em;white-space:nowrap">{LABELS[key]} {field}</label>'

    def _repr_html_(self) -> str:
        root = f"pagedlab-calculator-{next(_ids)}"
        controls = "".join(self._control(k) for k in LABELS)
        script = (_SCRIPT.replace("ROOT", root)
                  .replace("DATA", json.dumps(calculator_data(), separators=(",", ":"))))
        return (f'<div class="pagedlab-calculator" id="{root}"><div>{controls}</div>'
                f"<pre>{escape(repr(self))}</pre><script>{script}</script></div>")

    def __repr__(self) -> str:
        return kv_summary(**self.values)


def kv_calculator(**initial) -> KVCalculator:
    """The calculator, starting from :data:`DEFAULTS` updated with ``initial``."""
    return KVCalculator(**initial)
