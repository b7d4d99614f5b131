"""Hidden checks of A4: shapes the visible checks do not use (block sizes, head groups and
widths that are not powers of two, empty splits), against pagedlab.kernels.reference."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedlab_course.grade import task
from pagedlab_course.grade.checks import GRADING
from pagedlab.kernels import reference as ref
from pagedlab.kernels.inputs import random_paged_inputs


def _inputs(lens, heads, head_dim, block_size, seed, layout="random"):
    return random_paged_inputs(lens, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                               block_size=block_size, layout=layout, seed=seed)


TOL = 1e-4  # the grader's tolerance for the fp32 kernels (the notebook's setup cell uses the same)


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


@task("A4.1a")
@GRADING
@given(st.lists(st.integers(1, 25), min_size=1, max_size=3), st.integers(1, 7), st.integers(0, 99))
def check_gather_any_layout(nb, lens, block_size, seed):
    """gather equals gather_kv for any lengths and block sizes, blocks dealt at random."""
    x = _inputs(lens, (2, 1), 4, block_size, seed)
    for i, n in enumerate(lens):
        got, expected = nb.gather(x.key_cache, x.block_tables[i], n), ref.gather_kv(x.key_cache, x.block_tables[i], n)
        assert torch.equal(got, expected), f"sequence of {n} tokens in blocks of {block_size}: gather differs from gather_kv"


@task("A4.1b")
def check_decode_attention_odd_shapes(nb):
    """decode_attention equals the reference for groups of 3 and 6 query heads and width 12."""
    for heads, head_dim, block_size in (((3, 1), 12, 5), ((6, 2), 8, 2)):
        x = _inputs([2, 11, 17], heads, head_dim, block_size, seed=head_dim)
        err = _err(nb.decode_attention(*x.args()), ref.paged_attention(*x.args()))
        assert err <= 1e-5, f"heads {heads}, head_dim {head_dim}, block size {block_size}: max error {err:.3g}"


@task("A4.2")
def check_gather_kernel_odd_rows(nb):
    """The gather kernel for a row of 12 values (padded to 16) and a tile longer than a block."""
    x = _inputs([5, 13], (3, 3), 4, 3, seed=5)
    for i, n in enumerate(x.seq_lens.tolist()):
        got = nb.gather_triton(x.value_cache, x.block_tables[i], n, tile=4)
        assert torch.equal(got, ref.gather_kv(x.value_cache, x.block_tables[i], n)), \
            f"sequence {i} ({n} tokens, blocks of 3, tile 4, row of 12 values): differs from gather_kv"


@task("A4.3")
def check_decode_kernel_odd_group(nb):
    """The decode kernel with 3 query heads per KV head and width 12 (both padded)."""
    x = _inputs([1, 8, 13], (3, 1), 12, 5, seed=3)
    err = _err(nb.paged_decode(*x.args()), ref.paged_attention(*x.args()))
    assert err <= TOL, f"heads (3, 1), head_dim 12, block size 5: max error {err:.3g} (allowed {TOL})"


@task("A4.4")
@GRADING
@given(st.integers(1, 6), st.integers(0, 5), st.integers(0, 999))
def check_merge_any_splits(nb, num_splits, empty, seed):
    """merge_splits equals the log-sum-exp weighted mean for any number of splits, the empty
    ones (log-sum-exp -inf, zero parts, as the kernel writes them) ignored, and large log-sum-exps that overflow exp."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(2, 3, num_splits, 4, generator=g)  # [S, H, P, D]
    lse = torch.randn(2, 3, num_splits, generator=g) * 10 + 100  # exp(lse) overflows in fp32
    empty = min(empty, num_splits - 1)  # split 0 is never empty
    if empty:
        lse[..., num_splits - empty :] = float("-inf")
        parts[..., num_splits - empty :, :] = 0.0
    w = torch.softmax(lse.double(), dim=-1)  # [S, H, P]
    expected = (w[..., None] * parts.double()).sum(-2)  # [S, H, D]
    got = nb.merge_splits(parts, lse)
    err = _err(got, expected)
    assert err <= TOL, f"{num_splits} splits, {empty} empty: max error {err:.3g} (allowed {TOL})"
