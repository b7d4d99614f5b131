"""What the interpreter recorded of chapter 7's gather is the block table's arithmetic: program j
loads the slots ``table[j] * B + t`` of the tokens it holds, and the picture fills just those."""

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pagedlab.device import has_triton  # noqa: E402
from pagedlab.viz import diagrams as D, style  # noqa: E402

pytestmark = pytest.mark.skipif(not has_triton(), reason="records what Triton's interpreter runs")


def gather_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_keys(cache_ptr, table_ptr, out_ptr, seq_len,
                    BLOCK_SIZE: tl.constexpr, DIM: tl.constexpr):  # chapter 7's, no print
        j = tl.program_id(0)
        block = tl.load(table_ptr + j)
        t = tl.arange(0, BLOCK_SIZE)
        d = tl.arange(0, DIM)
        tokens = j * BLOCK_SIZE + t
        ok = tokens < seq_len
        rows = block * BLOCK_SIZE + t
        keys = tl.load(cache_ptr + rows[:, None] * DIM + d[None, :], mask=ok[:, None])
        tl.store(out_ptr + tokens[:, None] * DIM + d[None, :], keys, mask=ok[:, None])

    return gather_keys


@pytest.mark.parametrize("table,seq_len,block_size", [([7, 2, 9], 11, 4), ([3, 0], 8, 4),
                                                      ([5, 1, 4, 0, 9, 3, 8], 13, 2)])
def test_each_program_loads_its_blocks_slots_and_the_figure_fills_them(table, seq_len,
                                                                      block_size):
    from pagedlab.viz.loads import record_loads

    dim, kernel = 8, gather_kernel()
    cache = torch.randn(10, block_size, dim)
    table_t = torch.tensor(table, dtype=torch.int32)
    out = torch.full((seq_len, dim), float("nan"))
    grid = (-(-seq_len // block_size),)
    args = (cache, table_t, out, seq_len)
    loads = record_loads(kernel, grid, cache, *args, BLOCK_SIZE=block_size, DIM=dim)
    assert torch.equal(out, cache[table_t.long()].reshape(-1, dim)[:seq_len])  # it ran
    expected = {(j,): [(table[j] * block_size + t) * dim + d for t in range(block_size)
                       if j * block_size + t < seq_len for d in range(dim)]
                for j in range(grid[0])}
    assert loads == expected  # the masked slots of the last block are not there
    assert record_loads(kernel, grid, table_t, *args, BLOCK_SIZE=block_size,
                        DIM=dim) == {(j,): [j] for j in range(grid[0])}  # one table entry each

    fig = D.slot_loads(loads, cache)
    filled = D.artists(fig, "slot")
    assert len(filled) == seq_len  # one cell per token, each in its program's row
    assert [int(t.get_text()) for t in D.artists(fig, "block")] == list(range(10))
    assert fig.get_size_inches()[0] == pytest.approx(7)
    assert style.overlapping_text(fig) == [] and style.small_text(fig) == []
    plt.close(fig)
