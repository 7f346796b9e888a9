"""A generation request's fields -> the engine's ``SamplingParams``.

Shared by every generation endpoint: the room a prompt leaves for max_tokens
(with vLLM's errors), OpenAI's response_format and vLLM's structured_outputs as
the engine's constraint, best_of, beam search and the sampling fields whose
None means the engine's default. ``SamplingParams`` checks every value and
names the parameter; ``Limits`` then checks the request's bounds.
"""

from __future__ import annotations

from typing import Any, Optional

from backend.types.errors import InvalidRequestError
from backend.types.limits import Limits
from backend.types.sampling_params import SamplingParams, StructuredOutputsParams
from frontend import protocol as P

# Request fields whose None means the engine's default (left out of SamplingParams' arguments).
_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                      "frequency_penalty", "repetition_penalty")


def max_tokens_for(requested: Optional[int], prompt_len: int, default: Optional[int], prompt_param: str,
                   max_model_len: int) -> int:
    """The max_tokens to send: ``requested`` if it fits (vLLM's errors if not), else the
    ``default`` (None: all the room left) capped to the room left."""
    limit = max_model_len
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


def structured_outputs(request: P.SamplingFields) -> Optional[StructuredOutputsParams]:
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


def logit_bias(request: P.SamplingFields, limits: Limits) -> Optional[dict[int, float]]:
    """OpenAI's logit_bias (token IDs as strings) with integer keys; its size bounded first."""
    if not request.logit_bias:
        return None
    if len(request.logit_bias) > limits.max_logit_bias:
        raise InvalidRequestError(f"logit_bias has {len(request.logit_bias)} tokens; at most "
                                  f"{limits.max_logit_bias} are allowed (--max-logit-bias).", param="logit_bias")
    biases: dict[int, float] = {}
    for key, bias in request.logit_bias.items():
        try:
            biases[int(key)] = bias
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token IDs, got {key!r}.", param="logit_bias") from None
    return biases


def sampling_params(request: P.SamplingFields, max_tokens: int, logprobs: Optional[int],
                    prompt_logprobs: Optional[int], constraint: Optional[StructuredOutputsParams],
                    limits: Limits) -> SamplingParams:
    """The request's ``SamplingParams``. ``logprobs`` and ``prompt_logprobs`` are counts, a -1 (the
    whole vocabulary) already resolved by ``Limits.logprobs_count``. ``constraint`` (e.g. a tool
    call's schema) replaces the request's own structured outputs; with best_of, best_of sequences
    run (the endpoint returns the n most likely)."""
    if constraint is None:
        constraint = structured_outputs(request)
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
        use_beam_search=request.use_beam_search, length_penalty=request.length_penalty,
        logit_bias=logit_bias(request, limits))
    for name in _SAMPLING_DEFAULTS:  # None: the engine's default
        value = getattr(request, name)
        if value is not None:
            fields[name] = value
    if request.use_beam_search:
        fields.pop("temperature", None)  # beams are ranked by raw logprobs: temperature changes nothing
    params = SamplingParams(**fields)  # checks every value, naming the parameter
    limits.check_sampling_params(params, None)  # logprobs counts come resolved (``Limits.logprobs_count``)
    limits.check_cache_salt(request.cache_salt)
    return params
