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


def test_the_last_steps_table_is_updated_in_place_only_past_what_it_held():
    """Same sequences, same order, blocks appended: the last step's array is kept and only gains
    blocks past each row's old count (a step still reading it sees its own values); a new width,
    a sequence that left, a freed row taken by another request or a rebuilt table: a new array."""
    tables = BlockTables()
    a, b, c = [1, 2], [3], [4, 5, 6]
    order = lambda: [scheduled("a", a), scheduled("b", b), scheduled("c", c)]  # noqa: E731
    first = tables.padded(order())
    held = first.copy()
    b.append(7)  # within the width (3): in place
    second = tables.padded(order())
    assert second is first and np.array_equal(second, from_lists([a, b, c]))
    assert np.array_equal(np.where(held != 0, second, 0), held), "values a step read never change"
    c.append(8)  # wider: a new array
    third = tables.padded(order())
    assert third is not second and np.array_equal(third, from_lists([a, b, c]))
    tables.release(["b"])  # "d" takes b's row, at b's place in the batch, with other blocks
    d = [9]
    fourth = tables.padded([scheduled("a", a), scheduled("d", d), scheduled("c", c)])
    assert np.array_equal(fourth, from_lists([a, d, c]))
    a = [10, 11]  # a preemption: a new list for "a", same length
    fifth = tables.padded([scheduled("a", a), scheduled("d", d), scheduled("c", c)])
    assert fifth is not fourth and np.array_equal(fifth, from_lists([a, d, c]))
    sixth = tables.padded([scheduled("c", c), scheduled("d", d), scheduled("a", a)])  # another order
    assert np.array_equal(sixth, from_lists([c, d, a]))
    assert np.array_equal(fifth, from_lists([a, d, c])), "a new order leaves the last array alone"
