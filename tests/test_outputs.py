"""SequenceDecoder / RequestOutputBuilder: engine deltas in, vLLM-shaped text results out."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_tokenizer import build_byte_level_tokenizer, continuation

from backend.types.outputs import EngineOutput, FinishReason, Logprob
from backend.types.sampling_params import SamplingParams
from frontend.outputs import RequestOutputBuilder, SequenceDecoder
from frontend.tokenizer import decode_token, encode_prompt, load_tokenizer, render_chat

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("byte_level"))
    build_byte_level_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    rendered = render_chat(tokenizer, [{"role": "user", "content": "Say something"}])
    return encode_prompt(tokenizer, rendered, add_special_tokens=False)


def encode(tokenizer, text: str) -> list[int]:
    return encode_prompt(tokenizer, text, add_special_tokens=False)


def positions(token_ids: list[int], alternative: int) -> list[dict[int, Logprob]]:
    """Fake logprobs: the sampled token first, then one alternative."""
    return [{t: Logprob(-0.25 * (k + 1), rank=1), alternative: Logprob(-7.0, rank=2)} if t != alternative
            else {t: Logprob(-0.25 * (k + 1), rank=1)} for k, t in enumerate(token_ids)]


def delta(token_ids, index=0, finish=None, stop_reason=None, logprobs=None, **extra) -> EngineOutput:
    return EngineOutput("req", index, list(token_ids), logprobs, finish, stop_reason, **extra)


def chunks(items: list, sizes: list[int]) -> list[list]:
    out, i = [], 0
    for size in sizes:
        out.append(items[i:i + size])
        i += size
    out.append(items[i:])
    return [c for c in out if c]


def test_streamed_text_equals_the_full_decode_and_ends_on_length(tokenizer, prompt_ids):
    gen = encode(tokenizer, "Sure! 你好😀 the quick fox")
    decoder = SequenceDecoder(tokenizer, prompt_ids, SamplingParams(max_tokens=len(gen)))
    parts = chunks(gen, [2, 1, 3, 1, 1])
    deltas = [decoder.update(delta(p, finish=FinishReason.LENGTH if i == len(parts) - 1 else None))
              for i, p in enumerate(parts)]
    assert "".join(d.text for d in deltas) == decoder.text == continuation(tokenizer, prompt_ids, gen)
    assert all("\ufffd" not in d.text for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == gen
    assert [d.finish_reason for d in deltas] == [None] * (len(parts) - 1) + ["length"]
    out = decoder.output()
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("length", None, gen)
    assert out.logprobs is None and out.cumulative_logprob is None


@pytest.mark.parametrize("include, expected_tail", [(False, ""), (True, "<|im_end|>")])
def test_eos_id_is_kept_but_its_text_only_with_include_stop_str(tokenizer, prompt_ids, include, expected_tail):
    eos = tokenizer.eos_token_id
    gen = encode(tokenizer, "Done.")
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    decoder = SequenceDecoder(tokenizer, prompt_ids, params)
    decoder.update(delta(gen[:1]))
    last = decoder.update(delta(gen[1:] + [eos], finish=FinishReason.STOP))
    assert decoder.text == "Done." + expected_tail
    assert decoder.token_ids == gen + [eos]
    assert (last.finish_reason, last.stop_reason, last.stopped_by_string) == ("stop", None, False)


def test_stop_token_id_is_reported_as_stop_reason(tokenizer, prompt_ids):
    gen = encode(tokenizer, "one two")
    decoder = SequenceDecoder(tokenizer, prompt_ids, SamplingParams(stop_token_ids=[gen[-1]]))
    last = decoder.update(delta(gen, finish=FinishReason.STOP, stop_reason=gen[-1]))
    assert decoder.text == continuation(tokenizer, prompt_ids, gen[:-1])
    assert (last.finish_reason, last.stop_reason, decoder.token_ids) == ("stop", gen[-1], gen)


def test_stop_string_inside_a_delta_drops_the_tokens_after_it(tokenizer, prompt_ids):
    gen = encode(tokenizer, "The fox STOP and the dog")
    # The first token whose text completes "STOP" is the last one kept.
    kept = next(k for k in range(1, len(gen) + 1) if "STOP" in tokenizer.decode(gen[:k]))
    assert kept < len(gen)
    params = SamplingParams(stop=["STOP"], logprobs=1)
    decoder = SequenceDecoder(tokenizer, prompt_ids, params)
    result = decoder.update(delta(gen, logprobs=positions(gen, tokenizer.eos_token_id)))
    assert result.text == decoder.text == "The fox "
    assert result.token_ids == gen[:kept] and len(result.logprobs) == kept
    assert (result.finish_reason, result.stop_reason, result.stopped_by_string) == ("stop", "STOP", True)
    # Deltas the engine sent before it saw the abort change nothing.
    late = decoder.update(delta(encode(tokenizer, " more"), finish=FinishReason.ABORT,
                                logprobs=positions(encode(tokenizer, " more"), 0)))
    assert (late.text, late.token_ids, late.finish_reason) == ("", [], None)
    out = decoder.output()
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == ("The fox ", gen[:kept], "stop", "STOP")
    assert len(out.logprobs) == kept


def test_stop_string_split_over_deltas_with_include(tokenizer, prompt_ids):
    gen = encode(tokenizer, "quick END lazy")  # the stop string spans "ick" and " END"
    params = SamplingParams(stop=["ck EN"], include_stop_str_in_output=True)
    decoder = SequenceDecoder(tokenizer, prompt_ids, params)
    for token_id in gen:
        result = decoder.update(delta([token_id]))
        if result.finished:
            break
    assert decoder.text == "quick EN"
    assert (decoder.finish_reason, decoder.stop_reason) == ("stop", "ck EN")
    assert decoder.token_ids == gen[:3]


def test_stop_strings_wait_for_min_tokens(tokenizer, prompt_ids):
    gen = encode(tokenizer, "END the END fox")
    first_end = next(k for k in range(1, len(gen) + 1) if "END" in tokenizer.decode(gen[:k]))
    params = SamplingParams(stop=["END"], min_tokens=first_end, max_tokens=len(gen))
    decoder = SequenceDecoder(tokenizer, prompt_ids, params)
    decoder.update(delta(gen))
    assert decoder.text == "END the "
    assert decoder.stop_reason == "END"


def test_held_back_text_is_released_when_the_engine_ends(tokenizer, prompt_ids):
    gen = encode(tokenizer, "the fox ST")
    decoder = SequenceDecoder(tokenizer, prompt_ids, SamplingParams(stop=["STOP"]))
    assert decoder.update(delta(gen)).text == "the fox "
    last = decoder.update(delta([], finish=FinishReason.ABORT))
    assert (last.text, last.finish_reason) == ("ST", "abort")
    assert decoder.text == "the fox ST"


def test_logprobs_get_decoded_tokens_and_a_cumulative_sum(tokenizer, prompt_ids):
    gen = encode(tokenizer, "你好 fox")
    engine_logprobs = positions(gen, tokenizer.eos_token_id)
    decoder = SequenceDecoder(tokenizer, prompt_ids, SamplingParams(logprobs=1))
    decoder.update(delta(gen[:2], logprobs=engine_logprobs[:2]))
    decoder.update(delta(gen[2:], logprobs=engine_logprobs[2:], finish=FinishReason.LENGTH))
    out = decoder.output()
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for p, t in zip(engine_logprobs, gen)))
    assert [list(p) for p in out.logprobs] == [list(p) for p in engine_logprobs]
    for position in out.logprobs:
        for token_id, lp in position.items():
            assert lp.decoded_token == decode_token(tokenizer, token_id)
    assert out.logprobs[0][tokenizer.eos_token_id].decoded_token == "<|im_end|>"
    assert all(lp.decoded_token is None for p in engine_logprobs for lp in p.values())  # engine's left alone
    with pytest.raises(ValueError, match="logprobs"):
        SequenceDecoder(tokenizer, prompt_ids, SamplingParams(logprobs=0)).update(delta(gen))


def test_builder_aggregates_n_sequences_in_index_order(tokenizer, prompt_ids):
    params = SamplingParams(n=2, stop=["STOP"], prompt_logprobs=0)
    builder = RequestOutputBuilder(tokenizer, "req", "Say something", prompt_ids, params)
    first, second = encode(tokenizer, "the quick fox"), encode(tokenizer, "a STOP b")
    prompt_positions = [None] + [{t: Logprob(-1.5, rank=3)} for t in prompt_ids[1:]]

    builder.add(delta(second[:1], index=1, prompt_logprobs=prompt_positions, num_cached_tokens=4))
    builder.add(delta(first[:1], index=0, prompt_logprobs=prompt_positions, num_cached_tokens=4))
    stopped = builder.add(delta(second[1:], index=1))
    assert stopped.stopped_by_string and not builder.finished
    builder.add(delta(first[1:], index=0, finish=FinishReason.LENGTH))
    assert builder.finished

    result = builder.build()
    assert (result.request_id, result.prompt, result.prompt_token_ids) == ("req", "Say something", prompt_ids)
    assert result.finished and result.num_cached_tokens == 4
    assert [o.index for o in result.outputs] == [0, 1]
    assert [(o.text, o.finish_reason, o.stop_reason) for o in result.outputs] == [
        ("the quick fox", "length", None), ("a ", "stop", "STOP")]
    assert result.outputs[0].token_ids == first
    assert result.prompt_logprobs[0] is None
    assert [p[t].decoded_token for p, t in zip(result.prompt_logprobs[1:], prompt_ids[1:])] == \
        [decode_token(tokenizer, t) for t in prompt_ids[1:]]
    with pytest.raises(ValueError, match="sequence 2"):
        builder.add(delta([1], index=2))


def test_frontend_token_processing_never_imports_torch(tokenizer_dir):
    script = textwrap.dedent(f"""
        import sys
        from backend.types.outputs import EngineOutput, FinishReason, Logprob
        from backend.types.sampling_params import SamplingParams
        from frontend.outputs import RequestOutputBuilder
        from frontend.tokenizer import encode_prompt, load_tokenizer, render_chat, tokenizer_fingerprint
        tok = load_tokenizer({tokenizer_dir!r})
        ids = encode_prompt(tok, render_chat(tok, [{{"role": "user", "content": "hi"}}]), add_special_tokens=False)
        builder = RequestOutputBuilder(tok, "r", None, ids, SamplingParams(stop=["zz"], logprobs=0))
        gen = encode_prompt(tok, "the fox", add_special_tokens=False)
        builder.add(EngineOutput("r", 0, gen, [{{t: Logprob(-1.0)}} for t in gen], FinishReason.LENGTH))
        assert builder.build().outputs[0].text == "the fox"
        tokenizer_fingerprint({tokenizer_dir!r})
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
