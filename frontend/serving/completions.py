"""/v1/completions: prompts (text or token IDs, one or many) in, completions out, JSON or SSE.

Each prompt is one engine request; the i-th prompt's choices are numbered from
``i * n``. ``echo`` puts the prompt before the text (with ``max_tokens=0`` only
the prompt, to score it: one token is generated and dropped), and its logprobs
before the completion's.
"""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import Response

from backend.types.errors import InvalidRequestError
from backend.types.outputs import PositionLogprobs
from frontend import protocol as P
from frontend.serving.base import EngineRun, Event, OpenAIServing, prepend, unless_disconnected, usage_in_stream
from frontend.serving.logprobs import completion_logprobs, completion_logprobs_dict, prompt_logprobs_json
from frontend.serving.sampling import max_tokens_for, sampling_params
from frontend.serving.sse import ChunkFrames, json_or_null, json_text, sse_event


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint (OpenAI's legacy text completions, with vLLM's extensions)."""

    async def create_completion(self, request: P.CompletionRequest, raw_request: Request) -> Response:
        self._check_request(request)
        if request.max_tokens == 0 and not request.echo:
            raise InvalidRequestError("max_tokens must be at least 1 (0 is only for echo, to score the prompt).",
                                      param="max_tokens")
        # vLLM's -1: the whole vocabulary (within --max-logprobs).
        vocab_size = self.model_info.vocab_size
        logprobs = self.limits.logprobs_count("logprobs", request.logprobs, vocab_size)
        prompt_logprobs = self.limits.logprobs_count("prompt_logprobs", request.prompt_logprobs, vocab_size)
        prompts = await self.renderer.completion_prompts(request.prompt, request.best_of or request.n,
                                                         request.add_special_tokens is not False)
        prompts = [self.renderer.truncate(prompt, request.truncate_prompt_tokens, request.truncation_side)
                   for prompt in prompts]
        # Omitted: OpenAI's and vLLM's 16, capped to the room left; explicit null: all the room left.
        explicit = "max_tokens" in request.model_fields_set
        if request.echo and logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = logprobs
        base_id = f"cmpl-{request.request_id or uuid.uuid4().hex}"
        deadline = self._deadline()
        runs = []
        for i, prompt in enumerate(prompts):
            requested = request.max_tokens if explicit else None
            if requested == 0:  # echo only: one token is generated and dropped (max_tokens is at least 1)
                requested = 1
            max_tokens = max_tokens_for(requested, len(prompt.token_ids),
                                        default=None if explicit else request.max_tokens, prompt_param="prompt",
                                        max_model_len=self.model_info.max_model_len)
            params = sampling_params(request, max_tokens, logprobs, prompt_logprobs, None, self.limits)
            run = EngineRun(f"{base_id}-{i}", prompt, params, self.tokenizer, first_choice=i * request.n,
                            deadline=deadline, cache_salt=request.cache_salt)
            run.echo_only = request.max_tokens == 0
            runs.append(run)
        if request.stream:
            return await self._stream(raw_request, runs, lambda first, events: self._completion_chunks(
                request, base_id, runs, first, events))
        await unless_disconnected(raw_request, self._collect(runs))
        return self._json(self._completion_response(request, base_id, runs))

    def _echo_text(self, run: EngineRun) -> str:
        prompt = run.prompt
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    def _echo_logprobs(self, run: EngineRun) -> list[Optional[PositionLogprobs]]:
        positions = run.builder.prompt_logprobs
        return list(positions) if positions is not None else [None] * len(run.prompt.token_ids)

    def _completion_response(self, request: P.CompletionRequest, base_id: str,
                             runs: list[EngineRun]) -> P.CompletionResponse:
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
                    prompt_logprobs=prompt_logprobs_json(run.builder.prompt_logprobs)
                    if request.prompt_logprobs is not None else None))
        return P.CompletionResponse(id=base_id, model=self.model_name, choices=choices, usage=self._usage(runs))

    async def _completion_chunks(self, request: P.CompletionRequest, base_id: str, runs: list[EngineRun],
                                 first: Optional[Event], events: AsyncIterator[Event]) -> AsyncIterator[str]:
        created = int(time.time())
        echoed: set[int] = set()
        streamed_chars: dict[int, int] = {}  # vLLM's text_offset base of each choice's next chunk
        as_ids = request.return_tokens_as_token_ids
        include_usage, continuous = usage_in_stream(request.stream_options)
        frames = ChunkFrames({"id": base_id, "object": "text_completion", "created": created,
                              "model": self.model_name}, '"usage":null')
        async for run, seq_index, delta in prepend(first, events):
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
            # A token that adds no text yet (held back by the detokenizer or a stop string's prefix)
            # still gets a chunk when its ID or logprobs are asked for, as in vLLM.
            if not text and not delta.finished and not ((positions or request.return_token_ids) and token_ids):
                continue
            wants_logprobs = request.logprobs is not None or request.logprob_token_ids is not None
            offset = streamed_chars.get(choice, 0)
            streamed_chars[choice] = offset + len(text)
            stop_reason = None if run.echo_only else delta.stop_reason
            chunk_token_ids = ((delta.token_ids if not run.echo_only else []) if request.return_token_ids
                               else None)
            first_extras = first_of_choice and (request.return_token_ids or request.prompt_logprobs is not None)
            if not continuous and not first_extras:  # the common chunk: no model objects (frontend.serving.sse)
                logprobs_json = "null"
                if wants_logprobs:
                    logprobs_json = json_text(completion_logprobs_dict(self.tokenizer, token_ids, positions, offset,
                                                                       as_ids))
                yield frames.frame(
                    f'{{"index":{choice},"text":{json_text(text)},"logprobs":{logprobs_json},'
                    f'"finish_reason":{json_or_null(finish_reason)},"stop_reason":{json_or_null(stop_reason)},'
                    f'"token_ids":{json_or_null(chunk_token_ids)},"prompt_token_ids":null}}')
                continue
            logprobs = None
            if wants_logprobs:
                logprobs = completion_logprobs(self.tokenizer, token_ids, positions, offset, as_ids)
            yield sse_event(P.CompletionStreamResponse(
                id=base_id, created=created, model=self.model_name,
                choices=[P.CompletionStreamChoice(
                    index=choice, text=text, logprobs=logprobs, finish_reason=finish_reason,
                    stop_reason=stop_reason, token_ids=chunk_token_ids,
                    prompt_token_ids=run.prompt.token_ids if request.return_token_ids and first_of_choice else None,
                    prompt_logprobs=prompt_logprobs_json(run.builder.prompt_logprobs)
                    if request.prompt_logprobs is not None and first_of_choice else None)],
                usage=self._usage(runs) if continuous else None))
        if include_usage:
            yield sse_event(P.CompletionStreamResponse(id=base_id, created=created, model=self.model_name,
                                                       choices=[], usage=self._usage(runs)))
