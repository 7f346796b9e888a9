"""Server-sent events: how a streamed answer is framed.

Each chunk is one ``data: <JSON>`` event; the stream ends with ``data: [DONE]``,
after an error event if it failed once streaming had begun (its status line
was already sent), as OpenAI and vLLM do.

A chunk is written once per token of every stream, so the common chunks are
not built as pydantic models: ``ChunkFrames`` encodes a response's envelope
once and splices each chunk's choice JSON into it. What it writes is, byte for
byte, what ``sse_event`` writes for the equivalent model (``json_text`` is
pydantic's own encoder with the models' settings; tests/test_sse_frames.py
compares the two). Rare chunks (usage, tool calls, prompt logprobs) still go
through the models.
"""

from __future__ import annotations

from typing import Any

import pydantic_core
from pydantic import BaseModel

MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache"}  # no proxy may hold chunks back
DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> str:
    """One event carrying ``payload`` as JSON."""
    return f"data: {payload.model_dump_json()}\n\n"


def json_text(value: Any) -> str:
    """``value`` (None, str, int, float, lists and dicts of them) as JSON, as ``model_dump_json``
    writes it in a response model: non-ASCII kept, no spaces, infinities and NaN as null."""
    return pydantic_core.to_json(value, inf_nan_mode="null").decode()


def json_or_null(value: Any) -> str:
    return "null" if value is None else json_text(value)


class ChunkFrames:
    """The SSE events of one streamed response whose chunks differ only in their choices.

    ``head_fields`` are the response model's fields before ``choices`` (id, object, created,
    model), ``tail`` the JSON of the fields after it (e.g. ``"usage":null``), in the model's
    order; ``frame(choice_json)`` is then one event with that one choice.
    """

    def __init__(self, head_fields: dict[str, Any], tail: str) -> None:
        head = ",".join(f"{json_text(name)}:{json_text(value)}" for name, value in head_fields.items())
        self._head = f'data: {{{head},"choices":['
        self._tail = f"],{tail}}}\n\n"

    def frame(self, choice_json: str) -> str:
        return self._head + choice_json + self._tail
