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

``SSEResponse`` writes the events from a task of its own (see its docstring).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pydantic_core
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

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
    model), ``tail`` the JSON of the fields after it (e.g. ``"usage":null``; empty: none), in the
    model's order; ``frame(choice_json)`` is then one event with that one choice.
    """

    def __init__(self, head_fields: dict[str, Any], tail: str) -> None:
        head = ",".join(f"{json_text(name)}:{json_text(value)}" for name, value in head_fields.items())
        self._head = f'data: {{{head},"choices":['
        self._tail = f"],{tail}}}\n\n" if tail else "]}\n\n"

    def frame(self, choice_json: str) -> str:
        return self._head + choice_json + self._tail


class SSEResponse(StreamingResponse):
    """A ``StreamingResponse`` of SSE events (the same status, headers and bytes) that iterates
    its body in a plain asyncio task, which a client disconnect cancels once.

    Starlette iterates the body inside an anyio cancel scope, which cancels every await made
    after it fired, so the body's cleanup (aborting engine requests) could not await anything:
    the endpoints had to run each engine stream in a task of its own and hand its deltas over
    through a queue, a task switch per token. Here the cleanup runs in this task and may await,
    so a stream is iterated where its events are written. The body is closed however it ends.
    """

    media_type = MEDIA_TYPE

    def __init__(self, content, headers=None) -> None:
        super().__init__(content, headers=HEADERS if headers is None else headers)

    async def _produce(self, send: Send) -> None:
        async with contextlib.aclosing(self.body_iterator) as chunks:
            async for chunk in chunks:
                body = chunk if isinstance(chunk, bytes) else chunk.encode()
                await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        producer = asyncio.ensure_future(self._produce(send))
        listener = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((producer, listener), return_when=asyncio.FIRST_COMPLETED)
        finally:
            listener.cancel()
            if not producer.done():  # the client went away (or this handler was cancelled)
                producer.cancel()
                await asyncio.wait((producer,))  # its cleanup finishes before the response ends
        if not producer.cancelled():
            producer.result()  # an error while writing is the response's error


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
