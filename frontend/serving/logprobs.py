"""Logprobs in OpenAI's formats: the completions' legacy lists, the chat's per-token entries, and
vLLM's prompt_logprobs. OpenAI's JSON has no -inf, so every value is clamped as OpenAI and vLLM do."""

from __future__ import annotations

import math
from typing import Optional

from transformers import PreTrainedTokenizerFast

from backend.types.outputs import PositionLogprobs
from frontend import protocol as P
from frontend.tokenizer import decode_token

_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    # float(): a logprob is always written as a float (-9999.0, never -9999), as the models do.
    return _MIN_LOGPROB if math.isnan(logprob) else float(max(logprob, _MIN_LOGPROB))


def _token_text(tokenizer: PreTrainedTokenizerFast, token_id: int, position: Optional[PositionLogprobs],
                as_ids: bool = False) -> str:
    """A token's text in logprobs; ``as_ids`` (return_tokens_as_token_ids): ``token_id:<id>``."""
    if as_ids:
        return f"token_id:{token_id}"
    logprob = position.get(token_id) if position is not None else None
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode_token(tokenizer, token_id)


# The legacy and chat formats are built as plain dicts and lists, in the models' field order:
# a streamed chunk encodes them directly (``frontend.serving.sse.json_text``), a whole response
# validates them into its model.


def completion_logprobs_dict(tokenizer: PreTrainedTokenizerFast, token_ids: list[int],
                             positions: list[Optional[PositionLogprobs]], initial_offset: int,
                             as_ids: bool = False) -> dict:
    """OpenAI's legacy format (``P.CompletionLogProbs``' fields). ``top_logprobs`` holds the chosen
    token and the top-k, as vLLM's; a position without logprobs (the prompt's first token) has None."""
    text_offset: list[int] = []
    token_logprobs: list[Optional[float]] = []
    tokens: list[str] = []
    top_logprobs: list[Optional[dict[str, float]]] = []
    offset = initial_offset
    for token_id, position in zip(token_ids, positions):
        token = _token_text(tokenizer, token_id, position, as_ids)
        if position is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            token_logprobs.append(_finite(position[token_id].logprob))
            top_logprobs.append({_token_text(tokenizer, tid, position, as_ids): _finite(lp.logprob)
                                 for tid, lp in position.items()})
        tokens.append(token)
        text_offset.append(offset)
        offset += len(token)
    return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs}


def completion_logprobs(tokenizer: PreTrainedTokenizerFast, token_ids: list[int],
                        positions: list[Optional[PositionLogprobs]], initial_offset: int,
                        as_ids: bool = False) -> P.CompletionLogProbs:
    """``completion_logprobs_dict`` as its model."""
    return P.CompletionLogProbs.model_validate(
        completion_logprobs_dict(tokenizer, token_ids, positions, initial_offset, as_ids))


def chat_logprobs_dict(tokenizer: PreTrainedTokenizerFast, token_ids: list[int],
                       positions: list[PositionLogprobs], num_top: int, as_ids: bool = False) -> dict:
    """OpenAI's chat format (``P.ChatCompletionLogProbs``' fields): each token with its ``num_top``
    most likely alternatives."""
    content = []
    for token_id, position in zip(token_ids, positions):
        token = _token_text(tokenizer, token_id, position, as_ids)
        ranked = sorted(position.items(), key=lambda item: (-item[1].logprob, item[0]))[:num_top]
        top = []
        for tid, lp in ranked:
            text = _token_text(tokenizer, tid, position, as_ids)
            top.append({"token": text, "logprob": _finite(lp.logprob), "bytes": list(text.encode())})
        content.append({"token": token, "logprob": _finite(position[token_id].logprob),
                        "bytes": list(token.encode()), "top_logprobs": top})
    return {"content": content}


def chat_logprobs(tokenizer: PreTrainedTokenizerFast, token_ids: list[int],
                  positions: list[PositionLogprobs], num_top: int, as_ids: bool = False) -> P.ChatCompletionLogProbs:
    """``chat_logprobs_dict`` as its model."""
    return P.ChatCompletionLogProbs.model_validate(chat_logprobs_dict(tokenizer, token_ids, positions, num_top,
                                                                      as_ids))


def prompt_logprobs_json(positions: Optional[list]) -> P.Logprobs:
    """vLLM's prompt_logprobs: per prompt position (the first is null) token ID -> logprob."""
    if positions is None:
        return None
    return [None if position is None else
            {token_id: P.PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
             for token_id, lp in position.items()} for position in positions]
