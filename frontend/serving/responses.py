"""/v1/responses: OpenAI's Responses API, served by the chat endpoint; GET and DELETE of stored responses.

A Responses request becomes a chat request (``chat_request_of``) that
``OpenAIServingChat`` serves like any other: the same chat template,
tokenization, bounds, sampling, structured outputs, tool calls (parsed, or
constrained), engine call and errors; its answer, JSON or a stream, becomes a
Responses one in ``frontend.serving.responses_replies``. There is no second
generation path.

How the request maps:

- ``instructions`` -> a system message first; ``input`` (a string: one user
  message) -> messages: text parts joined as the chat endpoint joins them,
  ``function_call`` items -> the assistant's ``tool_calls`` (joined to the
  assistant message just before them: one turn), ``function_call_output`` ->
  ``tool`` messages.
- ``tools`` (functions) and ``tool_choice`` as the chat's; ``text.format`` ->
  ``response_format``; ``max_output_tokens`` -> ``max_completion_tokens``;
  ``temperature``, ``top_p``, ``parallel_tool_calls`` as they are.
- ``store`` (the default) keeps the response and its conversation in the
  ``ResponseStore`` (``frontend.serving.response_store``: behind ``tandem
  frontend``, on the backends, so any frontend can continue it);
  ``previous_response_id`` puts that conversation (its inputs, then its
  outputs) before the new input. Its ``instructions`` are not carried over, as
  OpenAI's are not. A streamed response is stored before its last event is
  sent, so a client may continue it at once.

Errors name the Responses field (``input`` for the chat's ``messages``, ...).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from backend.types.errors import InvalidRequestError
from frontend import protocol as P
from frontend.protocol import responses as R
from frontend.serving import sse
from frontend.serving.base import OpenAIServing, ServingContext
from frontend.serving.chat import OpenAIServingChat
from frontend.serving.errors import NotFoundError
from frontend.serving.response_store import LocalResponseStore, ResponseStore, StoredResponse
from frontend.serving.responses_replies import ResponseEventStream, ResponseHead, response_of_chat

logger = logging.getLogger(__name__)

# The chat request's fields that the Responses request names otherwise (errors raised while
# serving the translated request name the chat's).
_RESPONSES_FIELD_OF = {"messages": "input", "max_tokens": "max_output_tokens",
                       "max_completion_tokens": "max_output_tokens", "response_format": "text"}


def _text_of(content: Any) -> Any:
    """A message's content for the chat endpoint: a string, or its text parts."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


def chat_messages(items: list, instructions: Optional[str]) -> list[dict[str, Any]]:
    """The conversation ``items`` (input items) as chat messages, ``instructions`` first."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if isinstance(item, R.MessageItem):
            messages.append({"role": item.role, "content": _text_of(item.content)})
        elif isinstance(item, R.FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the reply's text, then its calls: one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            output = item.output if isinstance(item.output, str) else "\n".join(part.text for part in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages


def _response_format(text: Optional[R.TextConfig]) -> Optional[dict[str, Any]]:
    if text is None or isinstance(text.format, R.TextFormatText):
        return None
    if isinstance(text.format, R.TextFormatJsonObject):
        return {"type": "json_object"}
    schema = {"name": text.format.name, "schema": text.format.schema_}
    if text.format.description is not None:
        schema["description"] = text.format.description
    if text.format.strict is not None:
        schema["strict"] = text.format.strict
    return {"type": "json_schema", "json_schema": schema}


def chat_request_of(request: R.ResponsesRequest, items: list, response_id: str) -> P.ChatCompletionRequest:
    """The chat request that serves ``request`` over the conversation ``items``. A stream ends
    with a usage chunk (the Responses stream reports usage in its last event)."""
    tools = None
    if request.tools:
        tools = [{"type": "function", "function": {
            "name": tool.name, **({"description": tool.description} if tool.description is not None else {}),
            **({"parameters": tool.parameters} if tool.parameters is not None else {})}} for tool in request.tools]
    tool_choice: Any = request.tool_choice
    if isinstance(tool_choice, R.FunctionToolChoice):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    fields: dict[str, Any] = dict(
        model=request.model, messages=chat_messages(items, request.instructions), tools=tools,
        tool_choice=tool_choice, parallel_tool_calls=request.parallel_tool_calls,
        max_completion_tokens=request.max_output_tokens, temperature=request.temperature, top_p=request.top_p,
        response_format=_response_format(request.text), stream=request.stream, request_id=response_id,
        user=request.user)
    if request.stream:
        fields["stream_options"] = {"include_usage": True}
    return P.ChatCompletionRequest(**fields)


def _as_input_items(output: list) -> list:
    """A response's output items as the input items a continuation replays."""
    items: list = []
    for item in output:
        if isinstance(item, R.OutputMessage):
            items.append(R.MessageItem(role="assistant", id=item.id, status=item.status, content=[
                R.OutputTextPart(type="output_text", text=part.text) for part in item.content]))
        else:
            items.append(R.FunctionCallItem(type="function_call", call_id=item.call_id, name=item.name,
                                            arguments=item.arguments, id=item.id, status=item.status))
    return items


class OpenAIServingResponses(OpenAIServing):
    """/v1/responses over the chat endpoint, and the stored responses (``store``)."""

    def __init__(self, context: ServingContext, chat: OpenAIServingChat,
                 store: Optional[ResponseStore] = None) -> None:
        super().__init__(context)
        self.chat = chat
        self.store: ResponseStore = store if store is not None else LocalResponseStore()

    async def create_response(self, request: R.ResponsesRequest, raw_request: Request) -> Response:
        self._check_model(request.model)
        response_id = f"resp_{uuid.uuid4().hex}"
        items: list = []
        if request.previous_response_id is not None:
            items = list((await self._stored(request.previous_response_id, "previous_response_id")).conversation)
        items += [R.MessageItem(role="user", content=request.input)] if isinstance(request.input, str) \
            else request.input
        if not items:
            raise InvalidRequestError("input must hold at least one item (or continue a previous_response_id).",
                                      param="input")
        head = ResponseHead(response_id, self.model_name, request)
        try:
            # input_tokens_details is part of the Responses schema: reported whatever the server's
            # --enable-prompt-tokens-details (as vLLM reports it).
            chat_response = await self.chat.create_chat_completion(chat_request_of(request, items, response_id),
                                                                   raw_request, prompt_tokens_details=True)
        except InvalidRequestError as error:
            error.param = _RESPONSES_FIELD_OF.get(error.param, error.param)
            raise

        async def keep(final: R.ResponseObject) -> None:
            if request.store:
                await self._keep(final, items)

        if isinstance(chat_response, StreamingResponse):
            stream = ResponseEventStream(head, keep)
            return sse.SSEResponse(stream.events(chat_response.body_iterator))
        final = response_of_chat(json.loads(chat_response.body), head)
        await keep(final)
        return self._json(final)

    async def retrieve_response(self, response_id: str) -> JSONResponse:
        return JSONResponse((await self._stored(response_id, "response_id")).body)

    async def delete_response(self, response_id: str) -> R.DeletedResponse:
        if not await self.store.delete(response_id):
            raise self._not_found(response_id, "response_id")
        return R.DeletedResponse(id=response_id)

    # ---- the store ----

    async def _stored(self, response_id: str, param: str) -> StoredResponse:
        stored = await self.store.get(response_id)
        if stored is None:
            raise self._not_found(response_id, param)
        return stored

    @staticmethod
    def _not_found(response_id: str, param: str) -> NotFoundError:
        return NotFoundError(f"Response with id {response_id[:80]!r} not found (it was not stored, or was deleted, "
                             "or evicted from the store, or its backend restarted).", param=param)

    async def _keep(self, final: R.ResponseObject, items: list) -> None:
        entry = StoredResponse(final.model_dump(mode="json"), items + _as_input_items(final.output))
        try:
            stored = await self.store.put(final.id, entry)
        except Exception as error:  # noqa: BLE001 -- the response itself is done: it goes out unstored
            logger.warning("Response %s not stored: %s", final.id, error)
            return
        if not stored:
            logger.warning("Response %s not stored: larger than the store's byte bound, or no backend took it.",
                           final.id)
