"""Speculative decoding by n-gram prompt lookup: drafts, acceptance, and outputs unchanged."""

from __future__ import annotations

import json

import pytest
from test_correctness import hf_greedy, make_engine, random_prompts, run_engine

from backend.core.spec_decode import NgramProposer
from backend.types.config import EngineConfig, SpeculativeConfig
from backend.types.errors import InvalidRequestError
from backend.types.sampling_params import SamplingParams
from backend.worker.draft_acceptance import accept_drafts


def proposer(k=3, lo=1, hi=3):
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo,
                                           prompt_lookup_max=hi))


def test_proposer_copies_what_followed_the_latest_longest_match():
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # suffix 3-gram (2, 6, 7) never occurred before; 2-gram (6, 7) did, latest at 6: then 2, 6, 7
    assert proposer().propose(tokens, limit=10) == [2, 6, 7]
    assert proposer(k=2).propose(tokens, limit=10) == [2, 6]
    assert proposer().propose(tokens, limit=1) == [2]
    assert proposer(lo=3).propose(tokens, limit=10) == []  # only 3-grams allowed: none matches
    assert proposer().propose([1, 2, 3], limit=10) == []
    assert proposer().propose([4], limit=10) == []
    assert proposer().propose([4, 4], limit=10) == [4]  # the match may overlap the suffix
    assert proposer().propose(tokens, limit=0) == []


def test_accept_drafts_keeps_the_agreeing_prefix_and_the_models_next_token():
    assert accept_drafts([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accept_drafts([1, 2, 3], [1, 9, 3, 4]) == [1, 9]
    assert accept_drafts([1, 2, 3], [7, 2, 3, 4]) == [7]
    assert accept_drafts([], [5]) == [5]


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle"}, "only 'ngram'"),
    ({"num_speculative_tokens": 0}, "positive integer"),
    ({"num_speculative_tokens": 99}, "at most 16"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "must not exceed"),
    ({"draft_model": "x"}, "unsupported key"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_config_is_refused_naming_the_problem(value, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        EngineConfig(speculative_config=value)
    assert info.value.param == "speculative_config"


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_greedy_outputs_equal_plain_decoding_and_hf(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    # Repetitive prompts (a random phrase said three times), so drafts exist; plus random ones.
    phrases = random_prompts([5, 9, 4], 384, seed=7)
    prompts = [p * 3 for p in phrases] + random_prompts([3, 17], 384)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain = run_engine(make_engine(model_dir), prompts, params)
    engine = make_engine(model_dir, speculative_config=SPEC, max_num_batched_tokens=16)
    assert run_engine(engine, prompts, params) == plain
    assert engine.num_draft_tokens_total > 0
    assert plain == hf_greedy(model_dir, prompts, 24)


def test_drafts_never_run_past_max_tokens_or_a_stop_token(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    prompt = random_prompts([6], 384, seed=3)[0] * 4
    plain = run_engine(make_engine(model_dir), [prompt], SamplingParams(temperature=0.0, max_tokens=20))[0]
    engine = make_engine(model_dir, speculative_config=SPEC)
    for max_tokens in (1, 2, 5, 13):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        assert run_engine(engine, [prompt], params)[0] == plain[:max_tokens]
    stop = plain[7]
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop])
    assert run_engine(engine, [prompt], params)[0] == plain[:plain.index(stop) + 1]


def test_disable_by_batch_size_turns_drafts_off_for_large_batches(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    prompts = [p * 3 for p in random_prompts([5, 6, 7], 384, seed=5)]
    engine = make_engine(model_dir, speculative_config={**SPEC, "disable_by_batch_size": 2})
    run_engine(engine, prompts, SamplingParams(temperature=0.0, max_tokens=4))
    assert engine.num_draft_tokens_total == 0  # three running all along
    run_engine(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))
    assert engine.num_draft_tokens_total > 0


def test_sampled_requests_with_drafts_stay_valid(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    prompt = random_prompts([5], 384, seed=11)[0] * 4
    engine = make_engine(model_dir, speculative_config=SPEC)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=1, logprobs=2)
    engine.add_request("r", prompt, params)
    tokens, logprobs = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
    assert len(tokens) == 30 and len(logprobs) == 30
    assert all(t in position for t, position in zip(tokens, logprobs))  # the chosen token first


@pytest.mark.slow
def test_copying_text_accepts_most_drafts_on_the_default_model(default_model_dir):
    from frontend.tokenizer import load_tokenizer

    text = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
            "with a single step. All that glitters is not gold.")
    tokenizer = load_tokenizer(str(default_model_dir))
    prompt = tokenizer.encode(f"Repeat this text exactly: {text}\nRepeated: {text[:20]}")
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain = run_engine(make_engine(default_model_dir, block_size=16), [prompt], params)
    engine = make_engine(default_model_dir, block_size=16, speculative_config=SPEC)
    assert run_engine(engine, [prompt], params) == plain
    assert engine.num_accepted_tokens_total >= engine.num_draft_tokens_total / 2 > 0


def test_serve_hands_speculative_config_to_its_backend_as_json():
    """`tandem serve --speculative-config JSON` re-emits the dict as JSON the backend parses back."""
    import argparse

    from frontend.entrypoints.cli import build_parser, engine_argv

    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(SPEC)])
    backend = argparse.ArgumentParser()
    EngineConfig.add_cli_args(backend)
    assert backend.parse_args(engine_argv(args)).speculative_config == SPEC
