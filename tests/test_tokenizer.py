"""Tokenizer loading, chat rendering, fingerprints, incremental detokenization (stop strings:
tests/test_stop_strings.py).

Tokenizers are built here with the ``tokenizers`` library (no model hub): a
byte-level BPE (GPT-2/SmolLM style), a SentencePiece-style one (Metaspace +
byte fallback, Llama-2 style) and a WordPiece one (BERT style, whose decoder
puts spaces between tokens).
"""

from __future__ import annotations

import json
import os
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from backend.types.errors import InvalidRequestError, ModelNotFoundError
from frontend.tokenizer import (IncrementalDetokenizer, decode_token, encode_prompt, load_tokenizer,
                                render_chat, tokenizer_fingerprint)

CORPUS = [
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. STOP here and END there.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "Emoji time 😀🎉 and rockets 🚀 with more text after them.",
] * 4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Text the tokenizers have seen, plus characters they have not (byte fallback).
TEXT_PIECES = ["Hello", " world", ",", " the", " quick", " fox", "你好", "世界", "天气", "😀", "🎉", "🚀",
               " ß", "🌍", " STOP", "\n", " ", "e", "é", "ok"]


def build_byte_level_tokenizer(directory: str, chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """GPT-2 style: bytes mapped to printable chars ("Ġ" is a space), no BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _save(tok, directory, chat_template, bos="<|im_start|>")


def build_sentencepiece_tokenizer(directory: str) -> PreTrainedTokenizerFast:
    """Llama-2 style: "▁" marks a space, unknown characters fall back to <0xNN> bytes, BOS added."""
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = metaspace
    specials = ["<s>"] + SPECIALS
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=specials))
    # Byte tokens are ordinary vocabulary (not added tokens), as in Llama's.
    learned = json.loads(trained.to_str())["model"]
    vocab = dict(learned["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    template = "{{ bos_token }}" + CHAT_TEMPLATE
    return _save(tok, directory, template, bos="<s>")


def build_wordpiece_tokenizer(directory: str) -> PreTrainedTokenizerFast:
    """BERT style: the decoder joins tokens with spaces, special tokens included."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "[CLS]", "[SEP]", "hello", "world", "##s", "."])}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[CLS]", "[SEP]"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", unk_token="[UNK]")
    fast.save_pretrained(directory)
    return fast


def _save(tok: Tokenizer, directory: str, chat_template: str, bos: str) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = chat_template
    fast.save_pretrained(directory)
    return fast


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {name: str(root / name) for name in ("byte_level", "sentencepiece", "wordpiece")}
    build_byte_level_tokenizer(dirs["byte_level"])
    build_sentencepiece_tokenizer(dirs["sentencepiece"])
    build_wordpiece_tokenizer(dirs["wordpiece"])
    return dirs


@pytest.fixture(scope="module")
def byte_level(tokenizer_dirs) -> PreTrainedTokenizerFast:
    return load_tokenizer(tokenizer_dirs["byte_level"])


@pytest.fixture(scope="module")
def sentencepiece(tokenizer_dirs) -> PreTrainedTokenizerFast:
    return load_tokenizer(tokenizer_dirs["sentencepiece"])


@pytest.fixture(scope="module")
def wordpiece(tokenizer_dirs) -> PreTrainedTokenizerFast:
    return load_tokenizer(tokenizer_dirs["wordpiece"])


def continuation(tokenizer, prompt_ids, gen_ids, skip_special_tokens=True) -> str:
    """The reference: the generated tokens' text as it reads after the prompt."""
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    prompt_text = decode(prompt_ids)
    full = decode(prompt_ids + gen_ids)
    assert full.startswith(prompt_text)
    return full[len(prompt_text):]


def push_in_chunks(detokenizer, ids, rng) -> list[str]:
    pieces, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 4)
        pieces.append(detokenizer.push(ids[i:i + size]))
        i += size
    return pieces


# ---------------------------------------------------------------- loading and encoding


def test_load_tokenizer_reports_missing_directory_and_files(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_load_tokenizer_reads_special_tokens_and_chat_template(byte_level):
    assert byte_level.eos_token == "<|im_end|>"
    assert byte_level.chat_template == CHAT_TEMPLATE


def test_encode_prompt_adds_special_tokens_like_the_tokenizer(sentencepiece):
    bos = sentencepiece.bos_token_id
    with_bos = encode_prompt(sentencepiece, "Hello world")
    without = encode_prompt(sentencepiece, "Hello world", add_special_tokens=False)
    assert with_bos == [bos] + without
    assert sentencepiece.decode(without) == "Hello world"
    with pytest.raises(InvalidRequestError) as info:
        encode_prompt(sentencepiece, ["Hello"])
    assert info.value.param == "prompt"


# ---------------------------------------------------------------- chat templates


def test_render_chat_and_encode_without_doubling_special_tokens(sentencepiece):
    messages = [{"role": "user", "content": "Hello 你好"}]
    rendered = render_chat(sentencepiece, messages)
    assert rendered == "<s><|im_start|>user\nHello 你好<|im_end|>\n<|im_start|>assistant\n"
    ids = encode_prompt(sentencepiece, rendered, add_special_tokens=False)
    bos, im_start = sentencepiece.bos_token_id, sentencepiece.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(bos) == 1 and ids[0] == bos
    assert ids.count(im_start) == 2
    # Encoding with special tokens would add a second BOS: why chats pass False.
    assert encode_prompt(sentencepiece, rendered).count(bos) == 2


def test_render_chat_joins_text_parts_and_honours_generation_prompt_flags(byte_level):
    messages = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
                {"role": "assistant", "content": "The answer is"}]
    assert render_chat(byte_level, messages[:1], add_generation_prompt=False) == \
        "<|im_start|>user\none\ntwo<|im_end|>\n"
    continued = render_chat(byte_level, messages, add_generation_prompt=False, continue_final_message=True)
    assert continued.endswith("<|im_start|>assistant\nThe answer is")
    with pytest.raises(InvalidRequestError) as info:
        render_chat(byte_level, messages, add_generation_prompt=True, continue_final_message=True)
    assert info.value.param == "continue_final_message"
    assert messages[0]["content"][0] == {"type": "text", "text": "one"}  # caller's messages untouched


def test_render_chat_passes_template_kwargs_tools_and_override_template(byte_level):
    template = ("{{ greeting }}|{% for t in tools or [] %}{{ t['name'] }};{% endfor %}|"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    out = render_chat(byte_level, [{"role": "user", "content": "hi"}], chat_template=template,
                      tools=[{"name": "search"}, {"name": "calc"}], greeting="hey")
    assert out == "hey|search;calc;|hi"
    with pytest.raises(InvalidRequestError) as info:
        render_chat(byte_level, [{"role": "user", "content": "hi"}], tokenize=True)
    assert info.value.param == "chat_template_kwargs"


@pytest.mark.parametrize("messages, fragment", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], "must be an object"),
    ([{"content": "no role"}], r"role must be a string .*got None"),
    ([{"role": 5, "content": "not a string"}], r"role must be a string .*got 5"),
    ([{"role": "", "content": "empty role"}], r"role must be a string of 1 to 64"),
    ([{"role": "w" * 65, "content": "long role"}], r"role must be a string of 1 to 64"),
    ([{"role": "user", "content": 5}], "string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
])
def test_render_chat_rejects_malformed_messages(byte_level, messages, fragment):
    with pytest.raises(InvalidRequestError, match=fragment) as info:
        render_chat(byte_level, messages)
    assert info.value.param == "messages"


def test_a_custom_role_goes_to_the_template_as_it_is(wordpiece):
    """vLLM's custom roles: any role string reaches the template, which decides what it means."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    messages = [{"role": "my-custom-role", "content": "what is 1+1?"}, {"role": "wizard", "content": "2"}]
    assert render_chat(wordpiece, messages, chat_template=template) == "<my-custom-role>what is 1+1?<wizard>2"


def test_render_chat_without_template_or_with_a_failing_one(wordpiece, byte_level):
    messages = [{"role": "user", "content": "hello"}]
    with pytest.raises(InvalidRequestError, match="no chat template"):
        render_chat(wordpiece, messages)
    assert render_chat(wordpiece, messages, chat_template="{{ messages[0]['content'] }}") == "hello"
    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}"
    with pytest.raises(InvalidRequestError, match="first message must be system"):
        render_chat(byte_level, messages, chat_template=strict)
    with pytest.raises(InvalidRequestError, match="chat template"):
        render_chat(byte_level, messages, chat_template="{% for %}")


TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[tools: {{ tools | tojson }}]{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}{% if m.name is defined %} name={{ m.name }}{% endif %}>"
    "{% if m.content is defined %}{{ m['content'] }}{% endif %}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}"
    "</{{ m['role'] }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}{{ extra | default('') }}")


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, TOOLS_TEMPLATE])
@pytest.mark.parametrize("options", [
    dict(add_generation_prompt=True),
    dict(add_generation_prompt=False, continue_final_message=True),
    dict(add_generation_prompt=True, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
         extra="!"),
])
def test_render_chat_renders_exactly_what_apply_chat_template_does(tmp_path, template, options):
    """One renderer (frontend.template_worker.render_job) for the model's template and, in the
    sandbox, a request's: it must agree with transformers' apply_chat_template."""
    tokenizer = build_byte_level_tokenizer(str(tmp_path), chat_template=template)
    messages = [{"role": "system", "content": "be brief", "name": None},
                {"role": "user", "content": "héllo 😀", "name": "ann"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
                {"role": "assistant", "content": "The answer is"}]
    if not options.get("continue_final_message"):
        messages = messages[:-1]
    ours = render_chat(tokenizer, messages, **options)
    theirs = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    assert ours == theirs


def test_encode_prompt_refuses_text_that_is_not_valid_unicode(byte_level):
    with pytest.raises(InvalidRequestError, match="U\\+D800") as info:
        encode_prompt(byte_level, "Hello \ud800")
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as info:
        encode_prompt(byte_level, "\udc00", param="messages")
    assert info.value.param == "messages"
    assert encode_prompt(byte_level, "Hello 😀") == byte_level.encode("Hello 😀")


# ---------------------------------------------------------------- fingerprint and single tokens


def test_fingerprint_is_stable_and_changes_with_the_chat_template(tmp_path):
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    build_byte_level_tokenizer(first)
    build_byte_level_tokenizer(second)
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(first)
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(second)  # same training, same bytes
    with open(os.path.join(second, "chat_template.jinja"), "a") as f:
        f.write("{# changed #}")
    assert tokenizer_fingerprint(first) != tokenizer_fingerprint(second)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError):
        tokenizer_fingerprint(str(empty))


def test_decode_token_shows_special_tokens_and_partial_characters(byte_level):
    assert decode_token(byte_level, byte_level.eos_token_id) == "<|im_end|>"
    emoji_ids = byte_level.encode("🌍", add_special_tokens=False)  # unseen: one token per byte or so
    assert len(emoji_ids) > 1
    assert decode_token(byte_level, emoji_ids[0]) == "\ufffd"
    assert decode_token(byte_level, byte_level.encode(" fox", add_special_tokens=False)[-1]).endswith("fox")


# ---------------------------------------------------------------- incremental detokenization


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_incremental_decode_equals_full_decode_and_never_breaks_characters(request, name):
    tokenizer = request.getfixturevalue(name)
    rng = random.Random(1234)
    prompt_ids = encode_prompt(tokenizer, "Hello world,")
    for _ in range(60):
        text = "".join(rng.choice(TEXT_PIECES) for _ in range(rng.randint(1, 12)))
        gen_ids = encode_prompt(tokenizer, text, add_special_tokens=False)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        pieces = push_in_chunks(detokenizer, gen_ids, rng)
        pieces.append(detokenizer.flush())
        assert all("\ufffd" not in piece for piece in pieces), (text, pieces)
        assert "".join(pieces) == detokenizer.text == continuation(tokenizer, prompt_ids, gen_ids)
        assert detokenizer.token_ids == gen_ids


def test_multibyte_character_is_held_until_complete(byte_level):
    gen_ids = encode_prompt(byte_level, "🌍", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(byte_level, encode_prompt(byte_level, "Hi"))
    assert [detokenizer.push([i]) for i in gen_ids[:-1]] == [""] * (len(gen_ids) - 1)
    assert detokenizer.push(gen_ids[-1:]) == "🌍"


def test_flush_releases_an_unfinished_character_as_replacement(byte_level):
    gen_ids = encode_prompt(byte_level, "ok🌍", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(byte_level, encode_prompt(byte_level, "Hi"))
    assert detokenizer.push(gen_ids[:-1]) == "ok"
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.text == byte_level.decode(gen_ids[:-1])


def test_random_token_ids_decode_like_the_full_sequence(byte_level):
    """Arbitrary byte tokens (invalid UTF-8 included) and special tokens."""
    rng = random.Random(99)
    prompt_ids = encode_prompt(byte_level, "Hello world,")
    vocab_size = len(byte_level)
    for skip in (True, False):
        for _ in range(100):
            gen_ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 16))]
            detokenizer = IncrementalDetokenizer(byte_level, prompt_ids, skip_special_tokens=skip)
            push_in_chunks(detokenizer, gen_ids, rng)
            detokenizer.flush()
            assert detokenizer.text == continuation(byte_level, prompt_ids, gen_ids, skip), gen_ids


def test_first_token_keeps_its_space_after_the_prompt(sentencepiece):
    gen_ids = encode_prompt(sentencepiece, " world", add_special_tokens=False)
    assert sentencepiece.decode(gen_ids) == "world"  # decoded alone, SentencePiece drops the space
    for prompt in ("Hello", "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "Hello<|im_end|>"):
        prompt_ids = encode_prompt(sentencepiece, prompt, add_special_tokens=False)
        detokenizer = IncrementalDetokenizer(sentencepiece, prompt_ids)
        assert detokenizer.push(gen_ids) + detokenizer.flush() == " world"


def test_prompt_ending_inside_a_character_is_not_re_emitted(byte_level):
    ids = encode_prompt(byte_level, "Hi 🌍", add_special_tokens=False)
    prompt_ids, gen_ids = ids[:-1], ids[-1:] + encode_prompt(byte_level, " fox", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(byte_level, prompt_ids)
    text = detokenizer.push(gen_ids) + detokenizer.flush()
    # The character the prompt left unfinished comes out whole, with what its
    # last token carried; nothing the prompt showed in full is repeated.
    assert text.endswith("🌍 fox") and "Hi" not in text


def test_special_tokens_are_skipped_or_shown(byte_level):
    gen_ids = encode_prompt(byte_level, "ok", add_special_tokens=False) + [byte_level.eos_token_id]
    prompt_ids = encode_prompt(byte_level, "Hi")
    skipped = IncrementalDetokenizer(byte_level, prompt_ids, skip_special_tokens=True)
    shown = IncrementalDetokenizer(byte_level, prompt_ids, skip_special_tokens=False)
    assert skipped.push(gen_ids) + skipped.flush() == "ok"
    assert shown.push(gen_ids) + shown.flush() == "ok<|im_end|>"


def test_spaces_between_special_tokens(wordpiece):
    cls, sep = wordpiece.cls_token_id, wordpiece.sep_token_id
    hello, world = wordpiece.convert_tokens_to_ids(["hello", "world"])
    gen_ids = [hello, cls, sep, world]
    spaced = IncrementalDetokenizer(wordpiece, [], skip_special_tokens=False)
    tight = IncrementalDetokenizer(wordpiece, [], skip_special_tokens=False, spaces_between_special_tokens=False)
    assert spaced.push(gen_ids) == "hello [CLS] [SEP] world"
    assert tight.push(gen_ids) == "hello [CLS][SEP] world"


def test_decoder_that_rewrites_released_text_does_not_break_the_stream(sentencepiece):
    """Byte-fallback runs decode as a whole: "A" + a stray byte turns into "\ufffd\ufffd"."""
    byte = sentencepiece.convert_tokens_to_ids
    gen_ids = [byte("<0x41>"), byte("<0xBB>"), byte("e")]
    detokenizer = IncrementalDetokenizer(sentencepiece, encode_prompt(sentencepiece, "Hello"))
    pieces = [detokenizer.push([i]) for i in gen_ids] + [detokenizer.flush()]
    # "A" was already shown and cannot be taken back; the rest still arrives.
    assert pieces == ["A", "", "\ufffde", ""]
