"""Server-sent events: how a streamed answer is framed.

Each chunk is one ``data: <JSON>`` event; the stream ends with ``data: [DONE]``,
after an error event if it failed once streaming had begun (its status line
was already sent), as OpenAI and vLLM do.
"""

from __future__ import annotations

from pydantic import BaseModel

MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache"}  # no proxy may hold chunks back
DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> str:
    """One event carrying ``payload`` as JSON."""
    return f"data: {payload.model_dump_json()}\n\n"
