"""EngineService's messages <-> the engine's types (the backend side; the frontend's is
``frontend.grpc_client``)."""

from __future__ import annotations

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


def response_from_output(output: EngineOutput, num_completion_tokens: int) -> engine_pb2.GenerateResponse:
    """One engine delta -> GenerateResponse; ``num_completion_tokens`` is the sequence's running total."""
    response = engine_pb2.GenerateResponse(
        index=output.index, new_token_ids=output.new_token_ids,
        new_logprobs=[position_logprobs_to_proto(p) for p in output.new_logprobs or ()],
        finish_reason=_FINISH_REASON_TO_PROTO[output.finish_reason],
        num_prompt_tokens=output.num_prompt_tokens, num_cached_tokens=output.num_cached_tokens,
        num_completion_tokens=num_completion_tokens)
    if output.stop_reason is not None:
        response.stop_token_id = output.stop_reason
    if output.prompt_logprobs is not None:
        response.prompt_logprobs.SetInParent()  # set even for a one-token prompt (no positions)
        # Position 0 has no logprob (None) and no place on the wire.
        response.prompt_logprobs.positions.extend(
            position_logprobs_to_proto(p) for p in output.prompt_logprobs[1:])
    return response


_POOLING_TYPES = {engine_pb2.POOLING_TYPE_UNSPECIFIED: "last", engine_pb2.POOLING_TYPE_LAST: "last",
                  engine_pb2.POOLING_TYPE_MEAN: "mean"}


def pooling_params_from_proto(request: engine_pb2.EmbedRequest) -> PoolingParams:
    """An EmbedRequest's pooling; an unknown PoolingType number is refused naming ``pooling_type``."""
    kind = _POOLING_TYPES.get(request.pooling_type)
    if kind is None:
        raise InvalidRequestError(f"Unknown pooling_type {request.pooling_type}.", param="pooling_type")
    return PoolingParams(kind, request.normalize if request.HasField("normalize") else True)
