"""The persistent batch: a row of block table per sequence in the batch, kept across steps.

A decode step changes little: each running sequence gains one token, and one in
``block_size`` of them a block. Rebuilding every table from Python lists each step would send
the device the whole batch's tables again; vLLM's Model Runner V2 instead keeps a row per
request for as long as it runs and applies only the changes (staged on the CPU, then written by
one kernel). :class:`PersistentBatch` is that idea in torch: a sequence keeps its row while it is
in consecutive steps; its row is written only where its table changed (the blocks appended
since the last step, or the whole table after copy-on-write or a swap-in replaced entries);
a sequence missing from a step gives its row back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedlab.engine.step import Chunk


class PersistentBatch:
    """Block tables of the sequences in the batch: ``tables`` int32 [rows, width] on ``device``,
    grown (doubled) when a step needs more rows or a longer table."""

    def __init__(self, device, rows: int = 8, width: int = 8):
        self.tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.row_of: dict[int, int] = {}  # seq id -> its row
        self._held: dict[int, list[int]] = {}  # row -> the table written there
        self._free = list(range(rows - 1, -1, -1))
        self.entries_written = 0  # block ids written to the device, all steps together

    def update(self, chunks: list[Chunk]) -> list[int]:
        """The row of each chunk's sequence, its table brought up to date on the device; rows
        of sequences not in ``chunks`` are freed."""
        present = {c.seq.seq_id for c in chunks}
        for seq_id in [s for s in self.row_of if s not in present]:
            row = self.row_of.pop(seq_id)
            del self._held[row]
            self._free.append(row)
        rows = []
        for chunk in chunks:
            row = self.row_of.get(chunk.seq.seq_id)
            if row is None:
                row = self.row_of[chunk.seq.seq_id] = self._take()
            self._write(row, chunk.block_table)
            rows.append(row)
        return rows

    def gather(self, rows: list[int]) -> Tensor:
        """The tables of ``rows``, int32 [len(rows), longest of them]; entries past a table's
        end are stale or 0, never read (a sequence's length bounds its reads)."""
        width = max((len(self._held[r]) for r in rows), default=0)
        index = torch.tensor(rows, dtype=torch.int64, device=self.tables.device)
        return self.tables[index, :width]

    def _take(self) -> int:
        if not self._free:  # twice the rows
            rows = self.tables.shape[0]
            self.tables = torch.cat([self.tables, torch.zeros_like(self.tables)])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        row = self._free.pop()
        self._held[row] = []
        return row

    def _write(self, row: int, table: list[int]) -> None:
        held = self._held[row]
        start = len(held) if table[: len(held)] == held else 0  # appended, or replaced
        if start == len(table):
            return  # unchanged: nothing to send
        while len(table) > self.tables.shape[1]:  # twice the width
            self.tables = torch.cat([self.tables, torch.zeros_like(self.tables)], dim=1)
        new = table[start:]
        self.tables[row, start : len(table)] = torch.tensor(new, dtype=torch.int32)
        self._held[row] = list(table)
        self.entries_written += len(new)
