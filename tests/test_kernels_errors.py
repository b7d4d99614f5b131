"""Bad arguments: every check raises before anything runs, in the reference and the kernels alike.

Each case breaks one argument of a valid call, ``change(args) -> {name: bad value}``, and
expects an error whose message names it. The Triton kernels are replaced by a trap that fails
if launched, and the caches of the cache operations must come out unchanged.
"""

import importlib
import os
import subprocess
import sys

import pytest
import torch

import pagedlab.kernels as triton_impl
from pagedlab.device import HAS_CUDA
from pagedlab.kernels import reference, tiles
from pagedlab.kernels.inputs import random_paged_inputs

IMPLS = pytest.mark.parametrize("impl", [reference, triton_impl], ids=["reference", "triton"])


class Trap:
    """Stands in for a Triton kernel: launching it fails the test."""

    def __getitem__(self, grid):
        raise AssertionError("a kernel was launched despite a bad argument")


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    decode = importlib.import_module("pagedlab.kernels.decode")
    cache_ops = importlib.import_module("pagedlab.kernels.cache_ops")
    for module, name in [
        (decode, "_paged_attention_kernel"),
        (decode, "_merge_splits_kernel"),
        (cache_ops, "_reshape_and_cache_kernel"),
        (cache_ops, "_copy_blocks_kernel"),
    ]:
        monkeypatch.setattr(module, name, Trap())


def strided_like(t):
    """t's values and shape with other strides: dims 1 and 2 swapped in memory."""
    return t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def strided_last(t):
    """t's values and shape with stride 2 in the last dimension."""
    return t.repeat_interleave(2, dim=-1)[..., ::2]


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def i64(*values):
    return torch.tensor(values, dtype=torch.int64)


def run_case(cases, case, args, fn):
    error, match, change = cases[case]
    args.update(change(args))
    with pytest.raises(error, match=match):
        fn(**args)


# ---------------------------------------------------------------------------------------------
# paged_attention: sequences of 5 and 12 tokens in blocks of 4, tables 4 entries wide.


def attention_args():
    x = random_paged_inputs([5, 12], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                            device="cpu")  # checks run before any launch, on any device
    return dict(zip(["query", "key_cache", "value_cache", "block_tables", "seq_lens"], x.args()))


ATTENTION_CASES = {
    "query list": (TypeError, "query must be a torch.Tensor", lambda a: dict(query=[[0.0]])),
    "query 2-D": (ValueError, "query must have 3 dim", lambda a: dict(query=a["query"][0])),
    "query int": (TypeError, "query must be torch.float32", lambda a: dict(query=a["query"].int())),
    "query strided": (
        ValueError,
        "query must be contiguous in its last dimension",
        lambda a: dict(query=strided_last(a["query"])),
    ),
    "key_cache dtype": (
        TypeError,
        "key_cache must have query's dtype",
        lambda a: dict(key_cache=a["key_cache"].half()),
    ),
    "key_cache 3-D": (
        ValueError,
        "key_cache must have 4 dim",
        lambda a: dict(key_cache=a["key_cache"][0]),
    ),
    "value_cache shape": (
        ValueError,
        "value_cache must have key_cache's shape",
        lambda a: dict(value_cache=a["value_cache"][:-1]),
    ),
    "value_cache strides": (
        ValueError,
        "value_cache must have key_cache's strides",
        lambda a: dict(value_cache=strided_like(a["value_cache"])),
    ),
    "head_dim": (
        ValueError,
        "key_cache has head_dim 16 but query has head_dim 8",
        lambda a: dict(query=a["query"][..., :8]),
    ),
    "num_heads": (
        ValueError,
        "num_heads=3 must be a multiple of key_cache's num_kv_heads=2",
        lambda a: dict(query=a["query"][:, :3]),
    ),
    "block_tables int64": (
        TypeError,
        "block_tables must be torch.int32",
        lambda a: dict(block_tables=a["block_tables"].long()),
    ),
    "block_tables rows": (
        ValueError,
        "block_tables must have 2 rows",
        lambda a: dict(block_tables=a["block_tables"][:1]),
    ),
    "block_tables device": (
        ValueError,
        "block_tables must be on cpu",
        lambda a: dict(block_tables=a["block_tables"].to("meta")),
    ),
    "seq_lens int64": (
        TypeError,
        "seq_lens must be torch.int32",
        lambda a: dict(seq_lens=i64(5, 12)),
    ),
    "seq_lens rows": (ValueError, "seq_lens must have 2 rows", lambda a: dict(seq_lens=i32(5))),
    "seq_len 0": (ValueError, r"seq_lens\[1\] = 0 must be", lambda a: dict(seq_lens=i32(5, 0))),
    "seq_len past capacity": (
        ValueError,
        r"seq_lens\[0\] = 17 must be in \[1, 16\]",
        lambda a: dict(seq_lens=i32(17, 12)),
    ),
    "block id": (
        ValueError,
        r"block_tables\[0, 1\] = 99 is not a block of key_cache",
        lambda a: dict(block_tables=a["block_tables"].index_put((i64(0), i64(1)), i32(99))),
    ),
    "scale 0": (ValueError, "scale=0.0 must be > 0", lambda a: dict(scale=0.0)),
}


@IMPLS
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_paged_attention_rejects(impl, case):
    run_case(ATTENTION_CASES, case, attention_args(), impl.paged_attention)


def test_paged_attention_ignores_table_entries_past_the_last_block():
    """Entries a sequence never reads may hold anything, as unused table entries do."""
    args = attention_args()
    expected = reference.paged_attention(**args)
    args["block_tables"][0, 2:] = -1  # sequence 0 (5 tokens) reads entries 0 and 1 only
    assert torch.equal(reference.paged_attention(**args), expected)


@pytest.mark.skipif(HAS_CUDA, reason="the import order matters only to the interpreter")
def test_triton_imported_before_pagedlab_is_reported():
    """Triton's library functions (tl.sum, ...) cannot run in the interpreter if triton was
    imported before pagedlab set TRITON_INTERPRET=1: the kernel says so instead of failing."""
    script = (
        "import triton, torch, pytest\n"
        "from pagedlab.kernels import paged_attention\n"
        "from pagedlab.kernels.inputs import random_paged_inputs\n"
        "x = random_paged_inputs([3], num_heads=2, num_kv_heads=2, head_dim=16, block_size=4)\n"
        "with pytest.raises(RuntimeError, match='import pagedlab before triton'):\n"
        "    paged_attention(*x.args())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("num_splits", [0, 1.5, True])
def test_num_splits_must_be_a_positive_int(num_splits):
    with pytest.raises(ValueError, match="num_splits"):
        triton_impl.paged_attention(**attention_args(), num_splits=num_splits)


# ---------------------------------------------------------------------------------------------
# Cache operations: the caches must be unchanged after the error.


def cache_args():
    g = torch.Generator().manual_seed(0)
    key_cache = torch.randn(3, 4, 2, 8, generator=g)  # 12 slots
    return dict(
        key=torch.randn(3, 2, 8, generator=g),
        value=torch.randn(3, 2, 8, generator=g),
        key_cache=key_cache,
        value_cache=torch.randn_like(key_cache),
        slot_mapping=i64(0, 5, -1),
    )


CACHE_CASES = {
    "key 2-D": (ValueError, "key must have 3 dim", lambda a: dict(key=a["key"][0])),
    "key int": (TypeError, "key must be torch.float32", lambda a: dict(key=a["key"].int())),
    "value shape": (
        ValueError,
        "value must have key's shape",
        lambda a: dict(value=a["value"][:2]),
    ),
    "key strided": (
        ValueError,
        "key must be contiguous in its last dimension",
        lambda a: dict(key=strided_last(a["key"]), value=strided_last(a["value"])),
    ),
    "key_cache dtype": (
        TypeError,
        "key_cache must have key's dtype",
        lambda a: dict(key_cache=a["key_cache"].half()),
    ),
    "value_cache shape": (
        ValueError,
        "value_cache must have key_cache's shape",
        lambda a: dict(value_cache=a["value_cache"][:2]),
    ),
    "heads": (
        ValueError,
        r"key has \(num_kv_heads, head_dim\) = \(1, 8\) but key_cache holds \(2, 8\)",
        lambda a: dict(key=a["key"][:, :1], value=a["value"][:, :1]),
    ),
    "slot_mapping int32": (
        TypeError,
        "slot_mapping must be torch.int64",
        lambda a: dict(slot_mapping=i32(0, 5, -1)),
    ),
    "slot_mapping rows": (
        ValueError,
        "slot_mapping must have 3 rows",
        lambda a: dict(slot_mapping=i64(0, 5)),
    ),
    "slot past the cache": (
        ValueError,
        r"slot_mapping\[1\] = 12 is past the cache's last slot",
        lambda a: dict(slot_mapping=i64(0, 12, 1)),
    ),
}


@IMPLS
@pytest.mark.parametrize("case", CACHE_CASES)
def test_reshape_and_cache_rejects(impl, case):
    args = cache_args()
    caches = [args["key_cache"], args["value_cache"]]
    before = [c.clone() for c in caches]
    run_case(CACHE_CASES, case, args, impl.reshape_and_cache)
    assert all(torch.equal(c, b) for c, b in zip(caches, before))


def copy_args():
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(6, 4, 2, 8, generator=g) for _ in range(4)]
    return dict(key_caches=layers[:2], value_caches=layers[2:], block_mapping=i64([0, 3], [1, 4]))


COPY_CASES = {
    "key_caches a tensor": (
        TypeError,
        "key_caches must be a non-empty list",
        lambda a: dict(key_caches=a["key_caches"][0]),
    ),
    "key_caches empty": (
        TypeError,
        "key_caches must be a non-empty",
        lambda a: dict(key_caches=[]),
    ),
    "layer counts": (
        ValueError,
        r"len\(value_caches\)=1 must equal len\(key_caches\)=2",
        lambda a: dict(value_caches=a["value_caches"][:1]),
    ),
    "layer shape": (
        ValueError,
        r"key_caches\[1\] must have key_caches\[0\]'s shape",
        lambda a: dict(key_caches=[a["key_caches"][0], a["key_caches"][1][:5]]),
    ),
    "layer dtype": (
        TypeError,
        r"value_caches\[1\] must have key_caches\[0\]'s dtype",
        lambda a: dict(value_caches=[a["value_caches"][0], a["value_caches"][1].half()]),
    ),
    "not contiguous": (
        ValueError,
        r"key_caches\[0\] must be contiguous",
        lambda a: dict(key_caches=[strided_like(c) for c in a["key_caches"]]),
    ),
    "block_mapping int32": (
        TypeError,
        "block_mapping must be torch.int64",
        lambda a: dict(block_mapping=i32([0, 3])),
    ),
    "block_mapping shape": (
        ValueError,
        r"block_mapping must have shape \[num_pairs, 2\]",
        lambda a: dict(block_mapping=i64([0, 3, 4])),
    ),
    "block id": (
        ValueError,
        r"block_mapping\[1, 1\] = 6 is not a block",
        lambda a: dict(block_mapping=i64([0, 3], [1, 6])),
    ),
    "dst twice": (ValueError, "twice", lambda a: dict(block_mapping=i64([0, 3], [1, 3]))),
    "dst is a src": (
        ValueError,
        "also a source",
        lambda a: dict(block_mapping=i64([0, 3], [3, 4])),
    ),
}


@IMPLS
@pytest.mark.parametrize("case", COPY_CASES)
def test_copy_blocks_rejects(impl, case):
    args = copy_args()
    caches = args["key_caches"] + args["value_caches"]
    before = [c.clone() for c in caches]
    run_case(COPY_CASES, case, args, impl.copy_blocks)
    assert all(torch.equal(c, b) for c, b in zip(caches, before))


SWAP_CASES = {
    "dst dtype": (
        TypeError,
        "dst_cache must have src_cache's dtype",
        lambda a: dict(dst_cache=a["dst_cache"].half()),
    ),
    "dst block shape": (
        ValueError,
        "dst_cache's blocks must have src_cache's block shape",
        lambda a: dict(dst_cache=a["dst_cache"][:, :2]),
    ),
    "block_mapping int32": (
        TypeError,
        "block_mapping must be torch.int64",
        lambda a: dict(block_mapping=i32([0, 1])),
    ),
    "src id": (
        ValueError,
        "is not a block of src_cache",
        lambda a: dict(block_mapping=i64([6, 1])),
    ),
    "dst id": (
        ValueError,
        "is not a block of dst_cache",
        lambda a: dict(block_mapping=i64([0, 3])),
    ),
    "dst twice": (ValueError, "twice", lambda a: dict(block_mapping=i64([0, 1], [2, 1]))),
}


@IMPLS
@pytest.mark.parametrize("case", SWAP_CASES)
def test_swap_blocks_rejects(impl, case):
    dst = torch.zeros(3, 4, 2, 8)
    args = dict(src_cache=torch.randn(6, 4, 2, 8), dst_cache=dst, block_mapping=i64([0, 1]))
    run_case(SWAP_CASES, case, args, impl.swap_blocks)
    assert not dst.any()


def test_cpu_tensors_without_the_interpreter_are_reported(monkeypatch):
    """A CPU tensor handed to a compiled (not interpreted) Triton kernel gets a clear error
    before any launch, as on a GPU machine whose caller forgot to move the model."""
    monkeypatch.setattr(tiles, "INTERPRET", False)
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors, got tensors on cpu"):
        triton_impl.paged_attention(**attention_args())
    args = cache_args()
    before = args["key_cache"].clone()
    with pytest.raises(ValueError, match="need CUDA tensors"):
        triton_impl.reshape_and_cache(**args)
    assert torch.equal(args["key_cache"], before)


@IMPLS
def test_check_values_false_skips_only_the_checks_that_read_values(impl):
    """An engine passes check_values=False for slots and tables it built, sparing a device sync
    per call. A bad value then goes unchecked: a slot past the cache reaches the write (the
    trapped Triton launch, or the reference's indexing); a bad shape is still refused."""
    args = cache_args()
    args["slot_mapping"] = i64(0, 12, -1)  # the cache has slots 0 to 11
    with pytest.raises(ValueError, match="past the cache"):
        impl.reshape_and_cache(**args)
    with pytest.raises(Exception) as unchecked:
        impl.reshape_and_cache(**args, check_values=False)
    assert "past the cache" not in str(unchecked.value)
    with pytest.raises(ValueError, match="key must have 3 dim"):
        impl.reshape_and_cache(**{**args, "key": args["key"][0]}, check_values=False)
