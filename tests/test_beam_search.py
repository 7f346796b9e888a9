"""Beam search in the engine (backend/core/beam_search.py) on a tiny random Llama, scored against HF."""

from __future__ import annotations

import pytest
import torch

from backend.engine.llm_engine import LLMEngine
from backend.types.errors import InvalidRequestError
from backend.types.outputs import FinishReason
from backend.types.sampling_params import SamplingParams

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def engine(tiny_llama_engine):
    return tiny_llama_engine


def run(engine: LLMEngine, params: SamplingParams, prompt=PROMPT) -> dict:
    """index -> (token IDs, per-token logprobs, finish reason, stop reason)."""
    engine.add_request("r", list(prompt), params)
    results: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, logprobs, _, _ = results.get(out.index, ([], [], None, None))
            results[out.index] = (tokens + out.new_token_ids, logprobs + (out.new_logprobs or []),
                                  out.finish_reason, out.stop_reason)
    return results


def hf_logprob_sum(model_dir, prompt: list[int], tokens: list[int]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logprobs = model(ids).logits[0].log_softmax(-1)  # [len, vocab]
    return sum(logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens))


def test_one_beam_is_greedy(engine):
    greedy = run(engine, SamplingParams(temperature=0.0, max_tokens=8))
    beam = run(engine, SamplingParams(use_beam_search=True, n=1, max_tokens=8))
    assert beam[0][0] == greedy[0][0] and beam[0][2] == FinishReason.LENGTH


def test_beams_are_distinct_ranked_and_scored_with_the_models_logprobs(engine, tiny_checkpoint):
    width, max_tokens = 3, 6
    beams = run(engine, SamplingParams(use_beam_search=True, n=width, max_tokens=max_tokens, logprobs=0,
                                       length_penalty=1.0))
    assert sorted(beams) == list(range(width))
    sequences = [beams[i][0] for i in range(width)]
    assert len({tuple(s) for s in sequences}) == width and all(len(s) == max_tokens for s in sequences)
    cumulative = [sum(lp[t].logprob for lp, t in zip(beams[i][1], beams[i][0])) for i in range(width)]
    assert cumulative == sorted(cumulative, reverse=True)  # equal lengths: rank by cumulative logprob
    for tokens, total in zip(sequences, cumulative):
        assert total == pytest.approx(hf_logprob_sum(tiny_checkpoint("llama"), PROMPT, tokens), abs=1e-3)
    greedy = run(engine, SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0))
    greedy_total = sum(lp[t].logprob for lp, t in zip(greedy[0][1], greedy[0][0]))
    assert cumulative[0] >= greedy_total - 1e-5  # the search found at least greedy's sequence
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.beams and not engine.children


def test_a_stop_token_completes_a_beam_early(engine):
    free = run(engine, SamplingParams(use_beam_search=True, n=2, max_tokens=4))
    stop = free[0][0][1]  # the best beam's second token
    beams = run(engine, SamplingParams(use_beam_search=True, n=2, max_tokens=4, stop_token_ids=[stop]))
    stopped = [b for b in beams.values() if b[2] == FinishReason.STOP]
    assert stopped and all(b[3] == stop and b[0][-1] == stop and len(b[0]) < 4 for b in stopped)


def test_aborting_a_search_frees_everything(engine):
    engine.add_request("a", PROMPT, SamplingParams(use_beam_search=True, n=3, max_tokens=50))
    for _ in range(3):
        assert engine.step() == []  # no beam is streamed while the search runs
    engine.abort_request(["a"])
    assert not engine.has_unfinished_requests() and not engine.beams and not engine.children
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("field, value", [("top_p", 0.5), ("top_k", 5), ("min_tokens", 2),
                                          ("repetition_penalty", 1.2), ("logprobs", 2),
                                          ("structured_outputs", {"regex": "a"})])
def test_beam_search_refuses_what_it_does_not_implement(field, value):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(use_beam_search=True, n=2, **{field: value})
    assert error.value.param == field
