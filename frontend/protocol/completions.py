"""/v1/completions: the request and its response and stream chunk bodies."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import ConfigDict, Field, StrictInt, StrictStr, model_serializer, model_validator
from pydantic.json_schema import SkipJsonSchema

from frontend.protocol.common import Logprobs, ResponseModel, SamplingFields, UsageInfo, created_now, ranged


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}]})

    # A string, a list of strings, token IDs, or a list of token-ID lists.
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    # OpenAI's and vLLM's default; 0 only with echo (prompt scoring); maximum: max_model_len.
    max_tokens: Optional[int] = ranged(16, minimum=0)
    echo: bool = False
    logprobs: Optional[int] = ranged(minimum=-1)  # -1: the whole vocabulary; maximum: --max-logprobs
    suffix: SkipJsonSchema[Optional[str]] = None  # UNSUPPORTED_FIELDS
    prompt_embeds: SkipJsonSchema[Optional[Any]] = None  # UNSUPPORTED_FIELDS

    @model_validator(mode="before")
    @classmethod
    def _no_prompt_is_the_empty_prompt(cls, data: Any) -> Any:
        """A missing or null ``prompt`` is the empty prompt, and an empty ``prompt_embeds`` beside
        an empty prompt adds nothing: every form of "no prompt" then gets the one empty-prompt 400
        naming both fields (``frontend.serving.prompts``), as vLLM answers them all, instead of a
        type error. Non-empty ``prompt_embeds`` stay, to be refused as unsupported."""
        if not isinstance(data, dict):
            return data
        prompt = data.get("prompt")
        if not _holds_no_prompt(prompt):
            return data
        data = {**data, "prompt": "" if prompt is None else prompt}
        if data.get("prompt_embeds") in ("", []):
            del data["prompt_embeds"]
        return data


def _holds_no_prompt(prompt: Any) -> bool:
    """None, "", [], or a list of only empty prompts ([""], [[]])."""
    if prompt is None or prompt == "":
        return True
    return isinstance(prompt, list) and all(item == "" or item == [] for item in prompt)


class CompletionLogProbs(ResponseModel):
    """OpenAI's legacy logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(ResponseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None  # vLLM's: the stop token ID or string that ended it
    token_ids: Optional[list[int]] = None  # with return_token_ids
    prompt_logprobs: Logprobs = None
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=created_now)
    model: str
    choices: list[CompletionResponseChoice]
    service_tier: Optional[str] = None
    system_fingerprint: Optional[str] = None
    usage: UsageInfo
    kv_transfer_params: Optional[dict[str, Any]] = None


class CompletionStreamChoice(CompletionResponseChoice):
    """A chunk's choice: vLLM's chunk fields, null when unset (vLLM writes every one), and Tandem's
    ``prompt_logprobs`` (vLLM streams none) only in the chunk that carries them."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        data = handler(self)
        if data["prompt_logprobs"] is None:
            del data["prompt_logprobs"]
        return data


class CompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=created_now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: Optional[UsageInfo] = None
