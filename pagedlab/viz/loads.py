"""Which elements of a tensor each program of a Triton kernel loads, as the interpreter runs it.

Triton's interpreter runs the programs one after another as Python and numpy, and every
``tl.load`` goes through one method of its builder with the addresses and the mask. For one
launch, :func:`record_loads` wraps that method and files each load's unmasked addresses under
the program's grid coordinates. It runs the kernel in the interpreter whether ``TRITON_INTERPRET``
is set or not, so a GPU machine records the same loads. :func:`pagedlab.viz.diagrams.slot_loads`
draws them.
"""

from __future__ import annotations

import torch


def record_loads(kernel, grid, tensor, *args, **meta) -> dict[tuple[int, ...], list[int]]:
    """Run ``kernel[grid](*args, **meta)`` in Triton's interpreter; for each program (its grid
    coordinates), the sorted element offsets into ``tensor``, one of ``args``, that its unmasked
    loads read. Tensors not on the CPU are copied there first: the kernel writes into the copies.
    """
    from triton.runtime.interpreter import InterpretedFunction, interpreter_builder as builder

    grid = tuple(grid)
    host = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    (watched,) = [h for a, h in zip(args, host) if a is tensor]
    start, size = watched.data_ptr(), watched.element_size()
    end = start + size * (1 + sum((n - 1) * s for n, s in zip(watched.shape, watched.stride())))
    loads: dict[tuple[int, ...], set[int]] = {}
    plain = builder.create_masked_load

    def recording(ptrs, mask, *rest):
        addresses = ptrs.data[mask.data.astype(bool)]
        inside = addresses[(addresses >= start) & (addresses < end)]
        program = tuple(int(i) for i in builder.grid_idx[: len(grid)])
        loads.setdefault(program, set()).update(((inside - start) // size).tolist())
        return plain(ptrs, mask, *rest)

    builder.create_masked_load = recording  # create_load goes through it too
    try:
        InterpretedFunction(kernel.fn)[grid](*host, **meta)
    finally:
        del builder.create_masked_load  # the class's method again
    return {p: sorted(offsets) for p, offsets in sorted(loads.items())}
