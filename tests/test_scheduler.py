"""Scheduler: token budget, chunked prefill, max_num_seqs, prefix hits, preemption."""

from backend.core.block_manager import BlockManager
from backend.core.request import Request, RequestStatus
from backend.core.scheduler import Scheduler
from backend.types.outputs import FinishReason
from backend.types.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens=32, chunked=True,
                   prefix_caching=True):
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    return Scheduler(bm, max_num_seqs, max_tokens, max_model_len=256, enable_chunked_prefill=chunked)


def add(s: Scheduler, rid: str, n: int, start: int = 0) -> Request:
    req = Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=100), eos_token_id=None)
    s.add_request(req)
    return req


def run_step(s: Scheduler, token: int = 7):
    """Apply a schedule as the engine would: advance computed tokens, append a token when sampled."""
    out = s.schedule()
    for sr in out.scheduled:
        req = s.requests[sr.request_id]
        req.complete_step(sr.num_tokens, 0, sr.needs_sample)
        s.block_manager.cache_full_blocks(req, req.num_computed_tokens)
        if sr.needs_sample:
            req.append_output_token(token)
    return out


def test_prefill_then_decode_without_phases():
    s = make_scheduler()
    a = add(s, "a", 10)
    out = run_step(s)
    assert [(r.request_id, r.num_tokens, r.start_pos, r.needs_sample) for r in out.scheduled] == [("a", 10, 0, True)]
    out = run_step(s)
    assert [(r.request_id, r.num_tokens, r.start_pos) for r in out.scheduled] == [("a", 1, 10)]
    assert a.num_computed_tokens == 11 and a.num_tokens == 12


def test_chunked_prefill_splits_a_long_prompt_under_the_budget():
    s = make_scheduler(max_tokens=16)
    a = add(s, "a", 40)
    chunks = []
    for _ in range(3):
        out = run_step(s)
        chunks.append([(r.num_tokens, r.needs_sample) for r in out.scheduled])
    assert chunks == [[(16, False)], [(16, False)], [(8, True)]]
    assert a.num_output_tokens == 1


def test_running_requests_go_first_and_share_the_budget():
    s = make_scheduler(max_tokens=16)
    add(s, "a", 6)
    run_step(s)
    add(s, "b", 30)
    out = run_step(s)
    assert [(r.request_id, r.num_tokens) for r in out.scheduled] == [("a", 1), ("b", 15)]
    assert out.num_scheduled_tokens == 16


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make_scheduler(max_tokens=16, chunked=False)
    add(s, "a", 6)
    run_step(s)
    add(s, "b", 16, start=50)
    out = run_step(s)
    assert [r.request_id for r in out.scheduled] == ["a"]  # 1 + 16 > 16
    s.finish_request(s.requests["a"], FinishReason.STOP)
    out = run_step(s)
    assert [(r.request_id, r.num_tokens) for r in out.scheduled] == [("b", 16)]


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        add(s, f"r{i}", 3, start=10 * i)
    out = run_step(s)
    assert [r.request_id for r in out.scheduled] == ["r0", "r1"]
    assert s.num_waiting == 2
    s.finish_request(s.requests["r0"], FinishReason.LENGTH)
    out = run_step(s)
    assert [r.request_id for r in out.scheduled] == ["r1", "r2"]


def test_prefix_hit_starts_with_computed_tokens():
    s = make_scheduler()
    add(s, "a", 10)
    run_step(s)
    b = add(s, "b", 10)  # same tokens: 2 full blocks cached
    out = run_step(s)
    sched_b = [r for r in out.scheduled if r.request_id == "b"][0]
    assert (sched_b.start_pos, sched_b.num_tokens) == (8, 2)
    assert b.num_cached_tokens == 8
    assert sched_b.block_ids[:2] == s.block_manager.block_ids("a")[:2]


def test_preemption_frees_the_newest_and_recomputes_it_later():
    s = make_scheduler(num_blocks=4, block_size=4, max_tokens=64, prefix_caching=False)
    a = add(s, "a", 7)
    b = add(s, "b", 7, start=100)
    run_step(s)  # a, b: 7 computed, 8 tokens, 2 blocks each
    run_step(s)  # 8 computed, 9 tokens: still 2 blocks each
    assert s.block_manager.num_free_blocks == 0
    assert s.num_preemptions_total == 0
    run_step(s)  # both need a third block: b is preempted so a can grow
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.num_preemptions_total == 1
    assert s.waiting[0] is b
    assert a.num_computed_tokens == 9 and a.num_tokens == 10
    s.finish_request(a, FinishReason.STOP)
    out = run_step(s)
    (rb,) = out.scheduled
    # b recomputes its prompt and the token it had already sampled, then samples the next.
    assert (rb.request_id, rb.start_pos, rb.num_tokens, rb.needs_sample) == ("b", 0, 9, True)
    assert rb.token_ids == list(range(100, 107)) + [7, 7]
    assert b.output_token_ids == [7, 7, 7]


def test_finish_frees_blocks_in_any_state():
    s = make_scheduler(max_num_seqs=1)
    add(s, "a", 5)
    b = add(s, "b", 5, start=50)
    run_step(s)
    s.finish_request(b, FinishReason.ABORT)  # still waiting
    s.finish_request(s.requests["a"], FinishReason.ABORT)  # running
    assert not s.has_unfinished_requests()
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    out = s.schedule()
    assert out.finished_request_ids == {"a", "b"}
