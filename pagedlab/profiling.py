"""Where an engine step's CPU time goes: torch.profiler's events summarized by class (chapter 8).

A row per kind of work: the model's matrix products, its attention and cache writes, the rest of
its ops (norms, rotary embeddings, activations, residual adds), the sampler, and the Python
around them: scheduling, the runner's input preparation, the model's module calls. Ops are
classed by the outermost aten op they run under (``aten::linear`` is a matrix product whatever
it calls) or, inside attention and the cache writes, by their scope; Python time is each of
the engine's ``record_function`` scopes (``pagedlab::*``) less the ops inside it.

:func:`decode_gemms` is the step's floor: the matrix products of a decode step, alone.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

# the engine's record_function scopes -> the class of everything inside them (None: class the
# ops by OP_CLASSES, the Python between them as the model's)
SCOPES = {
    "pagedlab::step": "scheduler",  # less the runner's scopes inside it
    "pagedlab::prepare": "runner: inputs",
    "pagedlab::forward": None,
    "pagedlab::attention": "attention",
    "pagedlab::cache_write": "cache writes",
    "pagedlab::sample": "sampler",
}
OP_CLASSES = {  # the outermost aten op of a forward-pass op outside attention -> class
    "aten::linear": "matrix products",
    "aten::matmul": "matrix products",
    "aten::mm": "matrix products",
    "aten::addmm": "matrix products",
}
OTHER_OPS = "norms, rotary, elementwise"
ROWS = ("matrix products", "attention", "cache writes", OTHER_OPS, "sampler", "scheduler",
        "runner: inputs", "model: Python")


def scope(name: str):
    """``record_function(name)`` while torch's profiler records, else nothing: entering a scope
    costs microseconds even when nobody profiles, and a step enters about sixty of them."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


@dataclass
class StepProfile:
    """CPU milliseconds per step by class, from ``steps`` profiled steps, and how many aten
    ops a step dispatches (outermost ones: each pays the framework's per-op overhead)."""

    ms: dict[str, float]
    steps: int
    ops_per_step: float

    @property
    def total_ms(self) -> float:
        return sum(self.ms.values())

    def share(self, row: str) -> float:
        return self.ms[row] / self.total_ms

    def rows(self) -> list[tuple[str, float, float]]:
        """(class, ms per step, share of the profiled time), in :data:`ROWS` order."""
        return [(row, self.ms[row], self.share(row)) for row in ROWS]


def classify(events, steps: int) -> StepProfile:
    """Sum torch.profiler's ``events`` into :data:`ROWS`, per step."""
    us, ops = defaultdict(float), 0
    for event in events:
        scope, outer, parent = None, None, event.cpu_parent
        while parent is not None:  # the nearest engine scope, the outermost aten op
            if scope is None and parent.name in SCOPES:
                scope = parent.name
            if parent.name.startswith("aten::"):
                outer = parent
            parent = parent.cpu_parent
        if event.name in SCOPES:  # the scope's own Python time
            us[SCOPES[event.name] or "model: Python"] += event.self_cpu_time_total
        elif event.name.startswith("aten::") and outer is None and scope is not None:
            row = SCOPES[scope] or OP_CLASSES.get(event.name, OTHER_OPS)
            us[row] += event.cpu_time_total  # the op and everything it calls
            ops += 1
    return StepProfile({row: us[row] / 1e3 / steps for row in ROWS}, steps, ops / steps)


def profile_steps(llm, steps: int) -> StepProfile:
    """Profile the next ``steps`` calls of ``llm.step()`` (run them on one thread)."""
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.step()
    return classify(prof.events(), steps)


@contextmanager
def _quiet_stderr():
    """torch's profiler (Kineto) logs its start and stop from C++ straight to file descriptor
    2, past Python's ``sys.stderr`` and into a chapter's output: point it at /dev/null."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def decode_gemms(model, batch: int):
    """(run, flops): a function that runs a decode step's matrix products alone, on the
    model's own weights and in the model's own shapes, for ``batch`` rows (the stacked q-k-v,
    o, gate, up and down products of every layer, and the output layer), and the FLOPs it
    does: 2 x rows x the weights it multiplies."""
    a, dev, dtype = model.args, model.device, model.dtype

    def rows(width):
        return torch.randn(batch, width, device=dev, dtype=dtype)

    x, heads, inner = rows(a.hidden_size), rows(a.num_heads * a.head_dim), rows(a.intermediate_size)
    layers = [(layer.self_attn, layer.mlp) for layer in model.model.layers]

    @torch.inference_mode()
    def run():
        for attn, mlp in layers:
            F.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias)  # [batch, (h + 2 kv) D]
            F.linear(heads, attn.o_proj.weight)
            F.linear(x, mlp.gate_proj.weight)  # [batch, inner]
            F.linear(x, mlp.up_proj.weight)
            F.linear(inner, mlp.down_proj.weight)
        F.linear(x, model.lm_head.weight)  # [batch, vocab]

    weights = sum(p.numel() for name, p in model.named_parameters()
                  if name.endswith("proj.weight")) + model.lm_head.weight.numel()
    return run, 2 * batch * weights


@dataclass
class DecodeWork:
    """What a decode step's matrix products and its attention each move and compute: the
    weights the products read once per step, the keys and values attention reads (every
    sequence's context, in every layer), and the FLOPs of each."""

    context_tokens: int  # all sequences' together
    weight_bytes: int
    kv_bytes: int
    gemm_flops: int
    attention_flops: int


def decode_work(model, context_lens: list[int]) -> DecodeWork:
    """:class:`DecodeWork` of one decode step of ``model`` over sequences of ``context_lens``
    cached tokens: attention does 2 x 2 FLOPs per context token, query head and head dim
    (q.k, then p.v), in every layer."""
    from pagedlab.footprint import kv_bytes_per_token

    a, size = model.args, model.dtype.itemsize
    _, gemm_flops = decode_gemms(model, len(context_lens))
    tokens = sum(context_lens)
    return DecodeWork(
        context_tokens=tokens,
        weight_bytes=gemm_flops // (2 * len(context_lens)) * size,
        kv_bytes=tokens * kv_bytes_per_token(a.footprint(), model.dtype),
        gemm_flops=gemm_flops,
        attention_flops=4 * tokens * a.num_heads * a.head_dim * a.num_layers,
    )


def what_is_left(profile: StepProfile, work: DecodeWork, batch: int) -> list[str]:
    """The profile of a decode step at ``batch`` read against :func:`decode_work`: two
    paragraphs, for ``bench_step.py``'s table and chapter 8."""
    gemm_ms, attention_ms = profile.ms["matrix products"], profile.ms["attention"]
    context = work.context_tokens / batch
    return [
        f"What is left, at batch {batch} (contexts of {context:.0f} tokens on average): "
        f"attention does {work.attention_flops / work.gemm_flops:.1%} of the matrix products' "
        f"FLOPs but took {attention_ms / gemm_ms:.0%} of their time. It follows bytes, not "
        f"FLOPs: each step it reads {work.kv_bytes / 2**20:.0f} MiB of keys and values, "
        f"{work.kv_bytes / work.weight_bytes:.0%} of the {work.weight_bytes / 2**20:.0f} MiB of "
        "weights the matrix products read, and eager torch has no CPU operation that reads a "
        "paged cache in place, so the reference copies them into a padded batch (one read, "
        "one write) before attention reads them again. A kernel that reads the blocks where "
        "they are (chapter 7's, on a GPU) saves the copy.",
        "",
        f"The other classes, {profile.total_ms - gemm_ms - attention_ms:.1f} ms per step under "
        f"the profiler, are small ops (the step dispatches {profile.ops_per_step:.0f} aten ops) "
        "and the Python between them, a few microseconds each whatever the batch: what a "
        "compiled or captured graph removes.",
    ]


def gemm_seconds(model, largest: int) -> dict[int, float]:
    """Seconds of a decode step's matrix products alone at batch 1, 2, 4, ... and ``largest``
    (median CPU time on a CPU, ``do_bench`` on a GPU)."""
    from pagedlab.timing import seconds_per_call

    batches = sorted({1, *(2**i for i in range(1, largest.bit_length())), largest})
    return {b: seconds_per_call(decode_gemms(model, b)[0]) for b in batches}


def floor_speedup(step_seconds: dict[int, float], output_lens: list[int],
                  batch_size: int | None = None) -> float:
    """How much faster than padded batching an engine with no overhead could decode: the cost
    of ``generate``'s steps (every row of a ``batch_size`` batch, all of them by default,
    until the batch's longest output ends) over the cost of continuous batching's steps (only
    the unfinished rows), a step at batch b costing ``step_seconds`` interpolated at b (from
    :func:`gemm_seconds`: its matrix products alone). Prefills and attention are left out.
    Where a small batch costs nearly what a full one does, a long tail of outputs bounds the
    ratio whatever the engine's overhead."""
    import numpy as np

    sizes = sorted(step_seconds)
    cost = [step_seconds[b] for b in sizes]
    lens = np.array(output_lens)
    batch_size = batch_size or len(lens)
    live = [int((lens > t).sum()) for t in range(int(lens.max()))]  # rows left at each step
    paged = float(np.interp(live, sizes, cost).sum())
    padded = sum(int(lens[i:i + batch_size].max()) * float(np.interp(len(lens[i:i + batch_size]),
                                                                     sizes, cost))
                 for i in range(0, len(lens), batch_size))
    return padded / paged
