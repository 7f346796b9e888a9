"""A request's text or chat -> the prompt's token IDs: bounded, and off the event loop when big.

Shared by every endpoint that takes a prompt (completions, chat, tokenize). A
text too long for any prompt to fit the context is refused before it is
tokenized; a big input is tokenized, rendered or decoded on a worker thread
(the tokenizers library releases the GIL), so one huge prompt never stalls the
others; a request's own chat template, where the operator allows them, renders
in ``frontend.template_sandbox``'s worker processes.
"""

from __future__ import annotations

import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar, Union

from transformers import PreTrainedTokenizerFast

from backend.types.errors import InvalidRequestError
from backend.types.limits import Limits
from backend.types.outputs import ModelInfo
from frontend.template_sandbox import sandbox_from_limits
from frontend.tokenizer import encode_prompt, prepare_chat, render_chat

T = TypeVar("T")

# Inputs longer than this (characters, or token IDs) are tokenized, rendered or decoded on a
# worker thread: the tokenizers library releases the GIL, so the event loop keeps serving.
_OFF_LOOP_MIN_SIZE = 4096


@dataclass
class Prompt:
    text: Optional[str]  # None when the client sent token IDs
    token_ids: list[int]


def _empty(param: str) -> str:
    """The error for an empty prompt: vLLM's words (naming prompt_embeds, which this server refuses)."""
    if param == "prompt":
        return ("Either prompt or prompt_embeds must be provided and non-empty (prompt_embeds are not "
                "supported by this server: give a non-empty prompt).")
    return f"{param} holds an empty input (no tokens)."


class PromptRenderer:
    """Turns request text into token IDs for one tokenizer and model, within ``limits``.

    Owns the tokenizer threads and, when ``limits`` allow request chat templates, the
    template sandbox's worker processes (``close()`` stops them).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, model_info: ModelInfo, limits: Limits) -> None:
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.limits = limits
        # No token covers more characters than the longest vocabulary entry (for byte-level and
        # SentencePiece BPE), so a longer text surely has more tokens than the context holds.
        # Twice that, for normalizers that merge characters.
        max_token_chars = max(map(len, tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = 2 * model_info.max_model_len * max(max_token_chars, 1)
        self._workers = ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="tandem-tokenize")
        # Request chat templates: None refuses them (vLLM's default); else they render in worker processes.
        self.template_sandbox = sandbox_from_limits(limits)
        if self.template_sandbox is not None:
            self.template_sandbox.start()

    def close(self) -> None:
        """Stop the chat template workers (if any); the tokenizer threads end with the process."""
        if self.template_sandbox is not None:
            self.template_sandbox.close()

    async def off_loop(self, size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``: inline for small inputs, on a worker thread for big ones."""
        if size < _OFF_LOOP_MIN_SIZE:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._workers, functools.partial(fn, *args, **kwargs))

    # ---- checks ----

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing it, a text too long for any prompt to fit the context."""
        if num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"The prompt ({num_chars} characters) is longer than any prompt this model takes: its maximum "
                f"context length is {self.model_info.max_model_len} tokens, which no text of more than "
                f"{self.max_prompt_chars} characters fits in. Please reduce the length of the input.", param=param)

    def check_chat_template(self, chat_template: Optional[str]) -> None:
        """A request's own chat template only where the operator allows them (vLLM's rule)."""
        if chat_template and self.template_sandbox is None:
            raise InvalidRequestError(
                "This server renders only the model's own chat template: a chat_template in the request is "
                "refused. An operator who trusts the clients can allow them with --trust-request-chat-template "
                "(they then render in a worker process, bounded in time and memory).", param="chat_template")

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.model_info.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"Token ID {bad} is out of vocabulary (size {vocab_size}).", param=param)

    # ---- text -> token IDs ----

    async def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        self.check_prompt_chars(len(text), param=param)
        return await self.off_loop(len(text), encode_prompt, self.tokenizer, text, add_special_tokens, param)

    async def render_and_encode_chat(self, messages: list, add_generation_prompt: bool,
                                     chat_template: Optional[str], continue_final_message: bool,
                                     template_kwargs: dict, add_special_tokens: bool = False) -> tuple[str, list[int]]:
        """The chat's prompt text and its token IDs (no special tokens added by default: the
        template has them). Its length is checked before rendering and before tokenizing.

        The model's template renders here (a big chat on a worker thread); a request's
        template (``chat_template``) in the sandbox's worker processes."""
        size = _chat_text_size(messages)
        self.check_prompt_chars(size, param="messages")
        if chat_template:
            self.check_chat_template(chat_template)
            job = await self.off_loop(size, prepare_chat, self.tokenizer, messages, add_generation_prompt,
                                      chat_template, continue_final_message, **template_kwargs)
            text = await self.template_sandbox.render(job)
        else:
            text = await self.off_loop(size, render_chat, self.tokenizer, messages, add_generation_prompt,
                                       None, continue_final_message, **template_kwargs)
        return text, await self.encode(text, add_special_tokens=add_special_tokens, param="messages")

    async def completion_prompts(self, prompt: Union[str, list], n: int, add_special_tokens: bool = True,
                                 param: str = "prompt") -> list[Prompt]:
        """The prompts of a completions ``prompt`` field (or another field of that shape, named by
        ``param``): a text, token IDs, or a list of either. Their count (times ``n``) and every
        text's length are checked before any is tokenized."""
        if isinstance(prompt, str):
            items: list = [prompt]
        elif not prompt:
            raise InvalidRequestError(_empty(param), param=param)
        elif isinstance(prompt[0], int):
            items = [prompt]  # one prompt of token IDs
        else:
            items = prompt
        self.limits.check_prompt_count(len(items), n)
        for item in items:  # every prompt's length before any is tokenized
            if isinstance(item, str):
                self.check_prompt_chars(len(item), param=param)
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append(Prompt(item, await self.encode(item, add_special_tokens, param=param)))
            else:
                self.check_token_ids(item, param=param)
                prompts.append(Prompt(None, list(item)))
            if not prompts[-1].token_ids:
                raise InvalidRequestError(_empty(param), param=param)
        return prompts

    def truncate(self, prompt: Prompt, keep: Optional[int], side: Optional[str] = None) -> Prompt:
        """truncate_prompt_tokens: ``keep`` tokens (-1: max_model_len); None: as it is. vLLM's
        truncation_side says which are dropped: "left" (or None) keeps the last ones, "right" the first."""
        if keep is None:
            return prompt
        if keep == -1:
            keep = self.model_info.max_model_len
        if keep < 1:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}.",
                                      param="truncate_prompt_tokens")
        if len(prompt.token_ids) <= keep:
            return prompt
        kept = prompt.token_ids[:keep] if side == "right" else prompt.token_ids[-keep:]
        return Prompt(None, kept)  # its text is now that of the tokens kept


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
