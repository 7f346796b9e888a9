"""Bounded whitespace in JSON grammars (``--json-max-whitespace``, backend/core/structured_output).

Unbounded, a small model in JSON mode can emit newlines until max_tokens; by default a JSON grammar
now allows at most 20 whitespace characters between two JSON tokens, which normal indentation
never reaches.
"""

from __future__ import annotations

import json

import pytest

from backend.core.structured_output.compile_worker import grammar_ebnf
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}}}, "required": ["name", "tags"]}
VALUE = {"name": "x", "tags": [{"k": 1}, {"k": 2}]}
NEWLINES = '{' + "\n" * 50 + '"name": "x", "tags": []}'


def ebnf_accepts(spec: StructuredOutputsParams, text: str, bound: int) -> bool:
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgrammar.Grammar.from_ebnf(grammar_ebnf(spec, bound)), text)


@pytest.fixture(scope="module")
def engine(tiny_llama_engine):
    return tiny_llama_engine


def engine_accepts(engine, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether the engine's compiled grammar (its default bound) takes ``text``'s tokens, then ends."""
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(engine.config.tokenizer_path))
    matcher = xgrammar.GrammarMatcher(engine.structured_output.compile(spec))
    return (all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
            and matcher.is_completed())


def test_the_engine_refuses_50_newlines_in_a_row_by_default_and_takes_indented_json(engine):
    assert EngineConfig().json_max_whitespace == 20
    assert engine.structured_output.compiler.json_max_whitespace == 20  # the setting reaches the compiler
    for spec in (StructuredOutputsParams(json_object=True), StructuredOutputsParams(json=SCHEMA)):
        assert not engine_accepts(engine, spec, NEWLINES)
        for indent in (None, 2, 4, "\t"):
            assert engine_accepts(engine, spec, json.dumps(VALUE, indent=indent)), indent
        assert engine_accepts(engine, spec, '{' + "\n" * 20 + '"name": "x", "tags": []}')
        assert not engine_accepts(engine, spec, '{' + " " * 21 + '"name": "x", "tags": []}')


@pytest.mark.parametrize("spec", [StructuredOutputsParams(json_object=True), StructuredOutputsParams(json=SCHEMA)])
def test_unbounded_allowed_the_newlines_and_the_bound_is_configurable(spec):
    assert ebnf_accepts(spec, NEWLINES, 0)  # 0: unbounded, as before
    assert not ebnf_accepts(spec, NEWLINES, 20)
    assert ebnf_accepts(spec, NEWLINES, 64)
    assert not ebnf_accepts(spec, '{\n   "name": "x", "tags": []}', 3)
    assert ebnf_accepts(spec, '{\n  "name": "x", "tags": []}', 3)


def test_disable_any_whitespace_still_allows_only_single_spaces():
    """xgrammar's fixed layout (json.dumps' default separators), whatever the bound."""
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    for bound in (0, 20):
        assert ebnf_accepts(spec, json.dumps(VALUE), bound)
        assert not ebnf_accepts(spec, json.dumps(VALUE, indent=2), bound)
        assert not ebnf_accepts(spec, '{"name":  "x", "tags": []}', bound)


def test_regex_choice_and_grammar_are_not_touched():
    assert ebnf_accepts(StructuredOutputsParams(regex="a\\s*b"), "a" + "\n" * 50 + "b", 20)
    assert ebnf_accepts(StructuredOutputsParams(grammar='root ::= "a" [ \\n]* "b"'), "a" + "\n" * 50 + "b", 20)


def test_the_setting_is_bounded():
    with pytest.raises(InvalidRequestError) as error:
        EngineConfig(json_max_whitespace=-1)
    assert error.value.param == "json_max_whitespace"
    with pytest.raises(InvalidRequestError):
        EngineConfig(json_max_whitespace=10**6)
