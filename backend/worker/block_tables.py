"""Every running sequence's block table, kept between steps in one persistent 2-D array (a row per
sequence) and extended by the blocks appended since its last step, so a step's padded table is
one gather of its sequences' rows instead of Python work over every block of every sequence.

It relies on ``ScheduledRequest.block_ids``'s contract: while a sequence's table is the same list
object, it only grows by appending; a table rebuilt (a preemption) is a new list. A table that
breaks it anyway (shorter, or a different last known block) is read again whole. With async
scheduling the engine's thread may append to a list while the step thread reads it: each list is
read at one fixed length.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from backend.messages.scheduler_output import ScheduledRequest

INITIAL_ROWS = 64
INITIAL_COLUMNS = 64


class BlockTables:
    """Request ID -> a row of ``table``; ``padded`` gives a step's [rows, max_blocks]."""

    def __init__(self) -> None:
        self.table = np.zeros((INITIAL_ROWS, INITIAL_COLUMNS), dtype=np.int32)  # [rows, columns]
        self.counts = np.zeros(INITIAL_ROWS, dtype=np.int64)  # [rows]: blocks known per row
        # Request ID -> (its row, the list the row mirrors, blocks known, the last known block):
        # one look-up tells whether a step's table is the one mirrored already.
        self._mirror: dict[str, tuple[int, list[int], int, int]] = {}
        self._free_rows = list(range(INITIAL_ROWS - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._mirror)

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            mirror = self._mirror.pop(request_id, None)
            if mirror is not None:
                self._free_rows.append(mirror[0])

    def _row(self, s: ScheduledRequest) -> int:
        source = s.block_ids
        mirror = self._mirror.get(s.request_id)
        if mirror is None:
            row = self._take_row()
            self._clear(row)
        else:
            row = mirror[0]
            if mirror[1] is not source:  # rebuilt: read it whole
                self._clear(row)
        count = int(self.counts[row])
        end = len(source)  # one fixed length (appends may come meanwhile)
        if end < count or (count and source[count - 1] != self.table[row, count - 1]):
            self._clear(row)  # changed against the contract: read it whole
            count = 0
        if end > count:
            if end > self.table.shape[1]:
                self._grow(columns=max(2 * self.table.shape[1], end))
            self.table[row, count:end] = source[count:end]
        self.counts[row] = end
        self._mirror[s.request_id] = (row, source, end, source[end - 1] if end else -1)
        return row

    def padded(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        """[len(scheduled), longest table] int32: each sequence's blocks, zero-padded."""
        mirrors = self._mirror
        rows = []
        for s in scheduled:
            mirror = mirrors.get(s.request_id)
            # The common case: the same list, no block appended since the last step (and its last
            # block where it was: a list changed in place against the contract is read again).
            blocks = s.block_ids
            if (mirror is None or mirror[1] is not blocks or len(blocks) != mirror[2]
                    or (blocks and blocks[mirror[2] - 1] != mirror[3])):
                rows.append(self._row(s))
            else:
                rows.append(mirror[0])
        index = np.array(rows, dtype=np.int64)
        width = max(int(self.counts[index].max()), 1)
        return self.table[index, :width]  # [n, width]: a copy (fancy indexing); zero past each count

    def _clear(self, row: int) -> None:
        """Zero a row (a new owner, or one read again whole): every row is zero past its count."""
        self.table[row, :int(self.counts[row])] = 0
        self.counts[row] = 0

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.table.shape[0]
            self._grow(rows=2 * old)
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _grow(self, rows: int = 0, columns: int = 0) -> None:
        rows, columns = max(rows, self.table.shape[0]), max(columns, self.table.shape[1])
        grown = np.zeros((rows, columns), dtype=np.int32)
        grown[:self.table.shape[0], :self.table.shape[1]] = self.table
        self.table = grown
        counts = np.zeros(rows, dtype=np.int64)
        counts[:self.counts.shape[0]] = self.counts
        self.counts = counts
