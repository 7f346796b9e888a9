"""Offline inference: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

The same frontend-side processing as the HTTP server (tokenizer, detokenizer,
stop strings; ``frontend.outputs``) against an in-process ``AsyncLLMEngine``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Optional, Sequence, Union

from backend.types.config import EngineConfig
from backend.types.limits import Limits
from backend.types.errors import InvalidRequestError
from backend.types.sampling_params import SamplingParams
from backend.types.startup_log import log_phase
from frontend.outputs import RequestOutput, RequestOutputBuilder
from frontend.tokenizer import encode_prompt, load_tokenizer, render_chat

# A prompt: text, token IDs, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": ...}.
PromptType = Union[str, list[int], dict]

logger = logging.getLogger(__name__)
# The loggers whose INFO lines a start shows (the start-up phases: backend/types/startup_log.py).
STARTUP_LOGGERS = ("backend", "tandem_kernels", "frontend")


class LLM:
    """An engine in this process, for batch generation.

    Keyword arguments are ``EngineConfig`` fields (the same names as the
    ``tandem`` command line's flags): ``dtype``, ``seed``, ``max_model_len``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``,
    ``enable_prefix_caching``, ``enforce_eager``, ``kv_cache_memory_gb``, ...
    ``model=None`` serves the default model (SmolLM2-135M-Instruct). ``max_logprobs`` (vLLM's):
    the most logprobs a request may ask per position; -1 lets it ask for the whole vocabulary
    (``logprobs=-1``, ``prompt_logprobs=-1``).

    The start prints one line per phase on stderr (model, kernels, weights, KV cache, graphs,
    ready), unless the program has set up logging itself (then they are INFO records of the
    ``backend`` loggers, shown or not as it decides).
    """

    def __init__(self, model: Optional[str] = None, tokenizer: Optional[str] = None, max_logprobs: int = 20,
                 **kwargs: Any) -> None:
        start = time.monotonic()
        with startup_progress_shown():
            from backend.engine.async_llm_engine import AsyncLLMEngine  # torch lives behind this import

            config = EngineConfig.from_kwargs(model=model, tokenizer=tokenizer, **kwargs)
            self.engine = AsyncLLMEngine(config, Limits(max_logprobs=max_logprobs))
            self.model_info = self.engine.engine.model_info()
            self.tokenizer = load_tokenizer(self.model_info.tokenizer_path)
            self._ids = itertools.count()
            log_phase(logger, "ready", f"LLM({self.model_info.model_name})", time.monotonic() - start)

    def get_tokenizer(self):
        return self.tokenizer

    # ---- public API -------------------------------------------------------------------

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; results come back in the prompts' order.

        Every prompt is checked before any runs: bad input raises
        ``InvalidRequestError`` naming the prompt and the problem.
        """
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        items = [self._tokenize(p, i) for i, p in enumerate(prompts)]
        return self._run(items, sampling_params, use_tqdm)

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             **template_kwargs: Any) -> list[RequestOutput]:
        """Render each conversation with the chat template, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        items = []
        for conversation in conversations:
            text = render_chat(self.tokenizer, conversation, add_generation_prompt, chat_template,
                               continue_final_message, **template_kwargs)
            items.append((text, encode_prompt(self.tokenizer, text, add_special_tokens=False)))
        return self._run(items, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ---- internals ----------------------------------------------------------------------

    def _tokenize(self, prompt: PromptType, position: int) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError(
                    f"Prompt {position} is a dict without 'prompt' or 'prompt_token_ids'.", param="prompt")
        if isinstance(prompt, str):
            return prompt, encode_prompt(self.tokenizer, prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, prompt
        raise InvalidRequestError(f"Prompt {position} must be a string or a list of token IDs, "
                                  f"got {type(prompt).__name__}.", param="prompt")

    def _run(self, items: list[tuple[Optional[str], list[int]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None],
             use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise InvalidRequestError(
                    f"Got {len(params_list)} sampling params for {len(items)} prompts.",
                    param="sampling_params")
        for i, ((_, token_ids), params) in enumerate(zip(items, params_list)):
            try:
                self.engine.engine.validate(token_ids, params)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"Prompt {i}: {e.message}", param=e.param) from None
        return _run_to_completion(self._generate_all(items, params_list, use_tqdm))

    async def _generate_all(self, items, params_list, use_tqdm: bool) -> list[RequestOutput]:
        progress = None
        if use_tqdm and items:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(items), desc="Processed prompts", dynamic_ncols=True)

        async def one(prompt: Optional[str], token_ids: list[int], params: SamplingParams) -> RequestOutput:
            request_id = str(next(self._ids))
            builder = RequestOutputBuilder(self.tokenizer, request_id, prompt, token_ids, params)
            stream = self.engine.generate(request_id, token_ids, params)
            try:
                async for delta in stream:
                    builder.add(delta)
                    if builder.finished:  # stop strings can end it before the engine does
                        break
            finally:
                await stream.aclose()
            if progress is not None:
                progress.update(1)
            return builder.build()

        try:
            return list(await asyncio.gather(*(one(p, ids, sp) for (p, ids), sp in zip(items, params_list))))
        finally:
            if progress is not None:
                progress.close()


@contextlib.contextmanager
def startup_progress_shown() -> Iterator[None]:
    """While the engine starts, show Tandem's INFO lines on stderr, when the program has configured
    no logging (Python would print only warnings); a program that has keeps its own choice."""
    if logging.getLogger().handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in STARTUP_LOGGERS]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.addHandler(handler)
        if log.getEffectiveLevel() > logging.INFO:
            log.setLevel(logging.INFO)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.removeHandler(handler)
            log.setLevel(level)


def _run_to_completion(coroutine):
    """asyncio.run, also from code already inside an event loop (e.g. a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
