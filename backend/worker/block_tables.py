"""Every running sequence's block table, kept between steps in one persistent 2-D array (a row per
sequence) and extended by the blocks appended since its last step, so a step's padded table is
one gather of its sequences' rows instead of Python work over every block of every sequence.

It relies on ``ScheduledRequest.block_ids``'s contract: while a sequence's table is the same list
object, it only grows by appending; a table rebuilt (a preemption) is a new list. A table that
breaks it anyway (shorter, or a different last known block) is read again whole. With async
scheduling the engine's thread may append to a list while the step thread reads it: each list is
read at one fixed length.

A decode step usually runs the same sequences as the step before, in the same order, each with
the same blocks or one more: then the last step's padded table is kept and only the rows that
gained a block are written (at 16k tokens of context the whole gather is ~1 MB a step). Those
writes land past the blocks the step before used (zeros there), so a step still reading the
table it was given (it shares the array on the CPU) reads the same values.
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
        # The last step's rows and padded table, for the next step to update in place.
        self._step_rows: list[int] | None = None
        self._step: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self._mirror)

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            mirror = self._mirror.pop(request_id, None)
            if mirror is not None:
                self._free_rows.append(mirror[0])
                self._step_rows = self._step = None

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
        appended = []  # positions whose table only gained blocks since the last step
        reread = False  # a table new here, rebuilt or changed: no update in place
        for i, s in enumerate(scheduled):
            mirror = mirrors.get(s.request_id)
            # The common case: the same list, no block appended since the last step (and its last
            # block where it was: a list changed in place against the contract is read again).
            blocks = s.block_ids
            if (mirror is None or mirror[1] is not blocks or len(blocks) != mirror[2]
                    or (blocks and blocks[mirror[2] - 1] != mirror[3])):
                if (mirror is not None and mirror[1] is blocks and len(blocks) > mirror[2]
                        and (not mirror[2] or blocks[mirror[2] - 1] == mirror[3])):
                    appended.append(i)
                else:
                    reread = True
                rows.append(self._row(s))
            else:
                rows.append(mirror[0])
        step = self._step
        if not reread and step is not None and rows == self._step_rows:
            width = step.shape[1]
            if all(self.counts[rows[i]] <= width for i in appended):
                for i in appended:  # past the blocks the last step read: zeros there until now
                    step[i] = self.table[rows[i], :width]
                return step
        index = np.array(rows, dtype=np.int64)
        width = max(int(self.counts[index].max()), 1)
        self._step_rows, self._step = rows, self.table[index, :width]  # a copy (fancy indexing)
        return self._step  # [n, width]; zero past each count

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
