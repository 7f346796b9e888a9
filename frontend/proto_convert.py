"""The engine's types <-> EngineService's messages, on the frontend side (the backend's is
``backend.server.proto_convert``). Runs once per streamed token: keep it lean."""

from __future__ import annotations

from typing import Optional

from backend.types.outputs import EngineOutput, FinishReason, Logprob, PositionLogprobs
from backend.types.sampling_params import SamplingParams
from protos.tandem.engine.v1 import engine_pb2

_FINISH_REASON_FROM_PROTO = {
    engine_pb2.FINISH_REASON_UNSPECIFIED: None,
    engine_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    engine_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    engine_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}



def sampling_params_to_proto(params: SamplingParams) -> engine_pb2.SamplingParams:
    """Every wire field set explicitly (stop strings stay here: the frontend matches them)."""
    message = engine_pb2.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        min_p=params.min_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
        min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
        logprob_token_ids=params.logprob_token_ids or (), use_beam_search=params.use_beam_search,
        length_penalty=params.length_penalty, logit_bias=params.logit_bias or {})
    # None means "unset" on the wire, which is these fields' None on the backend.
    for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None:
            setattr(message, name, value)
    constraint = params.structured_outputs
    if constraint is not None:
        wire = message.structured_outputs
        wire.disable_any_whitespace = constraint.disable_any_whitespace
        if constraint.json is not None:
            wire.json_schema = constraint.json
        elif constraint.json_object:
            wire.json_object.SetInParent()
        elif constraint.regex is not None:
            wire.regex = constraint.regex
        elif constraint.choice is not None:
            wire.choice.choices.extend(constraint.choice)
        else:
            wire.grammar = constraint.grammar
    return message


def position_logprobs_from_proto(position: engine_pb2.PositionLogprobs) -> PositionLogprobs:
    """``token`` first, then ``top_logprobs`` in order: the engine's dict layout."""
    return {entry.token_id: Logprob(entry.logprob, rank=entry.rank or None)
            for entry in (position.token, *position.top_logprobs)}


def output_from_response(request_id: str, response: engine_pb2.GenerateResponse,
                         earlier_positions: Optional[list] = None) -> EngineOutput:
    """One response as an ``EngineOutput``. Runs once per token of every stream: the optional
    parts (logprobs, a stop token, prompt logprobs) are converted only when present.
    ``earlier_positions``: the prompt logprobs' positions of the parts before it (``OutputReader``)."""
    new_logprobs = response.new_logprobs
    prompt_logprobs = None
    if earlier_positions is not None:
        earlier_positions.extend(response.prompt_logprobs.positions)
        prompt_logprobs = [None] + [position_logprobs_from_proto(p) for p in earlier_positions]
    elif response.HasField("prompt_logprobs"):
        prompt_logprobs = [None] + [position_logprobs_from_proto(p) for p in response.prompt_logprobs.positions]
    finish_reason = _FINISH_REASON_FROM_PROTO[response.finish_reason] if response.finish_reason else None
    return EngineOutput(
        request_id, response.index, list(response.new_token_ids),
        [position_logprobs_from_proto(p) for p in new_logprobs] if new_logprobs else None,
        finish_reason,
        response.stop_token_id if response.HasField("stop_token_id") else None,
        response.num_prompt_tokens, response.num_cached_tokens, prompt_logprobs)


class OutputReader:
    """One request's responses -> its ``EngineOutput``s, joining prompt logprobs the backend split
    over several responses (``prompt_logprobs_continued``, which this client accepts:
    ``GenerateRequest.accept_split_prompt_logprobs``): ``read`` holds each part back (None) and
    returns the output of the part that ends them, with every position in order."""

    __slots__ = ("request_id", "_parts")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._parts: dict[int, list] = {}  # sequence index -> positions (protos) received so far

    def read(self, response: engine_pb2.GenerateResponse) -> Optional[EngineOutput]:
        if response.prompt_logprobs_continued:
            self._parts.setdefault(response.index, []).extend(response.prompt_logprobs.positions)
            return None
        earlier = self._parts.pop(response.index, None) if self._parts else None
        return output_from_response(self.request_id, response, earlier)
