"""The decode fast path's stop pre-test (decode_step.stop_filter) never misses a stop that
check_stop would report, whatever the sampling parameters."""

import itertools

import pytest

from backend.core.request import Request
from backend.engine.decode_step import stop_filter
from backend.engine.stop_conditions import check_stop
from backend.types.sampling_params import SamplingParams

EOS = (2, 3)
MAX_MODEL_LEN = 12
PROMPT = [5, 6, 7]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_tokens,min_tokens,ignore_eos,stop_token_ids", [
    combo for combo in itertools.product([None, 1, 4, 20], [0, 2], [False, True], [None, [4], [3, 9]])
    if combo[0] is None or combo[1] <= combo[0]])  # SamplingParams refuses min_tokens > max_tokens
def test_filter_passes_every_stop(max_tokens, min_tokens, ignore_eos, stop_token_ids):
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                            stop_token_ids=stop_token_ids)
    # Every sequence of outputs up to the model's length, one token value at a time at each length.
    for num_outputs in range(1, MAX_MODEL_LEN - len(PROMPT) + 1):
        for token in range(10):
            request = Request("r", PROMPT, params, eos_token_id=EOS[0])
            outputs = [8] * (num_outputs - 1) + [token]
            request.output_token_ids.extend(outputs)
            request.all_token_ids.extend(outputs)
            tokens, limit = stop_filter(request, EOS, MAX_MODEL_LEN)
            reason = check_stop(request, token, EOS, MAX_MODEL_LEN)
            may_stop = token in tokens or len(request.all_token_ids) >= limit
            assert may_stop or reason is None, (num_outputs, token, reason)
