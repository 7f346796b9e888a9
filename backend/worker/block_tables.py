"""Each running sequence's block table, kept between steps as a numpy row and extended by the
blocks appended since its last step, so a step's padded table costs one row copy per sequence
instead of Python work over every block of every sequence.

It relies on ``ScheduledRequest.block_ids``'s contract: while a sequence's table is the same list
object, it only grows by appending; a table rebuilt (a preemption) is a new list. A table that
breaks it anyway (shorter, or a different last known block) is read again whole.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from backend.messages.scheduler_output import ScheduledRequest


class _Row:
    __slots__ = ("source", "blocks", "count")

    def __init__(self, source: list[int]) -> None:
        self.source = source  # the list it mirrors
        self.blocks = np.array(source, dtype=np.int64)  # [capacity]; the first count are the table
        self.count = self.blocks.shape[0]  # not len(source): it may have grown since (see extend)

    def extend(self, source: list[int]) -> None:
        # With async scheduling the engine's thread may append to ``source`` while this runs:
        # read a fixed length once (appends only, so everything before it stays as it was).
        end = len(source)
        if end > self.blocks.shape[0]:
            grown = np.empty(max(2 * self.blocks.shape[0], end), dtype=np.int64)
            grown[:self.count] = self.blocks[:self.count]
            self.blocks = grown
        self.blocks[self.count:end] = source[self.count:end]
        self.count = end


class BlockTables:
    """Request ID -> its block table as a numpy row; ``padded`` gives a step's [rows, max_blocks]."""

    def __init__(self) -> None:
        self._rows: dict[str, _Row] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._rows.pop(request_id, None)

    def _row(self, s: ScheduledRequest) -> _Row:
        source = s.block_ids
        row = self._rows.get(s.request_id)
        if (row is None or row.source is not source or len(source) < row.count
                or (row.count and source[row.count - 1] != row.blocks[row.count - 1])):
            row = self._rows[s.request_id] = _Row(source)
        elif len(source) > row.count:
            row.extend(source)
        return row

    def padded(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        """[len(scheduled), longest table] int64: each sequence's blocks, zero-padded."""
        rows = [self._row(s) for s in scheduled]
        table = np.zeros((len(rows), max(row.count for row in rows)), dtype=np.int64)
        for i, row in enumerate(rows):
            table[i, :row.count] = row.blocks[:row.count]
        return table
