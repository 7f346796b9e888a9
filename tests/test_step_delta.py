"""The per-step delta to worker processes: it rebuilds the scheduler's output exactly, under
chunked prefill, prefix hits, preemption, aborts and reused IDs, and its size does not grow with
the context (pure Python, no model)."""

from __future__ import annotations

import pickle
import random

from backend.core.block_manager import BlockManager
from backend.core.request import Request
from backend.core.scheduler import Scheduler
from backend.executor.step_delta import StepDecoder, StepEncoder
from backend.types.outputs import FinishReason
from backend.types.sampling_params import SamplingParams

FIELDS = ("request_id", "token_ids", "start_pos", "block_ids", "needs_sample", "sampling_params",
          "prompt_token_ids", "output_token_ids", "eos_token_id", "num_draft_tokens")


def through_the_wire(encoder: StepEncoder, decoder: StepDecoder, sched):
    payload = pickle.dumps(encoder.encode(sched), protocol=pickle.HIGHEST_PROTOCOL)
    return decoder.decode(pickle.loads(payload)), len(payload)


def assert_same(decoded, sched) -> None:
    assert decoded.finished_request_ids == sched.finished_request_ids
    assert (decoded.num_scheduled_tokens, decoded.num_preempted) == (sched.num_scheduled_tokens,
                                                                      sched.num_preempted)
    assert len(decoded.scheduled) == len(sched.scheduled)
    for got, want in zip(decoded.scheduled, sched.scheduled):
        for name in FIELDS:
            assert getattr(got, name) == getattr(want, name), (want.request_id, name)


def propose_drafts(scheduler: Scheduler, rng: random.Random) -> None:
    """Speculative drafts for some decoding requests (as the engine's n-gram proposer gives)."""
    for request in scheduler.running:
        if request.num_computed_tokens == request.num_tokens - 1 and rng.random() < 0.4:
            request.draft_token_ids = [rng.randrange(50) for _ in range(rng.randint(1, 3))]


def complete_step(scheduler: Scheduler, sched, rng: random.Random, max_outputs: int) -> None:
    """What the engine does after a step: advance past the accepted drafts, cache full blocks,
    append the sampled tokens."""
    for s in sched.scheduled:
        request = scheduler.requests[s.request_id]
        request.draft_token_ids = []
        accepted = rng.randint(0, s.num_draft_tokens) if s.needs_sample else 0
        request.complete_step(s.num_tokens, s.num_draft_tokens - accepted, s.needs_sample)
        scheduler.block_manager.cache_full_blocks(request, min(request.num_computed_tokens,
                                                               request.num_tokens))
        if s.needs_sample:
            for _ in range(accepted + 1):
                request.append_output_token(rng.randrange(50))
                if request.num_output_tokens >= max_outputs:
                    scheduler.finish_request(request, FinishReason.LENGTH)
                    break


def test_decoded_steps_equal_the_schedulers_under_preemption_prefix_hits_aborts_and_drafts():
    rng = random.Random(0)
    block_manager = BlockManager(num_blocks=24, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(block_manager, max_num_seqs=6, max_num_batched_tokens=20, max_model_len=96)
    encoder, decoder = StepEncoder(), StepDecoder()
    shared = [rng.randrange(50) for _ in range(9)]
    next_id, steps, num_drafts = 0, 0, 0
    while steps < 400:
        if rng.random() < 0.3 and next_id < 60:
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(50) for _ in range(rng.randint(1, 25))]
            scheduler.add_request(Request(f"r{next_id % 40}" if f"r{next_id % 40}" not in scheduler.requests
                                          else f"x{next_id}", prompt, SamplingParams(seed=next_id), 7))
            next_id += 1
        if scheduler.requests and rng.random() < 0.05:  # an abort (the ID may come back later)
            scheduler.finish_request(rng.choice(list(scheduler.requests.values())), FinishReason.ABORT)
        if not scheduler.has_unfinished_requests():
            if next_id >= 60:
                break
            continue
        propose_drafts(scheduler, rng)
        sched = scheduler.schedule()
        decoded, _ = through_the_wire(encoder, decoder, sched)
        assert_same(decoded, sched)
        num_drafts += sum(s.num_draft_tokens for s in sched.scheduled)
        complete_step(scheduler, sched, rng, max_outputs=rng.randint(1, 30))
        steps += 1
    assert scheduler.num_preemptions_total > 0 and block_manager.num_prefix_hits > 0 and num_drafts > 0
    # Finished requests leave the mirror (it does not grow without bound).
    decoded, _ = through_the_wire(encoder, decoder, scheduler.schedule())
    assert decoder.num_requests <= len(scheduler.requests) + len(decoded.finished_request_ids)


def decode_message_sizes(prompt_len: int, num_outputs: int) -> tuple[int, list[int]]:
    block_manager = BlockManager(num_blocks=256, block_size=16, enable_prefix_caching=False)
    scheduler = Scheduler(block_manager, max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=4096)
    encoder, decoder = StepEncoder(), StepDecoder()
    scheduler.add_request(Request("req", list(range(100, 100 + prompt_len)), SamplingParams(), None))
    sizes = []
    rng = random.Random(1)
    while scheduler.has_unfinished_requests():
        sched = scheduler.schedule()
        decoded, size = through_the_wire(encoder, decoder, sched)
        assert_same(decoded, sched)
        sizes.append(size)
        complete_step(scheduler, sched, rng, max_outputs=num_outputs)
    return sizes[0], sizes[1:]


def test_the_message_does_not_grow_with_the_context():
    first_short, short = decode_message_sizes(prompt_len=20, num_outputs=300)
    first_long, long = decode_message_sizes(prompt_len=1500, num_outputs=300)
    assert first_long > first_short + 1000  # the prompt travels once, in the first message
    # Every decode step, at a context of 20..320 or 1500..1800 tokens: a few dozen bytes, the
    # same for both (+-2 bytes where a position or block ID needs a longer integer encoding).
    assert max(short + long) < 160
    assert max(long) - min(short) <= 4
