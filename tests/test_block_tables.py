"""The model runner's block tables kept between steps (backend/worker/block_tables.py): the padded
table always equals the one built from the lists, as tables grow, are rebuilt and are released."""

import numpy as np
import pytest

from backend.messages.scheduler_output import ScheduledRequest
from backend.types.sampling_params import SamplingParams
from backend.worker.block_tables import BlockTables

pytestmark = pytest.mark.timeout(60)


def scheduled(request_id: str, block_ids: list[int]) -> ScheduledRequest:
    return ScheduledRequest(request_id=request_id, token_ids=[1], start_pos=0, block_ids=block_ids,
                            needs_sample=True, sampling_params=SamplingParams(), prompt_token_ids=[1],
                            output_token_ids=[], eos_token_id=None)


def from_lists(tables: list[list[int]]) -> np.ndarray:
    width = max(len(t) for t in tables)
    return np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64)


def test_padded_tables_follow_appends_rebuilds_and_releases():
    tables = BlockTables()
    a, b = [3, 4], [9]
    assert np.array_equal(tables.padded([scheduled("a", a), scheduled("b", b)]), from_lists([a, b]))
    rng = np.random.default_rng(0)
    for step in range(200):  # a decode run: blocks appended, past the first capacity many times
        if step % 3 == 0:
            a.append(int(rng.integers(1000)))
        if step % 7 == 0:
            b.extend(int(x) for x in rng.integers(1000, size=2))
        order = [("a", a), ("b", b)] if step % 2 else [("b", b), ("a", a)]
        got = tables.padded([scheduled(rid, blocks) for rid, blocks in order])
        assert np.array_equal(got, from_lists([blocks for _, blocks in order])), step
    # A preemption: the table comes back as a new, different list, shorter or longer (here with the
    # same block where the old one ended, so only the list's identity tells).
    rebuilt = [x + 1 for x in a] + [5]
    rebuilt[len(a) - 1] = a[-1]
    a = rebuilt
    assert np.array_equal(tables.padded([scheduled("a", a)]), from_lists([a]))
    a = [70, 71]
    assert np.array_equal(tables.padded([scheduled("a", a)]), from_lists([a]))
    # A list changed in place against the contract still reads right when its last known block moved.
    b[-1] = 5555
    assert np.array_equal(tables.padded([scheduled("b", b)]), from_lists([b]))
    tables.release(["a", "b", "never-seen"])
    assert len(tables) == 0


class _AppendedWhileRead(list):
    """A block list the engine's thread appends to while the runner reads it (async scheduling):
    every ``len`` of it is followed by one more block."""

    def __len__(self) -> int:
        length = super().__len__()
        super().append(1000 + length)
        return length


def test_a_table_appended_to_while_it_is_read_stays_consistent():
    tables = BlockTables()
    source = _AppendedWhileRead(range(20))
    for _ in range(50):  # each read sees some prefix of the list, never a torn one
        table = tables.padded([scheduled("a", source)])
        count = table.shape[1]
        assert count <= list.__len__(source)
        assert table[0].tolist() == list.__getitem__(source, slice(0, count))
        list.append(source, 7)
