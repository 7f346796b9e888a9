"""Shared request handling: what every endpoint's serving class is built on.

``ServingContext``: what the endpoints of one app share (the engine client, the
tokenizer, the model's info, the limits, the prompt renderer, the count of
generation requests in flight). ``OpenAIServing``: the base of every endpoint's
class, with the engine call and the shapes of its answer:

1. One engine request per prompt (``EngineRun``; ``<id>-<i>`` for the i-th
   prompt of a completions list); its deltas become text in
   ``frontend.outputs`` (detokenization, stop strings), the one place that
   happens. The runs' streams are merged as deltas arrive (``merge_streams``); a
   lone run's stream is iterated directly (no task and queue between it and the writer).
2. Non-streaming: collect, answer JSON. Streaming: wait for the first delta
   (so errors the engine raises up front, bad input or a full queue, still get
   their HTTP status), then stream SSE chunks (``frontend.serving.sse``); an
   error after that is sent as ``data: {"error": ...}`` followed by
   ``data: [DONE]``.

However a request ends early (all sequences stopped by stop strings, the
client went away, an error), its engine streams are closed, which aborts them
in the engine (the ``EngineClient`` contract) and frees their KV blocks. Errors
become HTTP answers in ``frontend.serving.errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import AsyncIterator, Awaitable, Callable, Optional, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from transformers import PreTrainedTokenizerFast

from backend.types.errors import InvalidRequestError, ModelNotFoundError
from backend.types.limits import Limits
from backend.types.outputs import ModelInfo
from backend.types.sampling_params import SamplingParams
from frontend import protocol as P
from frontend.engine_client import EngineClient
from frontend.outputs import RequestOutputBuilder, TextDelta
from frontend.serving import sse
from frontend.serving.errors import ClientDisconnectedError, error_of_exception
from frontend.serving.guided import fold_legacy_guided
from frontend.serving.prompts import Prompt, PromptRenderer
from frontend.tool_calls import choose_parser
from frontend.tool_reply import ToolReply

T = TypeVar("T")


class ServingContext:
    """What the endpoints of one app share.

    ``tool_call_parser``: the format of tool calls in the model's replies
    (``frontend.tool_calls``; "auto" picks it from the chat template).
    ``enable_prompt_tokens_details`` (vLLM's ``--enable-prompt-tokens-details``): chat and
    completions usage carries ``prompt_tokens_details.cached_tokens``. ``close()`` stops the chat
    template workers the renderer may have started.
    """

    def __init__(self, engine_client: EngineClient, tokenizer: PreTrainedTokenizerFast, model_info: ModelInfo,
                 limits: Optional[Limits] = None, tool_call_parser: str = "auto",
                 enable_prompt_tokens_details: bool = False) -> None:
        self.engine_client = engine_client
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.limits = limits or Limits()
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.tool_call_parser = choose_parser(tool_call_parser, tokenizer.chat_template)  # before workers start
        self.renderer = PromptRenderer(tokenizer, model_info, self.limits)
        self.num_in_flight = 0  # generation requests being answered (/load)

    def close(self) -> None:
        self.renderer.close()


# ---- one engine request ----------------------------------------------------------------------


class EngineRun:
    """One engine request (one prompt, ``n`` sequences) and the builder of its text."""

    def __init__(self, request_id: str, prompt: Prompt, params: SamplingParams,
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

    async def deltas(self, client: EngineClient) -> AsyncIterator["Event"]:
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
Event = tuple[EngineRun, int, TextDelta]


async def merge_streams(iterators: list[AsyncIterator[T]]) -> AsyncIterator[T]:
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


async def prepend(first: Optional[T], rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """``first`` then the rest; nothing when ``first`` is None (the stream ended at once)."""
    if first is None:
        return
    yield first
    async for item in rest:
        yield item


async def _wait_for_disconnect(raw_request: Request) -> None:
    # The body has been read: the next message is the disconnect (or none, until the response ends).
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(raw_request: Request, awaitable: Awaitable[T]) -> T:
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


@functools.lru_cache(maxsize=None)
def _unsupported_fields(model: type) -> tuple[tuple[str, str], ...]:
    """``UNSUPPORTED_FIELDS``' (name, reason) pairs that ``model`` has, in their order: a request
    of that model reads None for the others (a lookup that misses costs an AttributeError)."""
    fields = getattr(model, "model_fields", None)  # None: not a pydantic model, every name is looked up
    return tuple((name, reason) for name, reason in P.UNSUPPORTED_FIELDS.items()
                 if fields is None or name in fields or hasattr(model, name))


def usage_in_stream(options: Optional[P.StreamOptions]) -> tuple[bool, bool]:
    """(a usage chunk ends the stream, every chunk carries usage): vLLM's reading of
    ``stream_options``, where ``continuous_usage_stats`` takes effect only with ``include_usage``."""
    include = options is not None and options.include_usage
    return include, include and options.continuous_usage_stats


# ---- the base of every endpoint ---------------------------------------------------------------


class OpenAIServing:
    """The base of the endpoints' classes: the shared context, the checks every request meets,
    the engine call (collected or streamed as SSE) and the usage it reports."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context
        self.engine_client = context.engine_client
        self.tokenizer = context.tokenizer
        self.model_info = context.model_info
        self.limits = context.limits
        self.renderer = context.renderer

    @property
    def model_name(self) -> str:
        return self.model_info.model_name

    # ---- checks ----

    def _check_model(self, name: Optional[str]) -> None:
        if name and name != self.model_name:  # omitted or empty: the served model, as vLLM
            raise ModelNotFoundError(f"The model `{name}` does not exist.")

    def _check_request(self, request: P.SamplingFields) -> None:
        """The checks every generation endpoint shares, before any work."""
        self._check_model(request.model)
        for name, reason in _unsupported_fields(type(request)):
            value = getattr(request, name, None)
            if value is not None and not (name == "priority" and value == 0):
                raise InvalidRequestError(f"{reason}; leave `{name}` out.", param=name)
        if request.stream_options is not None and not request.stream:
            raise InvalidRequestError("stream_options can only be set with stream=true.", param="stream_options")
        fold_legacy_guided(request)  # guided_json etc. -> structured_outputs
        if request.response_format is not None and request.structured_outputs is not None:
            raise InvalidRequestError("Give response_format or structured_outputs, not both.",
                                      param="response_format")
        if request.stop_token_ids:
            self.renderer.check_token_ids(request.stop_token_ids, param="stop_token_ids")
        if request.logprob_token_ids:
            self.renderer.check_token_ids(request.logprob_token_ids, param="logprob_token_ids")
        if request.best_of is not None:
            if request.best_of < request.n:
                raise InvalidRequestError(f"best_of must be at least n={request.n}, got {request.best_of}.",
                                          param="best_of")
            if request.stream and request.best_of > request.n and not request.use_beam_search:
                raise InvalidRequestError("best_of > n cannot be streamed.", param="best_of")

    def _deadline(self) -> float:
        return time.monotonic() + self.limits.request_timeout_s

    # ---- engine -> response ----

    def _events(self, runs: list[EngineRun]) -> AsyncIterator[Event]:
        """The runs' events. Iterate it only in a plain asyncio task (``unless_disconnected``'s,
        ``sse.SSEResponse``'s), never inside an anyio cancel scope: a lone run's cleanup (aborting
        it in the engine) runs where it is iterated and may await."""
        if len(runs) == 1:
            return runs[0].deltas(self.engine_client)
        return merge_streams([run.deltas(self.engine_client) for run in runs])

    async def _collect(self, runs: list[EngineRun]) -> None:
        self.context.num_in_flight += 1
        try:
            async with contextlib.aclosing(self._events(runs)) as events:
                async for _ in events:
                    pass
        finally:
            self.context.num_in_flight -= 1

    async def _stream(self, raw_request: Request, runs: list[EngineRun],
                      chunks: Callable[[Optional[Event], AsyncIterator[Event]], AsyncIterator[str]]) -> Response:
        """Wait for the first delta (errors until then get their HTTP status), then stream SSE."""
        events = self._events(runs)
        self.context.num_in_flight += 1
        try:
            first = await unless_disconnected(raw_request, anext(events, None))
        except BaseException:
            self.context.num_in_flight -= 1
            await events.aclose()
            raise
        return sse.SSEResponse(self._sse_stream(chunks(first, events), events))

    async def _sse_stream(self, chunks: AsyncIterator[str], events: AsyncIterator) -> AsyncIterator[str]:
        """The chunks, an error chunk if one fails, then [DONE]. Closing it (the client went
        away: Starlette cancels it) closes the engine streams."""
        try:
            async with contextlib.aclosing(events):
                async for chunk in chunks:
                    yield chunk
        except Exception as error:  # noqa: BLE001 -- reported to the client in the stream
            _, body = error_of_exception(error)
            yield sse.sse_event(body)
        finally:
            self.context.num_in_flight -= 1
        yield sse.DONE

    def _usage(self, runs: list[EngineRun], count_completion: bool = True,
               details: Optional[bool] = None) -> P.UsageInfo:
        """The runs' token counts so far; ``count_completion`` False: none generated yet (a stream's
        role chunk, written before any text, reports 0 completion tokens as vLLM's does).
        ``details``: with the prompt tokens the prefix cache served (None: as the server is set)."""
        prompt_tokens = sum(len(run.prompt.token_ids) for run in runs)
        completion_tokens = sum(0 if run.echo_only else len(seq.token_ids)
                                for run in runs for seq in run.builder.sequences) if count_completion else 0
        if details is None:
            details = self.context.enable_prompt_tokens_details
        cached = P.PromptTokensDetails(cached_tokens=sum(run.builder.num_cached_tokens for run in runs)) \
            if details else None
        return P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=cached)

    @staticmethod
    def _json(response: BaseModel) -> JSONResponse:
        return JSONResponse(response.model_dump(mode="json"))

    @staticmethod
    def _chosen(request: P.SamplingFields, run: EngineRun, outputs: list) -> list:
        """The sequences to return: all, or with best_of the n most likely (beam search's come ranked)."""
        if request.best_of is None or request.best_of == request.n:
            return outputs
        if not request.use_beam_search:
            outputs = sorted(outputs, key=lambda seq: seq.cumulative_logprob or 0.0, reverse=True)
        return outputs[:request.n]
