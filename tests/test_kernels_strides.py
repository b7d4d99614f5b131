"""Views of every argument of every Triton kernel: the reference's result, or an error naming it.

A view keeps an argument's values under other strides: ``transposed`` (dims 0 and 1 swapped,
made contiguous, swapped back), ``every_other`` (twice the stride along dim 0, or along the last
dim for ``every_other_last``, with junk in the skipped entries) and ``expanded`` (stride 0 along
dim 0: row 0's values repeated). The kernels take the strides of queries, caches, block tables
and copy pairs; the rest must be rejected before launch: a head's vector that is not one run,
1-D metadata that is not contiguous, a written cache that is an expanded view, and copy_blocks'
caches that are not contiguous (they are copied as flat runs).
"""

import copy
import re
from dataclasses import dataclass, field

import pytest
import torch

from pagedlab.kernels import (
    copy_blocks,
    mla_decode,
    paged_attention,
    paged_attention_fp8,
    paged_attention_two_pass,
    reference,
    reshape_and_cache,
    reshape_and_cache_fp8,
)
from pagedlab.kernels import fp8_reference, mla_reference
from pagedlab.kernels.inputs import random_paged_inputs


def transposed(t):
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def every_other(t, dim=0):
    """t's values with twice its stride along ``dim``; the entries between hold junk (NaN, or
    block 0 for integers: a valid id that is the wrong one)."""
    shape = list(t.shape)
    shape[dim] *= 2
    junk = float("nan") if t.is_floating_point() else 0
    index = [slice(None)] * t.dim()
    index[dim] = slice(0, None, 2)
    view = torch.full(shape, junk, dtype=t.dtype, device=t.device)[tuple(index)]
    view.copy_(t)
    return view


VIEWS = {
    "transposed": transposed,
    "every_other": every_other,
    "every_other_last": lambda t: every_other(t, -1),
    "expanded": lambda t: t[:1].expand(t.shape),
}

UNIT_STRIDE = "must be contiguous in its last dimension"
CONTIGUOUS = "must be contiguous"


@dataclass
class Op:
    """A kernel, its torch reference, fresh arguments, and how its arguments group: a group's
    tensors take the same view (a value cache must have its key cache's strides)."""

    kernel: object
    reference: object
    make_args: object  # () -> dict of keyword arguments
    groups: dict  # group name -> argument names
    rejects: dict = field(default_factory=dict)  # (group, view) -> what the error says
    writes: tuple = ()  # arguments the kernel writes; empty: it returns its result
    tol: float = 1e-5


def decode_args(fp8=False):
    # fill=0: an expanded cache repeats block 0, which must hold no NaN for the reference.
    x = random_paged_inputs(
        [5, 12, 3], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, fill=0.0, seed=3
    )
    args = dict(zip(("query", "key_cache", "value_cache", "block_tables", "seq_lens"), x.args()))
    if fp8:
        names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "k_scale",
                 "v_scale")
        args = dict(zip(names, fp8_reference.quantize_inputs(x, per_head=True)))
    return args


DECODE_GROUPS = dict(
    query=("query",),
    caches=("key_cache", "value_cache"),
    block_tables=("block_tables",),
    seq_lens=("seq_lens",),
)
DECODE_REJECTS = {
    ("query", "every_other_last"): f"query {UNIT_STRIDE}",
    ("caches", "every_other_last"): f"key_cache {UNIT_STRIDE}",
    ("seq_lens", "every_other"): f"seq_lens {CONTIGUOUS}",
    ("seq_lens", "expanded"): f"seq_lens {CONTIGUOUS}",
}


def mla_args():
    x = mla_reference.random_mla_inputs(
        [5, 12, 3], num_heads=4, kv_lora_rank=16, rope_dim=16, nope_dim=8, v_head_dim=8,
        block_size=4, seed=3,
    )
    query = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(1))
    cache = x.latent_cache.nan_to_num(0.0)  # an expanded cache repeats block 0
    return dict(query=query, latent_cache=cache, block_tables=x.block_tables,
                seq_lens=x.seq_lens, kv_lora_rank=16, scale=0.25)


def write_args(fp8=False):
    g = torch.Generator().manual_seed(0)
    cache_dtype = fp8_reference.FP8 if fp8 else torch.float32
    key_cache = torch.randn(4, 4, 2, 16, generator=g).to(cache_dtype)  # 16 slots
    args = dict(
        key=torch.randn(5, 2, 16, generator=g),
        value=torch.randn(5, 2, 16, generator=g),
        key_cache=key_cache,
        value_cache=torch.randn(4, 4, 2, 16, generator=g).to(cache_dtype),
        slot_mapping=torch.tensor([9, 0, -1, 15, 4]),
    )
    if fp8:
        args.update(k_scale=torch.tensor([0.01, 0.02]), v_scale=torch.tensor([0.03, 0.01]))
    return args


WRITE_GROUPS = dict(
    kv=("key", "value"), caches=("key_cache", "value_cache"), slot_mapping=("slot_mapping",)
)
WRITE_REJECTS = {
    ("kv", "every_other_last"): f"key {UNIT_STRIDE}",
    ("caches", "every_other_last"): f"key_cache {UNIT_STRIDE}",
    ("caches", "expanded"): "key_cache is an expanded view",
    ("slot_mapping", "every_other"): f"slot_mapping {CONTIGUOUS}",
    ("slot_mapping", "expanded"): f"slot_mapping {CONTIGUOUS}",
}


def copy_args():
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(5, 2, 2, 4, generator=g) for _ in range(4)]
    return dict(key_caches=layers[:2], value_caches=layers[2:],
                block_mapping=torch.tensor([[0, 3], [1, 4], [1, 2]]))


OPS = {
    "decode": Op(paged_attention, reference.paged_attention, decode_args, DECODE_GROUPS,
                 DECODE_REJECTS),
    "decode_split": Op(
        lambda **a: paged_attention(**a, num_splits=2), reference.paged_attention, decode_args,
        DECODE_GROUPS, DECODE_REJECTS,
    ),
    "two_pass": Op(paged_attention_two_pass, reference.paged_attention, decode_args,
                   DECODE_GROUPS, DECODE_REJECTS),
    "two_pass_scratch": Op(
        lambda **a: paged_attention_two_pass(**a, logits="scratch"), reference.paged_attention,
        decode_args, DECODE_GROUPS, DECODE_REJECTS,
    ),
    "fp8": Op(
        paged_attention_fp8, fp8_reference.paged_attention_fp8, lambda: decode_args(fp8=True),
        {**DECODE_GROUPS, "scales": ("k_scale", "v_scale")}, DECODE_REJECTS,
    ),
    "mla": Op(
        mla_decode, mla_reference.mla_decode, mla_args,
        dict(query=("query",), latent_cache=("latent_cache",), block_tables=("block_tables",),
             seq_lens=("seq_lens",)),
        {**DECODE_REJECTS, ("latent_cache", "every_other_last"): f"latent_cache {UNIT_STRIDE}"},
    ),
    "reshape_and_cache": Op(
        reshape_and_cache, reference.reshape_and_cache, write_args, WRITE_GROUPS, WRITE_REJECTS,
        writes=("key_cache", "value_cache"),
    ),
    "reshape_and_cache_fp8": Op(
        reshape_and_cache_fp8, fp8_reference.reshape_and_cache_fp8, lambda: write_args(fp8=True),
        {**WRITE_GROUPS, "scales": ("k_scale", "v_scale")}, WRITE_REJECTS,
        writes=("key_cache", "value_cache"),
    ),
    "copy_blocks": Op(
        copy_blocks, reference.copy_blocks, copy_args,
        dict(caches=("key_caches", "value_caches"), block_mapping=("block_mapping",)),
        {
            **{("caches", v): f"key_caches[0] {CONTIGUOUS}" for v in VIEWS},
            # (src, dst) pairs repeated: a destination named twice
            ("block_mapping", "expanded"): "block_mapping[:, 1] names a destination block twice",
        },
        writes=("key_caches", "value_caches"),
    ),
}


def cases():
    for op_name, op in OPS.items():
        args = op.make_args()
        for group, names in op.groups.items():
            ndim = tensors(args[names[0]])[0].dim()
            for view in VIEWS:
                if ndim == 1 and view in ("transposed", "every_other_last"):
                    continue  # the same as every_other, or no second dimension
                yield pytest.param(op_name, group, view, id=f"{op_name}-{group}-{view}")


def tensors(arg) -> list:
    """An argument's tensors: copy_blocks' caches are lists of layers, a view applies to each."""
    return arg if isinstance(arg, list) else [arg]


def storage_bytes(t):
    """All of a tensor's storage, the bytes between a view's elements included."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


@pytest.mark.parametrize("op_name, group, view", list(cases()))
def test_a_view_gives_the_references_result_or_a_named_error(op_name, group, view):
    op = OPS[op_name]
    args = op.make_args()
    for name in op.groups[group]:
        views = [VIEWS[view](t) for t in tensors(args[name])]
        args[name] = views if isinstance(args[name], list) else views[0]
    error = op.rejects.get((group, view))
    if error is not None:
        before = copy.deepcopy(args)
        with pytest.raises(ValueError, match=re.escape(error)):
            op.kernel(**args)
        for name in op.writes:  # nothing was written
            for t, b in zip(tensors(args[name]), tensors(before[name])):
                assert torch.equal(storage_bytes(t), storage_bytes(b)), name
        return
    if op.writes:
        # The reference writes through the same views of a copy; every byte of the storages,
        # between the view's elements too, must come out the same.
        expected = copy.deepcopy(args)
        op.reference(**expected)
        op.kernel(**args)
        for name in op.writes:
            for t, w in zip(tensors(args[name]), tensors(expected[name])):
                assert torch.equal(storage_bytes(t), storage_bytes(w)), name
        return
    out = op.kernel(**args)
    dense = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    want = op.reference(**dense)
    assert not want.isnan().any()
    torch.testing.assert_close(out, want, atol=op.tol, rtol=op.tol)


def test_every_kernel_argument_is_viewed():
    """The table above covers every tensor argument of every kernel."""
    for op in OPS.values():
        tensors = {k for k, v in op.make_args().items() if isinstance(v, (torch.Tensor, list))}
        assert tensors == {n for names in op.groups.values() for n in names}


def test_a_value_cache_with_other_strides_than_its_key_cache_is_named():
    args = decode_args()
    args["value_cache"] = transposed(args["value_cache"])
    with pytest.raises(ValueError, match="value_cache must have key_cache.s strides"):
        paged_attention(**args)
