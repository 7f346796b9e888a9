"""The offline ``LLM``: prompts in every form, sampling semantics, stop strings, bad input."""

from __future__ import annotations

import shutil

import pytest

from backend.types.errors import InvalidRequestError, ModelNotFoundError
from frontend import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    engine = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=4, num_kv_blocks=256,
                 max_model_len=256, max_logprobs=-1)
    yield engine
    engine.shutdown()


def no_blocks_in_use(llm: LLM) -> bool:
    bm = llm.engine.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not llm.engine.engine.has_unfinished_requests()


GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def test_prompt_forms_and_output_fields(llm):
    tok = llm.get_tokenizer()
    text = "The capital of France is"
    ids = tok.encode(text)
    by_text, by_ids, by_dict = llm.generate([text, ids, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert by_text.prompt == text and by_text.prompt_token_ids == ids
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids
    out = by_text.outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert out.text == tok.decode(ids + out.token_ids)[len(tok.decode(ids)):]
    assert by_text.finished
    # A single string works too, and results keep the prompts' order.
    single = llm.generate(text, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in single] == [out.token_ids]
    prompts = [f"Story {i}: once upon a time" for i in range(10)]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [r.prompt for r in results] == prompts
    assert no_blocks_in_use(llm)


def test_sampling_semantics(llm):
    prompt = "Once upon a time"
    sample = SamplingParams(temperature=1.0, max_tokens=16, seed=1234)
    a, b = (llm.generate(prompt, sample, use_tqdm=False)[0].outputs[0].token_ids for _ in range(2))
    assert a == b  # same seed, same tokens
    others = {tuple(llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=16, seed=s),
                                 use_tqdm=False)[0].outputs[0].token_ids) for s in range(4)}
    assert len(others) > 1  # different seeds differ
    greedy = [llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
    assert greedy[0] == greedy[1]  # temperature 0 is deterministic
    top1 = llm.generate(prompt, SamplingParams(temperature=1.0, top_k=1, max_tokens=12), use_tqdm=False)
    assert top1[0].outputs[0].token_ids == greedy[0]
    (four,) = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=7), use_tqdm=False)
    assert [o.index for o in four.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in four.outputs)
    assert len({tuple(o.token_ids) for o in four.outputs}) > 1
    (lp,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, logprobs=3), use_tqdm=False)
    out = lp.outputs[0]
    assert len(out.logprobs) == 5
    for token_id, position in zip(out.token_ids, out.logprobs):
        assert next(iter(position)) == token_id and 3 <= len(position) <= 4
        assert position[token_id].decoded_token is not None
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)))
    assert no_blocks_in_use(llm)


def test_minus_one_logprobs_are_the_whole_vocabulary(llm):
    """vLLM's -1, allowed by max_logprobs=-1: every token at every position, the chosen one first."""
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=-1, prompt_logprobs=-1)
    (out,) = llm.generate("The capital of", params, use_tqdm=False)
    vocab = llm.model_info.vocab_size
    assert [len(position) for position in out.outputs[0].logprobs] == [vocab, vocab]
    assert out.prompt_logprobs[0] is None and all(len(p) == vocab for p in out.prompt_logprobs[1:])
    assert [next(iter(p)) for p in out.outputs[0].logprobs] == out.outputs[0].token_ids
    assert no_blocks_in_use(llm)


def test_stop_strings_cut_the_text_and_free_the_request(llm):
    prompt = "def add(a, b):"
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    stop = full.text[6:9]
    assert stop and stop in full.text
    cut = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text[:full.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]
    stop_id = full.token_ids[3]
    by_id = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]),
                         use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert no_blocks_in_use(llm)


def test_generate_works_from_inside_a_running_event_loop(llm):
    import asyncio

    async def caller():
        return llm.generate("hello", GREEDY, use_tqdm=False)

    (out,) = asyncio.run(caller())
    assert len(out.outputs[0].token_ids) == 12


def test_chat_renders_the_template(llm):
    (out,) = llm.chat([{"role": "user", "content": "Hello"}], GREEDY, use_tqdm=False)
    assert out.prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert len(out.outputs[0].token_ids) == 12


@pytest.mark.parametrize("make, message", [
    (lambda llm: llm.generate("", GREEDY, use_tqdm=False), "empty"),
    (lambda llm: llm.generate([[1, 2] * 200], GREEDY, use_tqdm=False), "maximum context length is 256"),
    (lambda llm: llm.generate([[10**6]], GREEDY, use_tqdm=False), "out of vocabulary"),
    (lambda llm: llm.generate("hi", SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda llm: llm.generate("hi", SamplingParams(top_p=0.0)), "top_p"),
    (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5)), "top_p"),
    (lambda llm: llm.generate("hi", SamplingParams(temperature=-0.5)), "temperature"),
    (lambda llm: llm.generate("hi", SamplingParams(logprobs=1000), use_tqdm=False), "logprobs"),
    (lambda llm: llm.generate(["hi", "there"], [GREEDY], use_tqdm=False), "sampling params"),
])
def test_bad_input_raises_and_the_engine_keeps_serving(llm, make, message):
    with pytest.raises(InvalidRequestError, match=message):
        make(llm)
    assert no_blocks_in_use(llm)
    (ok,) = llm.generate("still serving", GREEDY, use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 12


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such"):
        LLM(model=str(tmp_path / "does-not-exist"))


def test_unreachable_hub_name_says_how_to_use_a_local_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="(?i)local"):
        LLM(model="facebook/opt-125m")


def test_hub_name_resolves_from_the_local_hf_cache(tiny_checkpoint, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_checkpoint("llama"), snapshot)
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM(model="tiny-org/tiny-llama", dtype="float32", num_kv_blocks=64, max_model_len=128)
    (out,) = llm.generate("hello", GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 12
    llm.shutdown()
