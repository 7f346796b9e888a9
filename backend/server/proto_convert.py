"""EngineService's messages <-> the engine's types (the backend side; the frontend's is
``frontend.grpc_client``)."""

from __future__ import annotations

from typing import Optional

from backend.types.errors import InvalidRequestError
from backend.types.outputs import EngineOutput, FinishReason, Logprob, PositionLogprobs
from backend.types.pooling import PoolingParams
from backend.types.sampling_params import SamplingParams, StructuredOutputsParams
from protos.tandem.engine.v1 import engine_pb2

_FINISH_REASON_TO_PROTO = {
    None: engine_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: engine_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: engine_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: engine_pb2.FINISH_REASON_ABORT,
}


def sampling_params_from_proto(message: engine_pb2.SamplingParams) -> SamplingParams:
    """Proto -> SamplingParams (same field names); validation errors name the field.

    An unset ``optional`` field takes SamplingParams' default, except
    max_tokens: unset means no limit but max_model_len (the proto's contract).
    """
    kwargs: dict[str, object] = {"max_tokens": None}
    for field in message.DESCRIPTOR.fields:
        if field.has_presence and not message.HasField(field.name):
            continue
        value = getattr(message, field.name)
        kwargs[field.name] = list(value) if field.is_repeated else value
    kwargs["logprob_token_ids"] = kwargs["logprob_token_ids"] or None  # empty: off
    kwargs["logit_bias"] = dict(message.logit_bias) or None  # a map (its entries read as keys above)
    if "structured_outputs" in kwargs:
        kwargs["structured_outputs"] = structured_outputs_from_proto(message.structured_outputs)
    return SamplingParams(**kwargs)


def structured_outputs_from_proto(message: engine_pb2.StructuredOutputs) -> StructuredOutputsParams:
    kind = message.WhichOneof("constraint")
    if kind is None:
        raise InvalidRequestError("structured_outputs is set but holds no constraint.", param="structured_outputs")
    value = {"json_schema": lambda: {"json": message.json_schema}, "json_object": lambda: {"json_object": True},
             "regex": lambda: {"regex": message.regex}, "choice": lambda: {"choice": list(message.choice.choices)},
             "grammar": lambda: {"grammar": message.grammar}}[kind]()
    return StructuredOutputsParams(**value, disable_any_whitespace=message.disable_any_whitespace)


def _logprob_to_proto(token_id: int, logprob: Logprob) -> engine_pb2.Logprob:
    return engine_pb2.Logprob(token_id=token_id, logprob=logprob.logprob, rank=logprob.rank or 0)


def position_logprobs_to_proto(position: PositionLogprobs) -> engine_pb2.PositionLogprobs:
    """The dict's first entry (the chosen token) -> ``token``; the rest, in order -> ``top_logprobs``."""
    (token_id, chosen), *alternatives = position.items()
    return engine_pb2.PositionLogprobs(
        token=_logprob_to_proto(token_id, chosen),
        top_logprobs=[_logprob_to_proto(t, lp) for t, lp in alternatives])


def responses_from_output(output: EngineOutput, num_completion_tokens: int, max_bytes: Optional[int] = None,
                          split_prompt_logprobs: bool = True) -> list[engine_pb2.GenerateResponse]:
    """One engine delta -> its GenerateResponse (``num_completion_tokens``: the sequence's running
    total), or several when it is larger than ``max_bytes`` (None: never split):

    * its tokens (with their logprobs) over consecutive responses of whole tokens, each of at most
      ``max_bytes``, the end (finish reason, stop token) with the last; a client reads them as
      consecutive deltas, so this needs nothing of it;
    * its prompt logprobs, when ``split_prompt_logprobs`` (the client joins them), over responses
      before those (``prompt_logprobs_continued``), the rest with the first tokens; otherwise whole,
      with the first tokens.

    Only a single token's or prompt position's logprobs larger than ``max_bytes`` (or unsplit
    prompt logprobs) make a response larger than that."""
    positions = None
    if output.prompt_logprobs is not None:  # position 0 has no logprob (None) and no place on the wire
        positions = [position_logprobs_to_proto(p) for p in output.prompt_logprobs[1:]]
    reserved = 0
    if positions is not None and not split_prompt_logprobs and max_bytes is not None:
        reserved = _FIELD_FRAMING_BYTES + sum(_embedded_size(p.ByteSize()) for p in positions)
    responses = _token_responses(output, num_completion_tokens, max_bytes, reserved)
    if positions is None:
        return responses
    response = responses[0]
    response.prompt_logprobs.SetInParent()  # set even for a one-token prompt (no positions)
    if max_bytes is None or not split_prompt_logprobs:
        response.prompt_logprobs.positions.extend(positions)
        return responses
    sizes = [_embedded_size(position.ByteSize()) for position in positions]
    if response.ByteSize() + _FIELD_FRAMING_BYTES + sum(sizes) <= max_bytes:
        response.prompt_logprobs.positions.extend(positions)
        return responses
    num_before = num_completion_tokens - len(output.new_token_ids)  # the parts come before this step's tokens
    part_overhead = _continued_part(output, num_before, []).ByteSize() + _FIELD_FRAMING_BYTES
    parts: list[list[engine_pb2.PositionLogprobs]] = []
    current: list[engine_pb2.PositionLogprobs] = []
    size = 0
    for position, position_size in zip(positions, sizes):
        if current and part_overhead + size + position_size > max_bytes:
            parts.append(current)
            current, size = [], 0
        current.append(position)
        size += position_size
    if current and response.ByteSize() + _FIELD_FRAMING_BYTES + size > max_bytes:  # no room beside the delta
        parts.append(current)
        current = []
    response.prompt_logprobs.positions.extend(current)
    return [_continued_part(output, num_before, part) for part in parts] + responses


def _token_responses(output: EngineOutput, num_completion_tokens: int, max_bytes: Optional[int],
                     reserved: int) -> list[engine_pb2.GenerateResponse]:
    """The delta without prompt logprobs, as one response, or as consecutive ones of whole tokens
    each of at most ``max_bytes`` (the first of at most ``max_bytes - reserved``), at least one
    token each."""
    response = _response_without_prompt_logprobs(output, num_completion_tokens)
    if max_bytes is None or len(output.new_token_ids) < 2 or response.ByteSize() + reserved <= max_bytes:
        return [response]
    logprobs = list(response.new_logprobs)
    # Every part's fixed fields take at most what the whole response's do (its total, its end);
    # the packed token IDs add their tag and length.
    fixed = _response_without_tokens(output, num_completion_tokens, with_end=True).ByteSize() + _FIELD_FRAMING_BYTES
    parts: list[tuple[int, int]] = []  # [start, stop) of each part's tokens
    start, size, room = 0, 0, max_bytes - reserved - fixed
    for i, token in enumerate(output.new_token_ids):
        token_size = _varint_size(token) + (_embedded_size(logprobs[i].ByteSize()) if logprobs else 0)
        if i > start and size + token_size > room:
            parts.append((start, i))
            start, size, room = i, 0, max_bytes - fixed
        size += token_size
    parts.append((start, len(output.new_token_ids)))
    if len(parts) == 1:
        return [response]
    num_before = num_completion_tokens - len(output.new_token_ids)
    responses = []
    for start, stop in parts:
        part = _response_without_tokens(output, num_before + stop, with_end=stop == len(output.new_token_ids))
        part.new_token_ids.extend(output.new_token_ids[start:stop])
        part.new_logprobs.extend(logprobs[start:stop])
        responses.append(part)
    return responses


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


# What a length-delimited field adds to its content's size, at most: its tag and a 5-byte length.
_FIELD_FRAMING_BYTES = 6


def _embedded_size(content_bytes: int) -> int:
    """Bytes a message of ``content_bytes`` takes as a repeated field entry: tag, varint length, content."""
    return 1 + max(1, (content_bytes.bit_length() + 6) // 7) + content_bytes


def _continued_part(output: EngineOutput, num_completion_tokens: int,
                    positions: list[engine_pb2.PositionLogprobs]) -> engine_pb2.GenerateResponse:
    """A response carrying only a part of the prompt logprobs (and the usage counts)."""
    return engine_pb2.GenerateResponse(
        index=output.index, num_prompt_tokens=output.num_prompt_tokens, num_cached_tokens=output.num_cached_tokens,
        num_completion_tokens=num_completion_tokens, prompt_logprobs=engine_pb2.PromptLogprobs(positions=positions),
        prompt_logprobs_continued=True)


def _response_without_prompt_logprobs(output: EngineOutput, num_completion_tokens: int) -> engine_pb2.GenerateResponse:
    response = engine_pb2.GenerateResponse(
        index=output.index, new_token_ids=output.new_token_ids,
        new_logprobs=[position_logprobs_to_proto(p) for p in output.new_logprobs or ()],
        finish_reason=_FINISH_REASON_TO_PROTO[output.finish_reason],
        num_prompt_tokens=output.num_prompt_tokens, num_cached_tokens=output.num_cached_tokens,
        num_completion_tokens=num_completion_tokens)
    if output.stop_reason is not None:
        response.stop_token_id = output.stop_reason
    return response


def _response_without_tokens(output: EngineOutput, num_completion_tokens: int,
                             with_end: bool) -> engine_pb2.GenerateResponse:
    """The delta's usage counts, and its end (finish reason, stop token) if ``with_end``."""
    response = engine_pb2.GenerateResponse(
        index=output.index, num_prompt_tokens=output.num_prompt_tokens, num_cached_tokens=output.num_cached_tokens,
        num_completion_tokens=num_completion_tokens)
    if with_end:
        response.finish_reason = _FINISH_REASON_TO_PROTO[output.finish_reason]
        if output.stop_reason is not None:
            response.stop_token_id = output.stop_reason
    return response


def prompt_logprobs_bytes_bound(num_prompt_tokens: int, prompt_logprobs: int, vocab_size: int) -> int:
    """The most bytes a prompt's logprobs can take in a GenerateResponse (``prompt_logprobs``
    alternatives per position, besides the prompt token), for a check before the request runs."""
    entries = min(prompt_logprobs + 1, vocab_size)
    # A Logprob: token_id (varint below vocab_size) and rank (varint up to vocab_size) with their
    # tags, a float with its tag; then its own tag and length inside PositionLogprobs.
    varint = max(1, (vocab_size.bit_length() + 6) // 7)
    logprob = 2 * (1 + varint) + 5
    position = _embedded_size(entries * _embedded_size(logprob))
    return (num_prompt_tokens - 1) * position + _FIELD_FRAMING_BYTES


_POOLING_TYPES = {engine_pb2.POOLING_TYPE_UNSPECIFIED: "last", engine_pb2.POOLING_TYPE_LAST: "last",
                  engine_pb2.POOLING_TYPE_MEAN: "mean", engine_pb2.POOLING_TYPE_CLS: "cls"}


def pooling_params_from_proto(request: engine_pb2.EmbedRequest) -> PoolingParams:
    """An EmbedRequest's pooling; an unknown PoolingType number is refused naming ``pooling_type``."""
    kind = _POOLING_TYPES.get(request.pooling_type)
    if kind is None:
        raise InvalidRequestError(f"Unknown pooling_type {request.pooling_type}.", param="pooling_type")
    return PoolingParams(kind, request.normalize if request.HasField("normalize") else True)
