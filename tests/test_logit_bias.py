"""logit_bias end to end in the engine: +100 forces a token, -100 forbids one, in a batch with
requests that have none; token IDs outside the vocabulary are refused; the wire carries it."""

from __future__ import annotations

import pytest

from backend.engine.llm_engine import LLMEngine
from backend.server.proto_convert import sampling_params_from_proto
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.limits import Limits
from backend.types.sampling_params import SamplingParams
from frontend.grpc_client import sampling_params_to_proto

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 6, 7, 8, 9, 10]


def generate(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, list[int]]:
    for request_id, params in requests.items():
        engine.add_request(request_id, PROMPT, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logit_bias_forces_and_forbids_tokens_in_a_mixed_batch(tiny_checkpoint, dtype):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype=dtype, block_size=4,
                                    num_kv_blocks=128, max_model_len=64))
    try:
        greedy = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
        plain = generate(engine, {"plain": SamplingParams(**greedy)})["plain"]
        forbidden = set(plain)
        out = generate(engine, {
            "plain": SamplingParams(**greedy),
            "forced": SamplingParams(**greedy, logit_bias={11: 100.0}),
            "forced-sampled": SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                                             logit_bias={12: 100.0}),
            "forbidden": SamplingParams(**greedy, logit_bias={t: -100.0 for t in forbidden}),
        })
        assert out["plain"] == plain  # a request without a bias is untouched by its neighbours'
        assert out["forced"] == [11] * 8 and out["forced-sampled"] == [12] * 8
        assert len(out["forbidden"]) == 8 and not forbidden & set(out["forbidden"])
        with pytest.raises(InvalidRequestError, match="logit_bias"):
            engine.add_request("oov", PROMPT, SamplingParams(logit_bias={engine.vocab_size: 1.0}))
    finally:
        engine.shutdown()


def test_logit_bias_crosses_the_wire_and_its_size_is_bounded():
    params = SamplingParams(logit_bias={3: -100.0, 70000: 2.5})
    assert sampling_params_from_proto(sampling_params_to_proto(params)).logit_bias == {3: -100.0, 70000: 2.5}
    assert sampling_params_from_proto(sampling_params_to_proto(SamplingParams())).logit_bias is None
    with pytest.raises(InvalidRequestError, match="max-logit-bias|max_logit_bias"):
        Limits(max_logit_bias=2).check_sampling_params(SamplingParams(logit_bias={1: 1.0, 2: 1.0, 3: 1.0}), None)
