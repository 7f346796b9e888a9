"""Prompt text -> token IDs (frontend/tokenizer.py's ``encode_prompt``): through the ``tokenizers``
backend directly where that gives what transformers' ``encode`` gives, and through transformers
where the backend's state would make them differ (truncation or padding on, special tokens split).

The tokenizers are the tiny ones of tests/test_tokenizer.py (byte-level BPE, SentencePiece-style
BPE with a BOS, WordPiece), and SmolLM2-135M-Instruct's when it is cached.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tokenizer import build_byte_level_tokenizer, build_sentencepiece_tokenizer, build_wordpiece_tokenizer

from frontend.tokenizer import _plain_backend, encode_prompt, load_tokenizer

SMOLLM2 = Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct"
TEXTS = [
    "",
    " ",
    "Hello world",
    "  leading and trailing spaces  \n\n",
    "<|im_start|>user\nHello 你好 😀<|im_end|>\n<|im_start|>assistant\n",
    "<s>[CLS] hello worlds. [SEP]",
    "tabs\tand\r\nnewlines, 🚀 rockets and \u00e9\u0301 accents",
]
BUILDERS = {"byte_level": build_byte_level_tokenizer, "sentencepiece": build_sentencepiece_tokenizer,
            "wordpiece": build_wordpiece_tokenizer}


@pytest.fixture(scope="module", params=[*BUILDERS, "smollm2"])
def tokenizer_dir(request, tmp_path_factory) -> str:
    if request.param == "smollm2":
        if not (SMOLLM2 / "tokenizer.json").is_file():
            pytest.skip("SmolLM2-135M-Instruct is not cached")
        return str(SMOLLM2)
    directory = str(tmp_path_factory.mktemp(request.param))
    BUILDERS[request.param](directory)
    return directory


def test_the_backend_path_gives_transformers_ids(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    assert _plain_backend(tokenizer) is tokenizer._tokenizer  # the path under test is taken
    for text in TEXTS:
        for add_special_tokens in (True, False):
            assert encode_prompt(tokenizer, text, add_special_tokens) == \
                tokenizer.encode(text, add_special_tokens=add_special_tokens), (text, add_special_tokens)


def test_truncation_or_padding_on_the_backend_takes_transformers_path(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    text = "Hello world, hello worlds. " * 4
    whole = tokenizer._tokenizer.encode(text, add_special_tokens=True).ids
    assert len(whole) > 3
    tokenizer._tokenizer.enable_truncation(max_length=3)
    assert _plain_backend(tokenizer) is None
    assert encode_prompt(tokenizer, text) == whole  # not cut to 3: transformers turns truncation off
    assert _plain_backend(tokenizer) is tokenizer._tokenizer  # ...and the backend path is open again
    tokenizer._tokenizer.enable_padding(length=len(whole) + 5)
    assert _plain_backend(tokenizer) is None
    assert encode_prompt(tokenizer, text) == whole  # no padding either


def test_split_special_tokens_is_honoured(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    special = next(t for t in ("<|im_start|>", "[CLS]") if t in tokenizer.get_vocab())
    special_id = tokenizer.convert_tokens_to_ids(special)
    text = f"{special}hello"
    assert special_id in encode_prompt(tokenizer, text, add_special_tokens=False)
    tokenizer.split_special_tokens = True
    assert _plain_backend(tokenizer) is None  # the backend still matches them whole
    split = encode_prompt(tokenizer, text, add_special_tokens=False)
    assert special_id not in split and split == tokenizer.encode(text, add_special_tokens=False)
    assert _plain_backend(tokenizer) is tokenizer._tokenizer  # transformers set the backend to split them
    assert encode_prompt(tokenizer, text, add_special_tokens=False) == split
