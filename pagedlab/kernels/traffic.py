"""Bytes a decode kernel loads and stores: counted by formula, and counted in the interpreter.

The formulas (:func:`decode_traffic`, :func:`mla_traffic`) follow each kernel's loops: per
(sequence, KV head) program, every token's key and value row, one block-table entry per token
per pass, the group's queries once. :func:`count_traffic` checks them: while it is active, every
load and store the Triton interpreter executes is recorded, and each byte is credited to the
named tensor whose memory it touched. On a CPU the interpreter runs a kernel on the tensors' own
memory, so an address says which tensor it belongs to.

The counts are of bytes the kernel asks for, which is what its loops decide. They are not DRAM
traffic on a GPU, where a re-read may hit in L2 and a load instruction moves whole sectors.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from pagedlab._arith import cdiv
from pagedlab.device import INTERPRET, has_triton
from pagedlab.dtypes import dtype_bytes

__all__ = [
    "Traffic",
    "DECODE_KERNELS",
    "decode_traffic",
    "mla_traffic",
    "count_traffic",
    "CAN_COUNT",
    "WHY_NOT",
]

DECODE_KERNELS = ("one_pass", "two_pass", "two_pass_scratch")
LOGIT_BYTES = 4  # the scratch logits are fp32
INDEX_BYTES = 4  # block table entries and sequence lengths are int32


@dataclass
class Traffic:
    """Bytes loaded from and stored to each named tensor."""

    loaded: dict[str, int] = field(default_factory=dict)
    stored: dict[str, int] = field(default_factory=dict)

    def of(self, *names: str) -> int:
        """Bytes loaded from the named tensors together."""
        return sum(self.loaded.get(n, 0) for n in names)


def _lens(seq_lens) -> list[int]:
    return seq_lens.tolist() if isinstance(seq_lens, Tensor) else [int(n) for n in seq_lens]


def decode_traffic(
    kernel: str,
    seq_lens,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache_dtype="fp16",
    query_dtype=None,
) -> Traffic:
    """What one decode step loads and stores, by formula, for a kernel of :data:`DECODE_KERNELS`.

    With N the tokens of all sequences, n the KV heads, d the head dim and b bytes per cached
    value, each kernel loads the key cache ``passes_k * N n d b`` and the value cache
    ``N n d b`` bytes: ``one_pass`` (``pagedlab.kernels.paged_attention`` without split-KV)
    reads keys once; ``two_pass`` reads them twice; ``two_pass_scratch`` once, plus the fp32
    logits written in pass 1 and loaded in pass 2 (4 N H bytes each, H query heads). Every pass
    loads one int32 block-table entry per token per KV head. ``query_dtype`` defaults to the
    cache's.
    """
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"kernel={kernel!r} must be one of {DECODE_KERNELS}")
    lens = _lens(seq_lens)
    tokens, seqs = sum(lens), len(lens)
    b = dtype_bytes(cache_dtype)
    bq = dtype_bytes(query_dtype or cache_dtype)
    row = tokens * num_kv_heads * head_dim * b  # every token's row of one cache, once
    passes = 1 if kernel == "one_pass" else 2
    loaded = {
        "key_cache": row * (2 if kernel == "two_pass" else 1),
        "value_cache": row,
        "block_tables": passes * tokens * num_kv_heads * INDEX_BYTES,
        "query": seqs * num_heads * head_dim * bq,
        "seq_lens": seqs * num_kv_heads * INDEX_BYTES,  # one per program
    }
    stored = {"out": seqs * num_heads * head_dim * bq}
    if kernel == "two_pass_scratch":
        loaded["logits"] = stored["logits"] = tokens * num_heads * LOGIT_BYTES
    return Traffic(loaded, stored)


def mla_traffic(
    seq_lens,
    *,
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    heads_per_program: int,
    cache_dtype="fp16",
) -> Traffic:
    """What :func:`pagedlab.kernels.mla.mla_decode` loads from its latent cache, by formula.

    Each program serves ``heads_per_program`` query heads and reads every token's latent row
    (kv_lora_rank + rope_dim values) once, for keys and values alike; a sequence has
    ceil(num_heads / heads_per_program) programs, each reading the whole row.
    """
    tokens = sum(_lens(seq_lens))
    programs_per_seq = cdiv(num_heads, heads_per_program)
    row = (kv_lora_rank + rope_dim) * dtype_bytes(cache_dtype)
    return Traffic(
        loaded={
            "latent_cache": programs_per_seq * tokens * row,
            "block_tables": programs_per_seq * tokens * INDEX_BYTES,
        }
    )


# ---------------------------------------------------------------------------------------------
# Counting in the interpreter


def _interpreter_hook():
    """The interpreter's builder class if its masked load and store can be wrapped, else a
    string saying why not (no interpreter, or a Triton whose interpreter changed)."""
    if not has_triton():
        return "Triton cannot be imported, so no kernel runs for its loads to be counted"
    if not INTERPRET:
        return "kernels are compiled for the GPU here, so no Python code sees their loads"
    try:
        from triton.runtime.interpreter import InterpreterBuilder
    except ImportError as e:  # pragma: no cover - depends on the Triton release
        return f"triton.runtime.interpreter has no InterpreterBuilder ({e})"
    expected = {"create_masked_load": ["ptrs", "mask"], "create_masked_store": ["ptrs", "value"]}
    for name, first in expected.items():
        method = getattr(InterpreterBuilder, name, None)
        params = list(inspect.signature(method).parameters)[1:3] if method else None
        if params != first:
            return f"InterpreterBuilder.{name} is not ({', '.join(first)}, ...) in this Triton"
    return InterpreterBuilder


_HOOK = _interpreter_hook()
CAN_COUNT: bool = not isinstance(_HOOK, str)
WHY_NOT: str = "" if CAN_COUNT else _HOOK


class _Counter:
    """Credits each masked-in address of a load or store to the named tensor that holds it;
    addresses in none of them (a buffer the kernel's wrapper allocated) go to ``"other"``."""

    def __init__(self, tensors: dict[str, Tensor]):
        self.spans = {}  # name -> [start, end) of its storage's bytes
        for name, t in tensors.items():
            storage = t.untyped_storage()
            self.spans[name] = (storage.data_ptr(), storage.data_ptr() + storage.nbytes())
        names = [*tensors, "other"]
        self.traffic = Traffic(dict.fromkeys(names, 0), dict.fromkeys(names, 0))

    def record(self, table: dict[str, int], ptrs, mask) -> None:
        # Newer Triton names a pointer handle's element type with a method, older by its dtype.
        element = getattr(ptrs, "get_element_ty", lambda: ptrs.dtype.element_ty)()
        width = element.primitive_bitwidth // 8
        addrs = np.broadcast_to(ptrs.data, mask.data.shape)[mask.data]  # uint64 addresses
        unclaimed = len(addrs)
        for name, (start, end) in self.spans.items():
            hits = int(((addrs >= start) & (addrs < end)).sum())
            table[name] += hits * width
            unclaimed -= hits
        table["other"] += unclaimed * width


@contextmanager
def count_traffic(**tensors: Tensor):
    """Within the block, count the bytes interpreted kernels load from and store to each tensor.

    >>> with count_traffic(key_cache=k, value_cache=v) as traffic:
    ...     paged_attention(q, k, v, tables, lens)
    >>> traffic.loaded["key_cache"]

    Yields a :class:`Traffic` filled in as kernels run, with an ``"other"`` entry for memory
    none of the named tensors holds. Masked-off lanes count nothing. Raises RuntimeError where
    the loads cannot be seen (see :data:`WHY_NOT`).
    """
    if not CAN_COUNT:
        raise RuntimeError(f"cannot count loads: {WHY_NOT}")
    for name, t in tensors.items():
        if t.device.type != "cpu":  # the interpreter would run on a host copy, elsewhere
            raise ValueError(f"{name} must be on the CPU to be counted, got {t.device}")
    builder, counter = _HOOK, _Counter(tensors)
    load, store = builder.create_masked_load, builder.create_masked_store

    @functools.wraps(load)
    def counted_load(self, ptrs, mask, *args, **kwargs):
        counter.record(counter.traffic.loaded, ptrs, mask)
        return load(self, ptrs, mask, *args, **kwargs)

    @functools.wraps(store)
    def counted_store(self, ptrs, value, mask, *args, **kwargs):
        counter.record(counter.traffic.stored, ptrs, mask)
        return store(self, ptrs, value, mask, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = counted_load, counted_store
    try:
        yield counter.traffic
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store
