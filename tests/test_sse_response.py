"""frontend.serving.sse.SSEResponse: what it writes, and that a client disconnect lets the body's
cleanup await (the engine abort) to the end, in the task that iterated it."""

from __future__ import annotations

import asyncio

import pytest

from frontend.serving import sse


def _asgi(response: sse.SSEResponse, disconnect_after: int | None):
    """Run ``response`` through ASGI; the client disconnects once it has read ``disconnect_after``
    body messages (None: never). Returns the messages sent."""
    sent: list[dict] = []
    gone = asyncio.Event()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if disconnect_after is not None and len(sent) - 1 >= disconnect_after:
            gone.set()

    async def run():
        await response({"type": "http"}, receive, send)
        return sent

    return run()


@pytest.mark.timeout(10)
def test_it_writes_every_chunk_as_bytes_then_ends_the_body():
    async def chunks():
        yield "data: 1\n\n"
        yield b"data: 2\n\n"
        yield sse.DONE

    sent = asyncio.run(_asgi(sse.SSEResponse(chunks()), None))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert (b"cache-control", b"no-cache") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n", b""]
    assert [m["more_body"] for m in sent[1:]] == [True, True, True, False]


@pytest.mark.timeout(10)
def test_a_disconnect_cancels_the_stream_once_and_its_cleanup_may_await():
    cleanup: list[str] = []

    async def chunks():
        try:
            yield "data: first\n\n"
            await asyncio.sleep(3600)  # waiting for the engine's next delta when the client goes
            yield "data: never\n\n"
        finally:
            cleanup.append("started")
            await asyncio.sleep(0.01)  # e.g. telling the engine to abort: must not be cancelled again
            cleanup.append("finished")

    sent = asyncio.run(_asgi(sse.SSEResponse(chunks()), disconnect_after=1))
    assert cleanup == ["started", "finished"]
    assert [m["body"] for m in sent[1:]] == [b"data: first\n\n"]  # no end of body to a client gone


@pytest.mark.timeout(10)
def test_an_error_while_streaming_is_the_responses_error_and_the_body_is_closed():
    closed: list[bool] = []

    async def chunks():
        try:
            yield "data: first\n\n"
            yield 5  # neither str nor bytes: encoding it fails in the writer
        finally:
            closed.append(True)

    with pytest.raises(AttributeError):
        asyncio.run(_asgi(sse.SSEResponse(chunks()), None))
    assert closed == [True]
