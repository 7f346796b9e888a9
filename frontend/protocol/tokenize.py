"""/tokenize, /detokenize and /tokenizer_info (vLLM's): the request and response bodies."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, StrictInt

from frontend.protocol.common import RequestModel, ResponseModel


class TokenizeRequest(RequestModel):
    """vLLM's two shapes in one: ``prompt`` (text) or ``messages`` (a chat), not both."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    # None: True for a prompt, False for messages (the chat template adds them), as vLLM.
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    return_token_strs: bool = False


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class TokenizerInfoResponse(BaseModel):
    """vLLM's /tokenizer_info: the tokenizer's configuration (tokenizer_config.json and a few more)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


class DetokenizeRequest(RequestModel):
    model: Optional[str] = None
    tokens: list[StrictInt]


class DetokenizeResponse(ResponseModel):
    prompt: str
