"""The chat endpoint's answer as a Responses API response: the JSON, or the stream's events.

``ResponseHead`` holds what the request fixes (the ID, the echoed settings);
``response_of_chat`` turns a chat completion (its JSON) into the response;
``ResponseEventStream`` turns the chat stream's chunks (OpenAI's SSE) into the
Responses events, as they arrive, each with its ``sequence_number``:

    response.created, response.in_progress
    per output item, in order:
      message:       response.output_item.added, response.content_part.added,
                     response.output_text.delta ..., response.output_text.done,
                     response.content_part.done, response.output_item.done
      function_call: response.output_item.added,
                     response.function_call_arguments.delta ...,
                     response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

An error once the stream began ends it with ``response.failed`` (the response's
``error`` says what). ``parallel_tool_calls: false`` keeps the first call only
(``required`` is constrained to one; ``auto`` replies are parsed, so later
calls are dropped). Whitespace before a reply's first call is not a message
(as the whole reply's content, which is stripped around calls, is not).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Optional, Union

from backend.types.errors import RequestFailedError
from frontend.protocol import responses as R
from frontend.serving.errors import error_of_exception


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: dict) -> R.ResponseUsage:
    prompt_tokens, output_tokens = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return R.ResponseUsage(input_tokens=prompt_tokens, input_tokens_details=R.InputTokensDetails(cached_tokens=cached),
                           output_tokens=output_tokens, total_tokens=prompt_tokens + output_tokens)


def finish_status(finish_reason: Optional[str]) -> tuple[str, Optional[R.IncompleteDetails]]:
    """The response's (status, incomplete_details) for the chat choice's finish_reason."""
    if finish_reason == "abort":  # the server ended it (draining, or the request's time ran out)
        raise RequestFailedError("The server ended the request before the response was complete.")
    if finish_reason == "length":
        return "incomplete", R.IncompleteDetails(reason="max_output_tokens")
    return "completed", None


class ResponseHead:
    """What the request fixes in every form of its response: the ID, the time, the settings echoed."""

    def __init__(self, response_id: str, model: str, request: R.ResponsesRequest) -> None:
        self.response_id, self.model, self.request = response_id, model, request
        self.created_at = int(time.time())

    def response(self, status: str, output: list = (), usage: Optional[R.ResponseUsage] = None,
                 incomplete: Optional[R.IncompleteDetails] = None,
                 error: Optional[R.ResponseError] = None) -> R.ResponseObject:
        request = self.request
        tool_choice: Union[str, dict[str, Any]] = request.tool_choice or ("auto" if request.tools else "none")
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        text = {"format": {"type": "text"}}
        if request.text is not None:
            text = request.text.model_dump(by_alias=True, exclude_none=True)
        return R.ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status, error=error,
            incomplete_details=incomplete, instructions=request.instructions,
            max_output_tokens=request.max_output_tokens, metadata=request.metadata or {}, model=self.model,
            output=list(output), parallel_tool_calls=request.parallel_tool_calls,
            previous_response_id=request.previous_response_id, store=request.store,
            temperature=request.temperature, text=text, tool_choice=tool_choice,
            tools=[tool.model_dump() for tool in request.tools or ()], top_p=request.top_p, usage=usage,
            user=request.user)


def response_of_chat(chat: dict, head: ResponseHead) -> R.ResponseObject:
    """The response for a chat completion's JSON (its one choice): its text as a message item,
    then one function_call item per tool call."""
    choice = chat["choices"][0]
    message = choice["message"]
    status, incomplete = finish_status(choice["finish_reason"])
    calls = message.get("tool_calls") or []
    if not head.request.parallel_tool_calls:
        calls = calls[:1]
    output: list = []
    if message.get("content") or not calls:
        output.append(R.OutputMessage(id=new_item_id("msg"), status=status,
                                      content=[R.OutputText(text=message.get("content") or "")]))
    for call in calls:
        output.append(R.OutputFunctionCall(id=new_item_id("fc"), call_id=call["id"], name=call["function"]["name"],
                                           arguments=call["function"].get("arguments") or "", status="completed"))
    return head.response(status, output, response_usage(chat["usage"]), incomplete)


def _error_code(status: int) -> str:
    return {429: "rate_limit_exceeded", 400: "invalid_prompt"}.get(status, "server_error")


class ResponseEventStream:
    """One streamed response: the chat stream's chunks in, the Responses events out (``events``).

    The chat stream must end with a usage chunk (``stream_options.include_usage``).
    ``on_finished`` is awaited with the final response once it completed (or is incomplete),
    before the last event goes out.
    """

    def __init__(self, head: ResponseHead, on_finished: Callable[[R.ResponseObject], Awaitable[None]]) -> None:
        self.head, self.on_finished = head, on_finished
        self._sequence = 0
        self._pending = ""  # SSE text of a chat event not yet whole
        self._usage: dict = {}
        self._output: list = []  # the items done
        self._open: Optional[dict[str, Any]] = None  # the item being streamed, as its JSON
        self._held_space = ""  # whitespace that may come before a call (not yet a message)
        self._finish_reason: Optional[str] = None
        self._finished = False
        self._final: Optional[R.ResponseObject] = None  # once ended

    async def events(self, chat_sse: AsyncIterator[Union[str, bytes]]) -> AsyncIterator[str]:
        """The events for the chat stream ``chat_sse`` (closed when this ends or is closed, which
        aborts its engine request)."""
        started = self.head.response("in_progress").model_dump(mode="json")
        yield self._event("response.created", response=started)
        yield self._event("response.in_progress", response=started)
        try:
            async with contextlib.aclosing(chat_sse):
                async for piece in chat_sse:
                    for data in self._data_of(piece):
                        if data != "[DONE]" and not self._finished:
                            for event in self._translate(json.loads(data)):
                                yield event
            if not self._finished:
                events = self._end()
                await self.on_finished(self._final)
                for event in events:
                    yield event
        except Exception as error:  # noqa: BLE001 -- reported to the client in the stream
            if not self._finished:
                status, body = error_of_exception(error)
                yield self._failed(status, body.error.message)

    # ---- the chat stream ----

    def _data_of(self, piece: Union[str, bytes]) -> Iterator[str]:
        self._pending += piece.decode() if isinstance(piece, bytes) else piece
        *whole, self._pending = self._pending.split("\n\n")
        for block in whole:
            for line in block.split("\n"):
                if line.startswith("data:"):
                    yield line[5:].lstrip(" ")

    def _translate(self, chunk: dict) -> list[str]:
        if "choices" not in chunk and isinstance(chunk.get("error"), dict):
            error = chunk["error"]
            code = error.get("code") if isinstance(error.get("code"), int) else 500
            return [self._failed(code, str(error.get("message") or "Internal server error"))]
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        events: list[str] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
        return events

    def _end(self) -> list[str]:
        if self._finish_reason is None:
            raise RequestFailedError("The stream ended before the response was complete.")
        status, incomplete = finish_status(self._finish_reason)
        events = []
        if self._open is None and not self._output:  # no call, no text: the reply was this (maybe "")
            events += self._open_message("")
            if self._held_space:
                events += self._text(self._held_space)
        events += self._close(status)
        final = self.head.response(status, self._output, response_usage(self._usage), incomplete)
        self._finished = True
        self._final = final
        name = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(name, response=final.model_dump(mode="json"))]

    def _failed(self, status: int, message: str) -> str:
        self._finished = True
        failed = self.head.response("failed", self._output,
                                    error=R.ResponseError(code=_error_code(status), message=message))
        return self._event("response.failed", response=failed.model_dump(mode="json"))

    # ---- output items ----

    def _text(self, text: str) -> list[str]:
        if self._open is None or self._open["type"] != "message":
            if not text.strip():
                self._held_space += text
                return []
            text, self._held_space = self._held_space + text, ""
            events = self._close("completed") + self._open_message("")
        else:
            events = []
        self._open["content"][0]["text"] += text
        return events + [self._event("response.output_text.delta", item_id=self._open["id"],
                                     output_index=len(self._output), content_index=0, delta=text, logprobs=[])]

    def _open_message(self, text: str) -> list[str]:
        item = R.OutputMessage(id=new_item_id("msg"), status="in_progress", content=[]).model_dump(mode="json")
        part = R.OutputText(text="").model_dump(mode="json")
        self._open = {**item, "content": [{**part, "text": text}]}
        return [self._event("response.output_item.added", output_index=len(self._output), item=item),
                self._event("response.content_part.added", item_id=item["id"], output_index=len(self._output),
                            content_index=0, part=part)]

    def _tool_call(self, call: dict) -> list[str]:
        """A piece of the chat's ``delta.tool_calls``: a call's first (its id and name) opens its item."""
        if not self.head.request.parallel_tool_calls and call.get("index", 0) > 0:
            return []
        function = call.get("function") or {}
        events = []
        if call.get("id"):
            self._held_space = ""
            events += self._close("completed")
            item = R.OutputFunctionCall(id=new_item_id("fc"), call_id=call["id"], name=function.get("name") or "",
                                        arguments="", status="in_progress").model_dump(mode="json")
            self._open = dict(item)
            events.append(self._event("response.output_item.added", output_index=len(self._output), item=item))
        if function.get("arguments"):
            if self._open is None or self._open["type"] != "function_call":
                raise RequestFailedError("A tool call's arguments came before its name.")
            self._open["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                                      output_index=len(self._output), delta=function["arguments"]))
        return events

    def _close(self, status: str) -> list[str]:
        """Close the open item (``status``: completed, or incomplete when the reply was cut)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, events = len(self._output), []
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=[]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part)]
            self._output.append(R.OutputMessage.model_validate(item))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
            self._output.append(R.OutputFunctionCall.model_validate(item))
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
