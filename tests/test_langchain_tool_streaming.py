"""LangChain's ChatOpenAI streaming with bind_tools (named, required, auto, a cut call) over the fake engine.

LangChain merges streamed ``tool_call_chunks`` by index, as the openai SDK's ``stream()`` does
(tests/test_tool_calls.py): a chunk with two entries for one call, or calls held back to the end,
would show here as lost or late argument pieces.
"""

from __future__ import annotations

import functools
import operator

import pytest
from fake_engine import tokenizer, tokenizer_dir  # noqa: F401
from test_tool_calls import MODEL, SDK_TIME, SDK_WEATHER, live, say  # noqa: F401

pytest.importorskip("langchain_openai")


def chat_model(live, max_tokens: int = 400):  # noqa: F811
    from langchain_openai import ChatOpenAI

    client, _ = live
    return ChatOpenAI(base_url=str(client.base_url), api_key="unused", model=MODEL, max_tokens=max_tokens,
                      max_retries=0)


def stream(llm, tools, **bind) -> tuple[list, object]:
    chunks = list(llm.bind_tools(tools, **bind).stream("Weather in Paris and Rome?"))
    return chunks, functools.reduce(operator.add, chunks)


@pytest.mark.timeout(60)
def test_a_named_tool_streams_its_arguments_whole(live, tokenizer):  # noqa: F811
    say(live[1], tokenizer, '{"city": "Paris"}')
    chunks, message = stream(chat_model(live), [SDK_WEATHER], tool_choice="get_weather")
    assert message.tool_calls == [{"name": "get_weather", "args": {"city": "Paris"}, "id": message.tool_calls[0]["id"],
                                   "type": "tool_call"}]
    assert sum(1 for c in chunks if c.tool_call_chunks) > 1  # streamed, not one piece at the end


@pytest.mark.timeout(60)
def test_required_calls_stream_as_they_are_generated(live, tokenizer):  # noqa: F811
    say(live[1], tokenizer, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                            '{"name": "get_time", "parameters": {}}]')
    chunks, message = stream(chat_model(live), [SDK_WEATHER, SDK_TIME], tool_choice="required")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                                    ("get_time", {})]
    with_calls = [i for i, c in enumerate(chunks) if c.tool_call_chunks]
    assert len(with_calls) > 3 and with_calls[0] < len(chunks) // 2  # the first call began early


@pytest.mark.timeout(60)
def test_auto_parses_parallel_calls(live, tokenizer):  # noqa: F811
    say(live[1], tokenizer, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    _, message = stream(chat_model(live), [SDK_WEATHER])
    assert [c["args"] for c in message.tool_calls] == [{"city": "Paris"}, {"city": "Rome"}]


@pytest.mark.timeout(60)
def test_a_required_reply_cut_short_keeps_its_complete_call(live, tokenizer):  # noqa: F811
    complete = '[{"name": "get_time", "parameters": {}}, '
    say(live[1], tokenizer, complete + '{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    cut = len(tokenizer.encode(complete + '{"name": "get_weather", "parameters": {"ci', add_special_tokens=False))
    _, message = stream(chat_model(live, max_tokens=cut), [SDK_TIME, SDK_WEATHER], tool_choice="required")
    assert message.response_metadata.get("finish_reason") == "length"
    assert message.tool_calls[0]["name"] == "get_time" and message.tool_calls[0]["args"] == {}
    # The cut call as far as it got (LangChain parses partial JSON leniently, or marks it invalid).
    assert [c["name"] for c in message.tool_calls + message.invalid_tool_calls] == ["get_time", "get_weather"]
