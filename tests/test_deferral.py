"""Which steps async scheduling may leave on the device (``deferral``): plain decode steps whose
tokens are picked there and not read back mid-step, greedy or drawn; nothing else."""

from __future__ import annotations

import pytest

from backend.messages.scheduler_output import ScheduledRequest, SchedulerOutput
from backend.types.pooling import PoolingParams
from backend.types.sampling_params import SamplingParams
from backend.worker.deferred_step import DRAWN, GREEDY, deferral

pytestmark = pytest.mark.timeout(60)


def decode(params: SamplingParams, tokens=(5,), needs_sample=True, drafts=0) -> ScheduledRequest:
    return ScheduledRequest(f"r{id(params)}", list(tokens), 10, [0], needs_sample, params, [1] * 10, [2], None,
                            num_draft_tokens=drafts)


@pytest.mark.parametrize("params,expected", [
    (SamplingParams(temperature=0.0), GREEDY),
    (SamplingParams(top_k=1, temperature=0.7), GREEDY),
    (SamplingParams(temperature=0.8), DRAWN),
    (SamplingParams(temperature=0.8, top_k=20, min_p=0.1, seed=3), DRAWN),
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), DRAWN),
    (SamplingParams(temperature=0.0, logit_bias={3: 2.0}), DRAWN),
    (SamplingParams(temperature=0.0, min_tokens=4), DRAWN),
    (SamplingParams(temperature=0.8, top_p=0.9), None),
    (SamplingParams(temperature=0.0, logprobs=2), None),
    (SamplingParams(temperature=0.0, prompt_logprobs=1), None),
    (SamplingParams(pooling=PoolingParams()), None),
])
def test_each_request_kind_alone_and_behind_a_greedy_one(params, expected):
    greedy = decode(SamplingParams(temperature=0.0))
    assert deferral(SchedulerOutput([decode(params)], 1)) == expected
    assert deferral(SchedulerOutput([greedy, decode(params)], 2)) == expected
    assert deferral(SchedulerOutput([decode(params), greedy], 2)) == expected


def test_anything_but_one_sampled_decode_token_each_is_not_deferred():
    params = SamplingParams(temperature=0.0)
    assert deferral(SchedulerOutput([], 0)) is None
    assert deferral(SchedulerOutput([decode(params, tokens=(5, 6))], 2)) is None  # a prefill chunk
    assert deferral(SchedulerOutput([decode(params, needs_sample=False)], 1)) is None
    assert deferral(SchedulerOutput([decode(params, tokens=(5, 6), drafts=1)], 2)) is None
    sched = SchedulerOutput([decode(params)], 1)
    sched.grammar = object()
    assert deferral(sched) is None
