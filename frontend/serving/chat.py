"""/v1/chat/completions: messages in, the assistant's reply out (text and tool calls), JSON or SSE.

The chat template renders the messages (``frontend.serving.prompts``); tools
reach the template, or are described in the messages when it has no tool
support (``frontend.tool_calls``). ``tool_choice`` "required" or a named
function constrains the reply to the calls' JSON schema; each sequence's text
is then split into content and tool calls as it streams.
"""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator, Optional, Union

from starlette.requests import Request
from starlette.responses import Response

from backend.types.errors import InvalidRequestError
from backend.types.sampling_params import StructuredOutputsParams
from frontend import protocol as P
from frontend.serving.base import EngineRun, Event, OpenAIServing, prepend, unless_disconnected, usage_in_stream
from frontend.serving.logprobs import chat_logprobs, chat_logprobs_dict, prompt_logprobs_json
from frontend.serving.prompts import Prompt
from frontend.serving.sampling import max_tokens_for, sampling_params
from frontend.serving.sse import ChunkFrames, json_or_null, json_text, sse_event
from frontend.tool_calls import check_tools, constrained_tool_schema, messages_for_template, template_supports_tools
from frontend.tool_reply import ToolReply, merge_tool_deltas


class OpenAIServingChat(OpenAIServing):
    """The chat endpoint; tool calls in the format of the context's ``tool_call_parser``."""

    async def create_chat_completion(self, request: P.ChatCompletionRequest, raw_request: Request, *,
                                     prompt_tokens_details: Optional[bool] = None) -> Response:
        """The reply (JSON, or SSE with ``stream``). ``prompt_tokens_details``: whether usage carries
        the cached prompt tokens (None: as the server is set; /v1/responses and /v1/messages, whose
        schemas report them always, ask for them)."""
        self._check_request(request)
        self.renderer.check_chat_template(request.chat_template)
        if request.top_logprobs and request.top_logprobs >= -1 and not request.logprobs:
            raise InvalidRequestError("When using `top_logprobs`, `logprobs` must be set to true.",
                                      param="top_logprobs")
        # vLLM's -1: the whole vocabulary (within --max-logprobs).
        vocab_size = self.model_info.vocab_size
        top_logprobs = self.limits.logprobs_count("top_logprobs", request.top_logprobs, vocab_size)
        prompt_logprobs = self.limits.logprobs_count("prompt_logprobs", request.prompt_logprobs, vocab_size)
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
        text, token_ids = await self.renderer.render_and_encode_chat(
            messages, request.add_generation_prompt, request.chat_template, request.continue_final_message,
            {**(request.chat_template_kwargs or {}), "tools": request.tools if supports_tools else None},
            add_special_tokens=bool(request.add_special_tokens))
        prompt = self.renderer.truncate(Prompt(text, token_ids), request.truncate_prompt_tokens,
                                        request.truncation_side)
        # vLLM: max_completion_tokens wins; neither given means all the room left.
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        max_tokens = max_tokens_for(requested, len(prompt.token_ids), default=None, prompt_param="messages",
                                    max_model_len=self.model_info.max_model_len)
        logprobs = (top_logprobs or 0) if request.logprobs and request.logprob_token_ids is None else None
        params = sampling_params(request, max_tokens, logprobs, prompt_logprobs, constraint, self.limits)
        base_id = f"chatcmpl-{request.request_id or uuid.uuid4().hex}"
        run = EngineRun(base_id, prompt, params, self.tokenizer, first_choice=0, deadline=self._deadline(),
                        cache_salt=request.cache_salt)
        run.replies = [ToolReply(tool_mode, self.context.tool_call_parser, named) for _ in range(params.n)]
        role = "assistant" if request.add_generation_prompt else str(request.messages[-1].get("role", "assistant"))
        run.role = role
        last = request.messages[-1] if request.messages else {}
        run.echo_text = str(last.get("content") or "") if request.echo and last.get("role") == role else ""
        runs = [run]
        details = prompt_tokens_details  # None: as the server is set (resolved by _usage)
        if request.stream:
            return await self._stream(raw_request, runs, lambda first, events: self._chat_chunks(
                request, base_id, runs, first, events, details))
        await unless_disconnected(raw_request, self._collect(runs))
        return self._json(self._chat_response(request, base_id, runs, details))

    def _chat_response(self, request: P.ChatCompletionRequest, base_id: str,
                       runs: list[EngineRun], details: Optional[bool]) -> P.ChatCompletionResponse:
        (run,) = runs
        choices = []
        as_ids = request.return_tokens_as_token_ids
        num_top = _num_top(request, run)
        for rank, seq in enumerate(self._chosen(request, run, run.builder.build().outputs)):
            logprobs = None
            if request.logprobs:
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
            id=base_id, model=self.model_name, choices=choices, usage=self._usage(runs, details=details),
            prompt_logprobs=prompt_logprobs_json(run.builder.prompt_logprobs)
            if request.prompt_logprobs is not None else None,
            prompt_token_ids=run.prompt.token_ids if request.return_token_ids else None)

    async def _chat_chunks(self, request: P.ChatCompletionRequest, base_id: str, runs: list[EngineRun],
                           first: Optional[Event], events: AsyncIterator[Event], details: Optional[bool]) -> AsyncIterator[str]:
        (run,) = runs
        created = int(time.time())
        as_ids = request.return_tokens_as_token_ids
        include_usage, continuous = usage_in_stream(request.stream_options)
        num_top = _num_top(request, run)
        frames = ChunkFrames({"id": base_id, "object": "chat.completion.chunk", "created": created,
                              "model": self.model_name}, "")  # no usage, no prompt_token_ids: left out

        def chunk(choices: list[P.ChatCompletionStreamChoice], usage: Optional[P.UsageInfo] = None,
                  prompt_token_ids: Optional[list[int]] = None) -> str:
            if usage is None and continuous and choices:
                usage = self._usage(runs, details=details)
            return sse_event(P.ChatCompletionStreamResponse(id=base_id, created=created, model=self.model_name,
                                                            choices=choices, usage=usage,
                                                            prompt_token_ids=prompt_token_ids))

        def tool_deltas(pieces) -> Optional[list[P.DeltaToolCall]]:
            if not pieces:
                return None
            # One entry per call: the openai SDK's stream() keeps only the first of two with one index.
            return [P.DeltaToolCall(index=i, id=call_id, type="function" if call_id else None,
                                    function=P.FunctionCall(name=name, arguments=arguments))
                    for i, call_id, name, arguments in merge_tool_deltas(pieces)]

        # OpenAI's first chunk of each choice carries the role (and vLLM's echo), and no tokens yet;
        # its content is "" (vLLM's), or null where the reply can only be tool calls (as OpenAI's).
        role_usage = self._usage(runs, count_completion=False, details=details) if continuous else None
        calls_only = run.replies[0].mode in ("required", "named") and not run.echo_text
        for index in range(request.n):
            yield chunk([P.ChatCompletionStreamChoice(index=index, delta=P.DeltaMessage(
                role=run.role, content=None if calls_only else run.echo_text))], role_usage,
                prompt_token_ids=run.prompt.token_ids if request.return_token_ids and index == 0 else None)
        async for _run, index, delta in prepend(first, events):
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
            # A token that adds no text yet (held back by the detokenizer, a stop string's prefix or
            # the tool parser) still gets a chunk when its ID or logprobs are asked for, as in vLLM.
            if (not content and not pieces and not delta.finished
                    and not ((request.logprobs or request.return_token_ids) and delta.token_ids)):
                continue
            token_ids = delta.token_ids if request.return_token_ids else None
            if not pieces and not continuous:  # the common chunk: no model objects (frontend.serving.sse)
                logprobs_json = "null"
                if request.logprobs:
                    logprobs_json = json_text(chat_logprobs_dict(self.tokenizer, delta.token_ids, delta.logprobs,
                                                                 num_top, as_ids))
                yield frames.frame(_choice_json(index, content, logprobs_json, finish_reason, delta.stop_reason,
                                                token_ids))
                continue
            logprobs = None
            if request.logprobs:
                logprobs = chat_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, num_top, as_ids)
            delta_message = P.DeltaMessage(tool_calls=tool_deltas(pieces))
            if content:  # left out, not null, when there is none
                delta_message.content = content
            yield chunk([P.ChatCompletionStreamChoice(
                index=index, delta=delta_message,
                logprobs=logprobs, finish_reason=finish_reason, stop_reason=delta.stop_reason,
                token_ids=token_ids)])
        if include_usage:
            yield chunk([], self._usage(runs, details=details))


def _num_top(request: P.ChatCompletionRequest, run: EngineRun) -> int:
    """Alternatives listed per token: top_logprobs (resolved: -1 is the vocabulary), or every token
    of logprob_token_ids and the chosen one."""
    if request.logprob_token_ids is not None:
        return len(request.logprob_token_ids) + 1
    return run.params.logprobs or 0


def _choice_json(index: int, content: str, logprobs_json: str, finish_reason: Optional[str],
                 stop_reason: Union[int, str, None], token_ids: Optional[list[int]]) -> str:
    """A ``P.ChatCompletionStreamChoice`` whose delta holds only content (or nothing), as JSON: its
    unset keys left out as the model leaves them out (stop_reason before the finish, token_ids)."""
    delta = f'{{"content":{json_text(content)}}}' if content else "{}"  # the model leaves out an empty one
    text = f'{{"index":{index},"delta":{delta},"logprobs":{logprobs_json},"finish_reason":{json_or_null(finish_reason)}'
    if finish_reason is not None or stop_reason is not None:
        text += f',"stop_reason":{json_or_null(stop_reason)}'
    if token_ids is not None:
        text += f',"token_ids":{json_text(token_ids)}'
    return text + "}"
