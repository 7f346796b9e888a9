"""Request and response bodies of the OpenAI-compatible HTTP API (data only, no behaviour).

Field names, types and defaults mirror OpenAI's API plus vLLM's extra sampling
fields. Unknown request fields are ignored, as vLLM does. Value ranges are not
checked here: ``SamplingParams`` checks them and names the parameter, so the
HTTP server and the offline ``LLM`` reject the same values with the same words.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_serializer


def _now() -> int:
    return int(time.time())


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- shared pieces -----------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Sampling fields both generation endpoints take; None means the engine default."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # vLLM's extras.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Prefix-cache isolation: only requests with the same salt share cached prompt blocks.
    cache_salt: Optional[str] = None


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class ErrorInfo(_Response):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[int] = None


class ErrorResponse(_Response):
    error: ErrorInfo


# ---- /v1/completions ---------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    # A string, a list of strings, token IDs, or a list of token-ID lists.
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    max_tokens: Optional[int] = 16  # OpenAI's and vLLM's default for completions
    echo: bool = False
    logprobs: Optional[int] = None


class CompletionLogProbs(_Response):
    """OpenAI's legacy logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None  # vLLM's: the stop token ID or string that ended it


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: Optional[UsageInfo] = None


# ---- /v1/chat/completions ----------------------------------------------------------------------


class ChatCompletionRequest(SamplingFields):
    # Passed to the chat template as they are (frontend.tokenizer.render_chat checks them).
    messages: list[dict[str, Any]]
    max_tokens: Optional[int] = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    # vLLM's chat-template extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class ChatMessage(_Response):
    role: str
    content: Optional[str] = None


class DeltaMessage(_Response):
    """A streamed piece of the assistant's message; absent fields are left out (``{}`` at the end)."""

    role: Optional[str] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionTopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatCompletionLogprobContent(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[ChatCompletionTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(_Response):
    content: Optional[list[ChatCompletionLogprobContent]] = None


class ChatCompletionResponseChoice(_Response):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# ---- /v1/models, /tokenize, /detokenize, /version ----------------------------------------------


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tandem"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """vLLM's two shapes in one: ``prompt`` (text) or ``messages`` (a chat), not both."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    # None: True for a prompt, False for messages (the chat template adds them), as vLLM.
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[StrictInt]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str
