"""OpenAI requests in, engine calls out, engine deltas back as OpenAI responses and SSE chunks.

A request's life here:

1. Check the model name and the request's bounds (``backend.types.limits``: prompt
   count, n, stop strings, logprobs; a prompt too long for the context is
   refused before it is tokenized), tokenize (chat template for chat; big
   inputs off the event loop, so one huge prompt never stalls the others; a
   request's own chat template, where allowed, in ``frontend.template_sandbox``),
   check the context length with vLLM's wording, build ``SamplingParams``
   (which checks ranges).
2. One engine request per prompt (``<id>-<i>`` for the i-th prompt of a
   completions list); its deltas become text in ``frontend.outputs``
   (detokenization, stop strings), the one place that happens.
3. Non-streaming: collect, answer JSON. Streaming: wait for the first delta
   (so errors the engine raises up front, bad input or a full queue, still get
   their HTTP status), then stream SSE chunks; an error after that is sent as
   ``data: {"error": ...}`` followed by ``data: [DONE]``.

However a request ends early (all sequences stopped by stop strings, the
client went away, an error), its engine streams are closed, which aborts them
in the engine (the ``EngineClient`` contract) and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar, Union

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from transformers import PreTrainedTokenizerFast

from backend.types.errors import (EngineDeadError, InvalidRequestError, ModelNotFoundError, OverloadedError,
                                  RequestFailedError, RequestTimeoutError, TandemError)
from backend.types.limits import Limits
from backend.types.outputs import ModelInfo, PositionLogprobs
from backend.types.sampling_params import SamplingParams, StructuredOutputsParams
from frontend import protocol as P
from frontend.engine_client import EngineClient
from frontend.outputs import RequestOutputBuilder, TextDelta
from frontend.template_sandbox import sandbox_from_limits
from frontend.tokenizer import decode_token, encode_prompt, prepare_chat, render_chat
from frontend.tool_calls import (ToolReply, check_tools, choose_parser, constrained_tool_schema, messages_for_template,
                                 template_supports_tools)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# OpenAI's JSON has no -inf: clamp like OpenAI and vLLM do.
_MIN_LOGPROB = -9999.0
_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                      "frequency_penalty", "repetition_penalty")
# Inputs longer than this (characters, or token IDs) are tokenized, rendered or decoded on a
# worker thread: the tokenizers library releases the GIL, so the event loop keeps serving.
_OFF_LOOP_MIN_SIZE = 4096


# ---- errors -> HTTP status and OpenAI error JSON (the one place) ------------------------------


class AuthenticationError(TandemError):
    """The request lacks the API key or carries a wrong one (HTTP 401)."""


class ClientDisconnectedError(TandemError):
    """The HTTP client went away before the answer was ready; nobody reads the response."""


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than --max-request-body-bytes (HTTP 413)."""


HTTP_STATUS_CLIENT_CLOSED_REQUEST = 499  # nginx's: the client went away before the answer


_STATUS_OF_ERROR: tuple[tuple[type[Exception], HTTPStatus], ...] = (
    (RequestTooLargeError, HTTPStatus.REQUEST_ENTITY_TOO_LARGE),  # before its base class
    (InvalidRequestError, HTTPStatus.BAD_REQUEST),
    (AuthenticationError, HTTPStatus.UNAUTHORIZED),
    (ModelNotFoundError, HTTPStatus.NOT_FOUND),
    (OverloadedError, HTTPStatus.TOO_MANY_REQUESTS),  # BackendOverloadedError included; sent with Retry-After
    (EngineDeadError, HTTPStatus.SERVICE_UNAVAILABLE),  # BackendUnavailableError included
    (RequestTimeoutError, HTTPStatus.GATEWAY_TIMEOUT),
    (RequestFailedError, HTTPStatus.INTERNAL_SERVER_ERROR),  # one request failed in the engine; it goes on
)

# vLLM's error ``type`` names (OpenAI's client maps by status code, not by these).
_ERROR_TYPE_OF_STATUS = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
    HTTPStatus.TOO_MANY_REQUESTS: "RateLimitError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: Optional[str] = None) -> P.ErrorResponse:
    status = HTTPStatus(status)
    error_type = _ERROR_TYPE_OF_STATUS.get(status, status.phrase.replace(" ", "") + "Error")
    return P.ErrorResponse(error=P.ErrorInfo(message=_encodable(message), type=error_type,
                                             param=None if param is None else _encodable(param), code=status.value))


def _encodable(text: str) -> str:
    """``text`` with any lone surrogate (an error quoting a client's JSON key) as a ``\\udxxx``
    escape: the error itself must always be writable as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8") if not text.isascii() else text


def error_of_exception(error: Exception) -> tuple[int, P.ErrorResponse]:
    """The HTTP status and OpenAI error body for an exception; unknown ones are a 500."""
    for error_class, status in _STATUS_OF_ERROR:
        if isinstance(error, error_class):
            return status, error_body(status, str(error), getattr(error, "param", None))
    logger.error("Unexpected error while serving a request", exc_info=error)
    return HTTPStatus.INTERNAL_SERVER_ERROR, error_body(
        HTTPStatus.INTERNAL_SERVER_ERROR, f"Internal server error: {type(error).__name__}: {error}")


def error_json_response(status: int, body: P.ErrorResponse, retry_after_s: Optional[int] = None) -> JSONResponse:
    """The error as a response; a 429 carries ``Retry-After: retry_after_s``."""
    headers = {"Retry-After": str(retry_after_s)} if status == HTTPStatus.TOO_MANY_REQUESTS and retry_after_s else None
    return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)


# ---- one engine request ----------------------------------------------------------------------


@dataclass
class _Prompt:
    text: Optional[str]  # None when the client sent token IDs
    token_ids: list[int]


class _EngineRun:
    """One engine request (one prompt, ``n`` sequences) and the builder of its text."""

    def __init__(self, request_id: str, prompt: _Prompt, params: SamplingParams,
                 tokenizer: PreTrainedTokenizerFast, first_choice: int, deadline: float,
                 cache_salt: Optional[str]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.deadline = deadline  # time.monotonic() seconds: the engine aborts the request then
        self.cache_salt = cache_salt
        self.first_choice = first_choice  # choice index of sequence 0 (vLLM: prompt_index * n)
        self.builder = RequestOutputBuilder(tokenizer, request_id, prompt.text, prompt.token_ids, params)
        self.echo_only = False  # completions' echo with max_tokens=0: the generated token is dropped
        # Chat: the reply's role, vLLM's echo prefix, and each sequence's tool-call handling.
        self.role = "assistant"
        self.echo_text = ""
        self.replies: list[ToolReply] = []

    async def deltas(self, client: EngineClient) -> AsyncIterator["_Event"]:
        """(this run, sequence index, what that sequence added), until every sequence ended."""
        stream = client.generate(self.request_id, self.prompt.token_ids, self.params, deadline=self.deadline,
                                 cache_salt=self.cache_salt)
        try:
            async for output in stream:
                delta = self.builder.add(output)
                yield self, output.index, delta
                if self.builder.finished:
                    break  # stop strings can end it before the engine does
        finally:
            await stream.aclose()  # before the end: aborts the request in the engine


# What a request's streams yield: (the engine run, sequence index, what that sequence added).
_Event = tuple[_EngineRun, int, TextDelta]


async def _merge(iterators: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of several async iterators as they arrive; the first error ends it.

    Each iterator runs in a task of its own, so closing or cancelling the merged
    iterator only has to cancel those tasks: their cleanup (aborting engine
    requests) runs in them, where no outer cancel scope can interrupt it.
    """
    queue: asyncio.Queue = asyncio.Queue()  # unbounded: bounded by max_tokens
    finished = object()

    async def pump(iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((None, item))
            queue.put_nowait((None, finished))
        except Exception as error:  # noqa: BLE001 -- handed to the consumer
            queue.put_nowait((error, None))

    tasks = [asyncio.ensure_future(pump(iterator)) for iterator in iterators]
    try:
        remaining = len(tasks)
        while remaining:
            error, item = await queue.get()
            if error is not None:
                raise error
            if item is finished:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def _wait_for_disconnect(raw_request: Request) -> None:
    # The body has been read: the next message is the disconnect (or none, until the response ends).
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(raw_request: Request, awaitable: Awaitable[T]) -> T:
    """Await it, but cancel it (aborting its engine requests) if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled
        work.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.wait({work})  # let its cleanup (closing the engine streams) finish
    raise ClientDisconnectedError("The client disconnected before the response was ready.")


def _sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


# ---- logprob formats ---------------------------------------------------------------------------


def _finite(logprob: float) -> float:
    return _MIN_LOGPROB if math.isnan(logprob) else max(logprob, _MIN_LOGPROB)


def _token_text(tokenizer: PreTrainedTokenizerFast, token_id: int, position: Optional[PositionLogprobs],
                as_ids: bool = False) -> str:
    """A token's text in logprobs; ``as_ids`` (return_tokens_as_token_ids): ``token_id:<id>``."""
    if as_ids:
        return f"token_id:{token_id}"
    logprob = position.get(token_id) if position is not None else None
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode_token(tokenizer, token_id)


def completion_logprobs(tokenizer: PreTrainedTokenizerFast, token_ids: list[int],
                        positions: list[Optional[PositionLogprobs]], initial_offset: int,
                        as_ids: bool = False) -> P.CompletionLogProbs:
    """OpenAI's legacy format. ``top_logprobs`` holds the chosen token and the top-k, as vLLM's;
    a position without logprobs (the prompt's first token) has None."""
    result = P.CompletionLogProbs()
    offset = initial_offset
    for token_id, position in zip(token_ids, positions):
        token = _token_text(tokenizer, token_id, position, as_ids)
        if position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            result.token_logprobs.append(_finite(position[token_id].logprob))
            result.top_logprobs.append({_token_text(tokenizer, tid, position, as_ids): _finite(lp.logprob)
                                        for tid, lp in position.items()})
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
    return result


def chat_logprobs(tokenizer: PreTrainedTokenizerFast, token_ids: list[int],
                  positions: list[PositionLogprobs], num_top: int, as_ids: bool = False) -> P.ChatCompletionLogProbs:
    """OpenAI's chat format: each token with its ``num_top`` most likely alternatives."""
    content = []
    for token_id, position in zip(token_ids, positions):
        token = _token_text(tokenizer, token_id, position, as_ids)
        ranked = sorted(position.items(), key=lambda item: (-item[1].logprob, item[0]))[:num_top]
        top = [P.ChatCompletionTopLogprob(token=text, logprob=_finite(lp.logprob), bytes=list(text.encode()))
               for text, lp in ((_token_text(tokenizer, tid, position, as_ids), lp) for tid, lp in ranked)]
        content.append(P.ChatCompletionLogprobContent(
            token=token, logprob=_finite(position[token_id].logprob), bytes=list(token.encode()), top_logprobs=top))
    return P.ChatCompletionLogProbs(content=content)


# ---- the serving logic -----------------------------------------------------------------------


def _prompt_logprobs_json(positions: Optional[list]) -> P.Logprobs:
    """vLLM's prompt_logprobs: per prompt position (the first is null) token ID -> logprob."""
    if positions is None:
        return None
    return [None if position is None else
            {token_id: P.PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
             for token_id, lp in position.items()} for position in positions]


class OpenAIServing:
    """The OpenAI endpoints' logic over one ``EngineClient`` and the backend's tokenizer.

    ``tool_call_parser``: the format of tool calls in the model's replies
    (``frontend.tool_calls``; "auto" picks it from the chat template).
    """

    def __init__(self, engine_client: EngineClient, tokenizer: PreTrainedTokenizerFast,
                 model_info: ModelInfo, limits: Optional[Limits] = None,
                 tool_call_parser: str = "auto") -> None:
        self.engine_client = engine_client
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.limits = limits or Limits()
        self.tool_call_parser = choose_parser(tool_call_parser, tokenizer.chat_template)
        self.num_in_flight = 0  # generation requests being answered (/load)
        # No token covers more characters than the longest vocabulary entry (for byte-level and
        # SentencePiece BPE), so a longer text surely has more tokens than the context holds.
        # Twice that, for normalizers that merge characters.
        max_token_chars = max(map(len, tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = 2 * model_info.max_model_len * max(max_token_chars, 1)
        self._workers = ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="tandem-tokenize")
        # Request chat templates: None refuses them (vLLM's default); else they render in worker processes.
        self.template_sandbox = sandbox_from_limits(self.limits)
        if self.template_sandbox is not None:
            self.template_sandbox.start()

    def close(self) -> None:
        """Stop the chat template workers (if any); the tokenizer threads end with the process."""
        if self.template_sandbox is not None:
            self.template_sandbox.close()

    async def _off_loop(self, size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``: inline for small inputs, on a worker thread for big ones."""
        if size < _OFF_LOOP_MIN_SIZE:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._workers, functools.partial(fn, *args, **kwargs))

    def _deadline(self) -> float:
        return time.monotonic() + self.limits.request_timeout_s

    def _check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing it, a text too long for any prompt to fit the context."""
        if num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"The prompt ({num_chars} characters) is longer than any prompt this model takes: its maximum "
                f"context length is {self.model_info.max_model_len} tokens, which no text of more than "
                f"{self.max_prompt_chars} characters fits in. Please reduce the length of the input.", param=param)

    def _check_chat_template(self, chat_template: Optional[str]) -> None:
        """A request's own chat template only where the operator allows them (vLLM's rule)."""
        if chat_template and self.template_sandbox is None:
            raise InvalidRequestError(
                "This server renders only the model's own chat template: a chat_template in the request is "
                "refused. An operator who trusts the clients can allow them with --trust-request-chat-template "
                "(they then render in a worker process, bounded in time and memory).", param="chat_template")

    async def _render_and_encode_chat(self, messages: list, add_generation_prompt: bool,
                                      chat_template: Optional[str], continue_final_message: bool,
                                      template_kwargs: dict, add_special_tokens: bool = False) -> tuple[str, list[int]]:
        """The chat's prompt text and its token IDs (no special tokens added by default: the
        template has them). Its length is checked before rendering and before tokenizing.

        The model's template renders here (a big chat on a worker thread); a request's
        template (``chat_template``) in the sandbox's worker processes."""
        size = _chat_text_size(messages)
        self._check_prompt_chars(size, param="messages")
        if chat_template:
            self._check_chat_template(chat_template)
            job = await self._off_loop(size, prepare_chat, self.tokenizer, messages, add_generation_prompt,
                                       chat_template, continue_final_message, **template_kwargs)
            text = await self.template_sandbox.render(job)
        else:
            text = await self._off_loop(size, render_chat, self.tokenizer, messages, add_generation_prompt,
                                        None, continue_final_message, **template_kwargs)
        return text, await self._encode(text, add_special_tokens=add_special_tokens, param="messages")

    async def _encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        self._check_prompt_chars(len(text), param=param)
        return await self._off_loop(len(text), encode_prompt, self.tokenizer, text, add_special_tokens, param)

    @property
    def model_name(self) -> str:
        return self.model_info.model_name

    # ---- endpoints ----

    def models(self) -> P.ModelList:
        return P.ModelList(data=[self.model_card(self.model_name)])

    def model_card(self, model_id: str) -> P.ModelCard:
        if model_id != self.model_name:
            raise ModelNotFoundError(f"The model `{model_id}` does not exist.")
        return P.ModelCard(id=self.model_name, root=self.model_name, max_model_len=self.model_info.max_model_len)

    async def create_completion(self, request: P.CompletionRequest, raw_request: Request) -> Response:
        self._check_request(request)
        if request.max_tokens == 0 and not request.echo:
            raise InvalidRequestError("max_tokens must be at least 1 (0 is only for echo, to score the prompt).",
                                      param="max_tokens")
        prompts = await self._completion_prompts(request.prompt, request.best_of or request.n,
                                                 request.add_special_tokens is not False)
        prompts = [self._truncate(prompt, request.truncate_prompt_tokens) for prompt in prompts]
        # Omitted: OpenAI's and vLLM's 16, capped to the room left; explicit null: all the room left.
        explicit = "max_tokens" in request.model_fields_set
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = request.logprobs
        base_id = f"cmpl-{request.request_id or uuid.uuid4().hex}"
        deadline = self._deadline()
        runs = []
        for i, prompt in enumerate(prompts):
            requested = request.max_tokens if explicit else None
            if requested == 0:  # echo only: one token is generated and dropped (max_tokens is at least 1)
                requested = 1
            max_tokens = self._max_tokens(requested, len(prompt.token_ids),
                                          default=None if explicit else request.max_tokens, prompt_param="prompt")
            params = self._sampling_params(request, max_tokens, request.logprobs, prompt_logprobs, None)
            run = _EngineRun(f"{base_id}-{i}", prompt, params, self.tokenizer, first_choice=i * request.n,
                             deadline=deadline, cache_salt=request.cache_salt)
            run.echo_only = request.max_tokens == 0
            runs.append(run)
        if request.stream:
            return await self._stream(raw_request, runs, lambda first, events: self._completion_chunks(
                request, base_id, runs, first, events))
        await _unless_disconnected(raw_request, self._collect(runs))
        return self._json(self._completion_response(request, base_id, runs))

    async def create_chat_completion(self, request: P.ChatCompletionRequest, raw_request: Request) -> Response:
        self._check_request(request)
        self._check_chat_template(request.chat_template)
        if request.top_logprobs is not None and request.top_logprobs < 0:
            raise InvalidRequestError(f"top_logprobs must be non-negative, got {request.top_logprobs}.",
                                      param="top_logprobs")
        if request.top_logprobs and not request.logprobs:
            raise InvalidRequestError("When using `top_logprobs`, `logprobs` must be set to true.",
                                      param="top_logprobs")
        if request.logprob_token_ids is not None and not request.logprobs:
            raise InvalidRequestError("When using `logprob_token_ids`, `logprobs` must be set to true.",
                                      param="logprob_token_ids")
        named = check_tools(request.tools, request.tool_choice)
        tool_mode = named and "named" or request.tool_choice or ("auto" if request.tools else "none")
        constraint = None
        if tool_mode in ("required", "named"):
            if request.response_format is not None or request.structured_outputs is not None:
                raise InvalidRequestError("tool_choice 'required' or a named function cannot be combined with "
                                          "response_format or structured_outputs.", param="tool_choice")
            schema = constrained_tool_schema(request.tools, named, request.parallel_tool_calls)
            constraint = StructuredOutputsParams(json=schema)
        supports_tools = template_supports_tools(request.chat_template or self.tokenizer.chat_template)
        messages = messages_for_template(request.messages, request.tools, supports_tools)
        text, token_ids = await self._render_and_encode_chat(
            messages, request.add_generation_prompt, request.chat_template, request.continue_final_message,
            {**(request.chat_template_kwargs or {}), "tools": request.tools if supports_tools else None},
            add_special_tokens=bool(request.add_special_tokens))
        prompt = self._truncate(_Prompt(text, token_ids), request.truncate_prompt_tokens)
        # vLLM: max_completion_tokens wins; neither given means all the room left.
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        max_tokens = self._max_tokens(requested, len(prompt.token_ids), default=None, prompt_param="messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs and request.logprob_token_ids is None else None
        params = self._sampling_params(request, max_tokens, logprobs, request.prompt_logprobs, constraint)
        base_id = f"chatcmpl-{request.request_id or uuid.uuid4().hex}"
        run = _EngineRun(base_id, prompt, params, self.tokenizer, first_choice=0, deadline=self._deadline(),
                         cache_salt=request.cache_salt)
        run.replies = [ToolReply(tool_mode, self.tool_call_parser, named) for _ in range(params.n)]
        role = "assistant" if request.add_generation_prompt else str(request.messages[-1].get("role", "assistant"))
        run.role = role
        last = request.messages[-1] if request.messages else {}
        run.echo_text = str(last.get("content") or "") if request.echo and last.get("role") == role else ""
        runs = [run]
        if request.stream:
            return await self._stream(raw_request, runs, lambda first, events: self._chat_chunks(
                request, base_id, runs, first, events))
        await _unless_disconnected(raw_request, self._collect(runs))
        return self._json(self._chat_response(request, base_id, runs))

    async def tokenize(self, request: P.TokenizeRequest) -> P.TokenizeResponse:
        self._check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise InvalidRequestError("Give exactly one of prompt or messages.", param="prompt")
        self._check_chat_template(request.chat_template)
        if request.messages is not None:
            supports_tools = template_supports_tools(request.chat_template or self.tokenizer.chat_template)
            check_tools(request.tools, None)
            messages = messages_for_template(request.messages, request.tools, supports_tools)
            _, tokens = await self._render_and_encode_chat(
                messages, request.add_generation_prompt, request.chat_template, request.continue_final_message,
                {**(request.chat_template_kwargs or {}), "tools": request.tools if supports_tools else None},
                add_special_tokens=bool(request.add_special_tokens))
        else:
            tokens = await self._encode(request.prompt, add_special_tokens=request.add_special_tokens is not False)
        token_strs = self.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return P.TokenizeResponse(count=len(tokens), max_model_len=self.model_info.max_model_len, tokens=tokens,
                                  token_strs=token_strs)

    async def detokenize(self, request: P.DetokenizeRequest) -> P.DetokenizeResponse:
        self._check_model(request.model)
        self._check_token_ids(request.tokens, param="tokens")
        return P.DetokenizeResponse(prompt=await self._off_loop(len(request.tokens), self.tokenizer.decode,
                                                                request.tokens))

    def tokenizer_info(self) -> P.TokenizerInfoResponse:
        """The tokenizer's configuration, as vLLM's /tokenizer_info (lm-eval's remote tokenizer reads it)."""
        tokenizer = self.tokenizer
        info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            info[key] = getattr(tokenizer, key, None)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            info[key] = getattr(tokenizer, key, None)
        info.update(model_max_length=self.model_info.max_model_len, chat_template=tokenizer.chat_template,
                    add_bos_token=getattr(tokenizer, "add_bos_token", None), vocab_size=len(tokenizer),
                    padding_side=tokenizer.padding_side, truncation_side=tokenizer.truncation_side,
                    clean_up_tokenization_spaces=tokenizer.clean_up_tokenization_spaces)
        return P.TokenizerInfoResponse(**info)

    # ---- request -> engine ----

    def _check_model(self, name: Optional[str]) -> None:
        if name and name != self.model_name:  # omitted or empty: the served model, as vLLM
            raise ModelNotFoundError(f"The model `{name}` does not exist.")

    def _check_request(self, request: P.SamplingFields) -> None:
        """The checks both generation endpoints share, before any work."""
        self._check_model(request.model)
        for name, reason in P.UNSUPPORTED_FIELDS.items():
            value = getattr(request, name, None)
            if value is not None and not (name == "priority" and value == 0):
                raise InvalidRequestError(f"{reason}; leave `{name}` out.", param=name)
        if request.stream_options is not None and not request.stream:
            raise InvalidRequestError("stream_options can only be set with stream=true.", param="stream_options")
        if request.response_format is not None and request.structured_outputs is not None:
            raise InvalidRequestError("Give response_format or structured_outputs, not both.",
                                      param="response_format")
        if request.stop_token_ids:
            self._check_token_ids(request.stop_token_ids, param="stop_token_ids")
        if request.logprob_token_ids:
            self._check_token_ids(request.logprob_token_ids, param="logprob_token_ids")
        if request.best_of is not None:
            if request.best_of < request.n:
                raise InvalidRequestError(f"best_of must be at least n={request.n}, got {request.best_of}.",
                                          param="best_of")
            if request.stream and request.best_of > request.n and not request.use_beam_search:
                raise InvalidRequestError("best_of > n cannot be streamed.", param="best_of")

    def _check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.model_info.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"Token ID {bad} is out of vocabulary (size {vocab_size}).", param=param)

    async def _completion_prompts(self, prompt: Union[str, list], n: int,
                                  add_special_tokens: bool = True) -> list[_Prompt]:
        if isinstance(prompt, str):
            items: list = [prompt]
        elif not prompt:
            raise InvalidRequestError("prompt must not be empty.", param="prompt")
        elif isinstance(prompt[0], int):
            items = [prompt]  # one prompt of token IDs
        else:
            items = prompt
        self.limits.check_prompt_count(len(items), n)
        for item in items:  # every prompt's length before any is tokenized
            if isinstance(item, str):
                self._check_prompt_chars(len(item), param="prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append(_Prompt(item, await self._encode(item, add_special_tokens)))
            else:
                self._check_token_ids(item, param="prompt")
                prompts.append(_Prompt(None, list(item)))
            if not prompts[-1].token_ids:
                raise InvalidRequestError("The prompt is empty.", param="prompt")
        return prompts

    def _truncate(self, prompt: _Prompt, keep: Optional[int]) -> _Prompt:
        """truncate_prompt_tokens: the last ``keep`` tokens (-1: max_model_len); None: as it is."""
        if keep is None:
            return prompt
        if keep == -1:
            keep = self.model_info.max_model_len
        if keep < 1:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}.",
                                      param="truncate_prompt_tokens")
        if len(prompt.token_ids) <= keep:
            return prompt
        return _Prompt(None, prompt.token_ids[-keep:])  # its text is now that of the tokens kept

    def _max_tokens(self, requested: Optional[int], prompt_len: int, default: Optional[int],
                    prompt_param: str) -> int:
        """The max_tokens to send: ``requested`` if it fits (vLLM's errors if not), else the
        ``default`` (None: all the room left) capped to the room left."""
        limit = self.model_info.max_model_len
        if prompt_len > limit or (requested is None and prompt_len >= limit):
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input messages.", param=prompt_param)
        room = limit - prompt_len
        if requested is not None:
            if requested > room:
                raise InvalidRequestError(
                    f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum "
                    f"context length is {limit} tokens and your request has {prompt_len} input tokens "
                    f"({requested} > {limit} - {prompt_len}).", param="max_tokens")
            return requested
        return room if default is None else min(default, room)

    @staticmethod
    def _structured_outputs(request: P.SamplingFields) -> Optional[StructuredOutputsParams]:
        """response_format (OpenAI's) or structured_outputs (vLLM's) as the engine's constraint."""
        fmt = request.response_format
        if fmt is not None:
            if fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise InvalidRequestError("response_format of type json_schema needs json_schema.schema.",
                                          param="response_format")
            return StructuredOutputsParams(json=fmt.json_schema.schema_)
        if request.structured_outputs is not None:
            return StructuredOutputsParams.coerce(request.structured_outputs.model_dump(by_alias=True,
                                                                                        exclude_none=True))
        return None

    def _sampling_params(self, request: P.SamplingFields, max_tokens: int, logprobs: Optional[int],
                         prompt_logprobs: Optional[int],
                         constraint: Optional[StructuredOutputsParams]) -> SamplingParams:
        if constraint is None:
            constraint = self._structured_outputs(request)
        n = request.n
        if request.best_of is not None:
            n = request.best_of  # best_of sequences run; the n most likely are returned
            if not request.use_beam_search and logprobs is None and request.logprob_token_ids is None:
                logprobs = 0  # to rank them by cumulative logprob (not returned unless asked)
        fields: dict[str, Any] = dict(
            n=n, max_tokens=max_tokens, min_tokens=request.min_tokens, seed=request.seed,
            stop=request.stop, stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logprob_token_ids=request.logprob_token_ids, structured_outputs=constraint,
            use_beam_search=request.use_beam_search, length_penalty=request.length_penalty)
        for name in _SAMPLING_DEFAULTS:  # None: the engine's default
            value = getattr(request, name)
            if value is not None:
                fields[name] = value
        if request.use_beam_search:
            fields.pop("temperature", None)  # beams are ranked by raw logprobs: temperature changes nothing
        params = SamplingParams(**fields)  # checks every value, naming the parameter
        self.limits.check_sampling_params(params)
        self.limits.check_cache_salt(request.cache_salt)
        return params

    # ---- engine -> response ----

    def _events(self, runs: list[_EngineRun]) -> AsyncIterator[_Event]:
        return _merge([run.deltas(self.engine_client) for run in runs])

    async def _collect(self, runs: list[_EngineRun]) -> None:
        self.num_in_flight += 1
        try:
            async with contextlib.aclosing(self._events(runs)) as events:
                async for _ in events:
                    pass
        finally:
            self.num_in_flight -= 1

    async def _stream(self, raw_request: Request, runs: list[_EngineRun],
                      chunks: Callable[[Optional[_Event], AsyncIterator[_Event]], AsyncIterator[str]]) -> Response:
        """Wait for the first delta (errors until then get their HTTP status), then stream SSE."""
        events = self._events(runs)
        self.num_in_flight += 1
        try:
            first = await _unless_disconnected(raw_request, anext(events, None))
        except BaseException:
            self.num_in_flight -= 1
            await events.aclose()
            raise
        return StreamingResponse(self._sse_stream(chunks(first, events), events),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _sse_stream(self, chunks: AsyncIterator[str], events: AsyncIterator) -> AsyncIterator[str]:
        """The chunks, an error chunk if one fails, then [DONE]. Closing it (the client went
        away: Starlette cancels it) closes the engine streams."""
        try:
            async with contextlib.aclosing(events):
                async for chunk in chunks:
                    yield chunk
        except Exception as error:  # noqa: BLE001 -- reported to the client in the stream
            _, body = error_of_exception(error)
            yield _sse(body)
        finally:
            self.num_in_flight -= 1
        yield _SSE_DONE

    def _usage(self, runs: list[_EngineRun]) -> P.UsageInfo:
        prompt_tokens = sum(len(run.prompt.token_ids) for run in runs)
        completion_tokens = sum(0 if run.echo_only else len(seq.token_ids)
                                for run in runs for seq in run.builder.sequences)
        cached = sum(run.builder.num_cached_tokens for run in runs)
        return P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens,
                           prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))

    @staticmethod
    def _json(response: BaseModel) -> JSONResponse:
        return JSONResponse(response.model_dump(mode="json"))

    def _echo_text(self, run: _EngineRun) -> str:
        prompt = run.prompt
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    def _echo_logprobs(self, run: _EngineRun) -> list[Optional[PositionLogprobs]]:
        positions = run.builder.prompt_logprobs
        return list(positions) if positions is not None else [None] * len(run.prompt.token_ids)

    @staticmethod
    def _chosen(request: P.SamplingFields, run: _EngineRun, outputs: list) -> list:
        """The sequences to return: all, or with best_of the n most likely (beam search's come ranked)."""
        if request.best_of is None or request.best_of == request.n:
            return outputs
        if not request.use_beam_search:
            outputs = sorted(outputs, key=lambda seq: seq.cumulative_logprob or 0.0, reverse=True)
        return outputs[:request.n]

    def _completion_response(self, request: P.CompletionRequest, base_id: str,
                             runs: list[_EngineRun]) -> P.CompletionResponse:
        choices = []
        as_ids = request.return_tokens_as_token_ids
        for run in runs:
            for rank, seq in enumerate(self._chosen(request, run, run.builder.build().outputs)):
                text, token_ids, positions = seq.text, seq.token_ids, seq.logprobs
                finish_reason = seq.finish_reason
                if run.echo_only:
                    text, token_ids, positions, finish_reason = "", [], [] if positions is not None else None, "length"
                if request.echo:
                    text = self._echo_text(run) + text
                    if positions is not None:
                        token_ids = run.prompt.token_ids + token_ids
                        positions = self._echo_logprobs(run) + positions
                logprobs = None
                if request.logprobs is not None or request.logprob_token_ids is not None:
                    logprobs = completion_logprobs(self.tokenizer, token_ids, positions, 0, as_ids)
                choices.append(P.CompletionResponseChoice(
                    index=run.first_choice + rank, text=text, logprobs=logprobs,
                    finish_reason=finish_reason, stop_reason=None if run.echo_only else seq.stop_reason,
                    token_ids=(seq.token_ids if not run.echo_only else []) if request.return_token_ids else None,
                    prompt_token_ids=run.prompt.token_ids if request.return_token_ids else None,
                    prompt_logprobs=_prompt_logprobs_json(run.builder.prompt_logprobs)
                    if request.prompt_logprobs is not None else None))
        return P.CompletionResponse(id=base_id, model=self.model_name, choices=choices, usage=self._usage(runs))

    async def _completion_chunks(self, request: P.CompletionRequest, base_id: str, runs: list[_EngineRun],
                                 first: Optional[_Event], events: AsyncIterator[_Event]) -> AsyncIterator[str]:
        created = int(time.time())
        echoed: set[int] = set()
        streamed_chars: dict[int, int] = {}  # vLLM's text_offset base of each choice's next chunk
        as_ids = request.return_tokens_as_token_ids
        continuous = request.stream_options is not None and request.stream_options.continuous_usage_stats
        async for run, seq_index, delta in _prepend(first, events):
            if seq_index >= request.n:  # beam search: only the best n beams are returned
                continue
            choice = run.first_choice + seq_index
            text, token_ids, positions = delta.text, delta.token_ids, delta.logprobs
            finish_reason = delta.finish_reason
            if run.echo_only:
                text, token_ids, positions = "", [], [] if positions is not None else None
                finish_reason = "length" if delta.finished else None
            first_of_choice = choice not in echoed
            echoed.add(choice)
            if request.echo and first_of_choice:
                text = self._echo_text(run) + text
                if positions is not None:
                    token_ids = run.prompt.token_ids + token_ids
                    positions = self._echo_logprobs(run) + positions
            if not text and not delta.finished and not (positions and token_ids):
                continue
            logprobs = None
            if request.logprobs is not None or request.logprob_token_ids is not None:
                logprobs = completion_logprobs(self.tokenizer, token_ids, positions, streamed_chars.get(choice, 0),
                                               as_ids)
            streamed_chars[choice] = streamed_chars.get(choice, 0) + len(text)
            yield _sse(P.CompletionStreamResponse(
                id=base_id, created=created, model=self.model_name,
                choices=[P.CompletionResponseChoice(
                    index=choice, text=text, logprobs=logprobs, finish_reason=finish_reason,
                    stop_reason=None if run.echo_only else delta.stop_reason,
                    token_ids=(delta.token_ids if not run.echo_only else []) if request.return_token_ids else None,
                    prompt_token_ids=run.prompt.token_ids if request.return_token_ids and first_of_choice else None,
                    prompt_logprobs=_prompt_logprobs_json(run.builder.prompt_logprobs)
                    if request.prompt_logprobs is not None and first_of_choice else None)],
                usage=self._usage(runs) if continuous else None))
        if request.stream_options is not None and request.stream_options.include_usage:
            yield _sse(P.CompletionStreamResponse(id=base_id, created=created, model=self.model_name, choices=[],
                                                  usage=self._usage(runs)))

    def _chat_response(self, request: P.ChatCompletionRequest, base_id: str,
                       runs: list[_EngineRun]) -> P.ChatCompletionResponse:
        (run,) = runs
        choices = []
        as_ids = request.return_tokens_as_token_ids
        for rank, seq in enumerate(self._chosen(request, run, run.builder.build().outputs)):
            logprobs = None
            if request.logprobs:
                num_top = request.top_logprobs or 0
                if request.logprob_token_ids is not None:
                    num_top = len(request.logprob_token_ids) + 1
                logprobs = chat_logprobs(self.tokenizer, seq.token_ids, seq.logprobs, num_top, as_ids)
            content, calls = run.replies[seq.index].whole(seq.text)
            finish_reason = seq.finish_reason
            if calls and finish_reason == "stop":
                finish_reason = run.replies[seq.index].finish_reason_with_calls
            if content is not None and run.echo_text:
                content = run.echo_text + content
            message = P.ChatMessage(role=run.role, content=content, tool_calls=[
                P.ToolCall(id=c.id, function=P.FunctionCall(name=c.name, arguments=c.arguments)) for c in calls])
            choices.append(P.ChatCompletionResponseChoice(
                index=rank, message=message, logprobs=logprobs, finish_reason=finish_reason,
                stop_reason=seq.stop_reason, token_ids=seq.token_ids if request.return_token_ids else None))
        return P.ChatCompletionResponse(
            id=base_id, model=self.model_name, choices=choices, usage=self._usage(runs),
            prompt_logprobs=_prompt_logprobs_json(run.builder.prompt_logprobs)
            if request.prompt_logprobs is not None else None,
            prompt_token_ids=run.prompt.token_ids if request.return_token_ids else None)

    async def _chat_chunks(self, request: P.ChatCompletionRequest, base_id: str, runs: list[_EngineRun],
                           first: Optional[_Event], events: AsyncIterator[_Event]) -> AsyncIterator[str]:
        (run,) = runs
        created = int(time.time())
        as_ids = request.return_tokens_as_token_ids
        continuous = request.stream_options is not None and request.stream_options.continuous_usage_stats

        def chunk(choices: list[P.ChatCompletionStreamChoice], usage: Optional[P.UsageInfo] = None,
                  prompt_token_ids: Optional[list[int]] = None) -> str:
            if usage is None and continuous and choices:
                usage = self._usage(runs)
            return _sse(P.ChatCompletionStreamResponse(id=base_id, created=created, model=self.model_name,
                                                       choices=choices, usage=usage,
                                                       prompt_token_ids=prompt_token_ids))

        def tool_deltas(pieces) -> Optional[list[P.DeltaToolCall]]:
            if not pieces:
                return None
            return [P.DeltaToolCall(index=i, id=call_id, type="function" if call_id else None,
                                    function=P.FunctionCall(name=name, arguments=arguments))
                    for i, call_id, name, arguments in pieces]

        # OpenAI's first chunk of each choice carries the role (and vLLM's echo).
        for index in range(request.n):
            yield chunk([P.ChatCompletionStreamChoice(index=index, delta=P.DeltaMessage(
                role=run.role, content=run.echo_text))],
                prompt_token_ids=run.prompt.token_ids if request.return_token_ids and index == 0 else None)
        async for _run, index, delta in _prepend(first, events):
            if index >= request.n:  # beam search: only the best n beams are returned
                continue
            reply = run.replies[index]
            content, pieces = reply.push(delta.text)
            finish_reason = delta.finish_reason
            if delta.finished:
                more_content, more_pieces = reply.finish()
                content, pieces = content + more_content, pieces + more_pieces
                if reply.num_calls and finish_reason == "stop":
                    finish_reason = reply.finish_reason_with_calls
            if not content and not pieces and not delta.finished and not (request.logprobs and delta.token_ids):
                continue
            logprobs = None
            if request.logprobs:
                num_top = request.top_logprobs or 0
                if request.logprob_token_ids is not None:
                    num_top = len(request.logprob_token_ids) + 1
                logprobs = chat_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, num_top, as_ids)
            yield chunk([P.ChatCompletionStreamChoice(
                index=index, delta=P.DeltaMessage(content=content or None, tool_calls=tool_deltas(pieces)),
                logprobs=logprobs, finish_reason=finish_reason, stop_reason=delta.stop_reason,
                token_ids=delta.token_ids if request.return_token_ids else None)])
        if request.stream_options is not None and request.stream_options.include_usage:
            yield chunk([], self._usage(runs))


def _chat_text_size(messages: Any) -> int:
    """Characters of the messages' text: a lower bound of the rendered prompt's length, known
    before rendering (``render_chat`` checks the messages' shape)."""
    size = 0
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            size += sum(len(part["text"]) for part in content
                        if isinstance(part, dict) and isinstance(part.get("text"), str))
    return size


async def _prepend(first: Optional[T], rest: AsyncIterator[T]) -> AsyncIterator[T]:
    if first is None:
        return
    yield first
    async for item in rest:
        yield item
