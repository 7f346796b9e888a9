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
        self.table = np.zeros((INITIAL_ROWS, INITIAL_COLUMNS), dtype=np.int64)  # [rows, columns]
        self.counts = np.zeros(INITIAL_ROWS, dtype=np.int64)  # [rows]: blocks known per row
        self._row_of: dict[str, int] = {}
        self._source_of: dict[str, list[int]] = {}  # the list each row mirrors
        self._count_of: list[int] = [0] * INITIAL_ROWS  # counts, as Python ints (fast to read)
        self._last_of: list[int] = [-1] * INITIAL_ROWS  # each row's last known block
        self._free_rows = list(range(INITIAL_ROWS - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._row_of)

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                del self._source_of[request_id]
                self._free_rows.append(row)

    def _row(self, s: ScheduledRequest) -> int:
        source = s.block_ids
        row = self._row_of.get(s.request_id)
        if row is None:
            row = self._row_of[s.request_id] = self._take_row()
            self._source_of[s.request_id] = source
            self._clear(row)
        elif self._source_of[s.request_id] is not source:  # rebuilt: read it whole
            self._source_of[s.request_id] = source
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
        self.counts[row] = self._count_of[row] = end
        self._last_of[row] = source[end - 1] if end else -1
        return row

    def padded(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        """[len(scheduled), longest table] int64: each sequence's blocks, zero-padded."""
        row_of, source_of, count_of, last_of = self._row_of, self._source_of, self._count_of, self._last_of
        rows = []
        for s in scheduled:
            row = row_of.get(s.request_id)
            # The common case: the same list, no block appended since the last step (and its last
            # block where it was: a list changed in place against the contract is read again).
            blocks = s.block_ids
            if (row is None or source_of[s.request_id] is not blocks or len(blocks) != count_of[row]
                    or (blocks and blocks[count_of[row] - 1] != last_of[row])):
                row = self._row(s)
            rows.append(row)
        index = np.array(rows, dtype=np.int64)
        width = max(int(self.counts[index].max()), 1)
        return self.table[index, :width]  # [n, width]: a copy (fancy indexing); zero past each count

    def _clear(self, row: int) -> None:
        """Zero a row (a new owner, or one read again whole): every row is zero past its count."""
        self.table[row, :int(self.counts[row])] = 0
        self.counts[row] = self._count_of[row] = 0

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.table.shape[0]
            self._grow(rows=2 * old)
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _grow(self, rows: int = 0, columns: int = 0) -> None:
        rows, columns = max(rows, self.table.shape[0]), max(columns, self.table.shape[1])
        grown = np.zeros((rows, columns), dtype=np.int64)
        grown[:self.table.shape[0], :self.table.shape[1]] = self.table
        self.table = grown
        counts = np.zeros(rows, dtype=np.int64)
        counts[:self.counts.shape[0]] = self.counts
        self.counts = counts
        self._count_of.extend([0] * (rows - len(self._count_of)))
        self._last_of.extend([-1] * (rows - len(self._last_of)))
