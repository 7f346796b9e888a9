"""Beam search inside the engine (vLLM's semantics), built from one-token requests.

A beam-search request with ``n`` beams runs in rounds. In each round every live
beam becomes a one-token child request (prompt + the beam's tokens) that returns
the top ``2 n`` logprobs of its next token; no child is streamed. When all
children of a round are done, the candidates (beam, token) are ranked by
cumulative logprob: those ending in EOS or a stop token are set aside as
completed, the best ``n`` others are the next round's beams. After
``max_tokens`` rounds (or at ``max_model_len``) the completed and live beams
are ranked by ``cumulative logprob / length ** length_penalty`` (length counts
the prompt, not a final EOS) and the best ``n`` are sent, index 0 the best.

Each round recomputes only the beams' last, partial KV block: the full blocks
come from the prefix cache (with prefix caching off, a round recomputes the
whole sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from backend.core.request import Request
from backend.types.outputs import EngineOutput, FinishReason, Logprob, PositionLogprobs
from backend.types.sampling_params import SamplingParams


@dataclass
class Beam:
    token_ids: list[int] = field(default_factory=list)  # generated so far
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # the chosen token's, per token
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[int] = None

    def score(self, num_prompt_tokens: int, length_penalty: float, eos_token_ids: list[int]) -> float:
        length = num_prompt_tokens + len(self.token_ids)
        if self.token_ids and self.token_ids[-1] in eos_token_ids:
            length -= 1
        return self.cumulative_logprob / (length ** length_penalty)


class BeamSearch:
    """The state of one beam-search request; the engine feeds it its children's samples."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: list[int], max_model_len: int, arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.width = params.n
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.arrival_time = arrival_time
        self.child_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * self.width,
                                           ignore_eos=True)
        self.live: list[Beam] = [Beam()]
        self.completed: list[Beam] = []
        self.round = 0
        self.candidates: dict[str, PositionLogprobs] = {}  # child ID -> its next-token logprobs
        self.children: dict[str, Beam] = {}  # this round's child IDs -> the beam each extends

    def next_children(self, eos_token_id: Optional[int], new_sequence_id: Callable[[], str]) -> list[Request]:
        """The requests of the next round, one per live beam; ``new_sequence_id`` gives each child
        an engine-internal ID (no client can name one)."""
        self.round += 1
        self.candidates.clear()
        self.children = {new_sequence_id(): beam for beam in self.live}
        return [Request(child_id, self.prompt_token_ids + beam.token_ids, self.child_params, eos_token_id,
                        parent_id=self.request_id, index=i, arrival_time=self.arrival_time)
                for i, (child_id, beam) in enumerate(self.children.items())]

    def record(self, child_id: str, logprobs: PositionLogprobs) -> bool:
        """A child's next-token logprobs; True once the whole round has reported."""
        self.candidates[child_id] = logprobs
        return len(self.candidates) == len(self.children)

    def advance(self) -> bool:
        """Rank the round's candidates into the next beams; True when the search is over."""
        stop_ids = set(self.params.stop_token_ids)
        ranked: list[Beam] = []
        for child_id, beam in self.children.items():
            for token_id, logprob in self.candidates[child_id].items():
                extended = Beam(beam.token_ids + [token_id], beam.cumulative_logprob + logprob.logprob,
                                beam.logprobs + [{token_id: Logprob(logprob.logprob, logprob.rank)}])
                is_eos = token_id in self.eos_token_ids and not self.params.ignore_eos
                if is_eos or token_id in stop_ids:
                    extended.finish_reason = FinishReason.STOP
                    extended.stop_reason = token_id if not is_eos else None
                    self.completed.append(extended)
                else:
                    ranked.append(extended)
        ranked.sort(key=lambda b: b.cumulative_logprob, reverse=True)
        self.live = ranked[:self.width]
        num_generated = self.round
        max_tokens = self.params.max_tokens
        at_limit = ((max_tokens is not None and num_generated >= max_tokens)
                    or len(self.prompt_token_ids) + num_generated >= self.max_model_len)
        if at_limit or not self.live:
            for beam in self.live:
                beam.finish_reason = FinishReason.LENGTH
            self.completed.extend(self.live)
            self.live = []
            return True
        return False

    def outputs(self) -> list[EngineOutput]:
        """The best ``n`` beams, best first, each as one final delta."""
        num_prompt = len(self.prompt_token_ids)
        best = sorted(self.completed, reverse=True,
                      key=lambda b: b.score(num_prompt, self.params.length_penalty, self.eos_token_ids))
        return [EngineOutput(request_id=self.request_id, index=i, new_token_ids=beam.token_ids,
                             new_logprobs=beam.logprobs if self.params.logprobs is not None else None,
                             finish_reason=beam.finish_reason, stop_reason=beam.stop_reason,
                             num_prompt_tokens=num_prompt)
                for i, beam in enumerate(best[:self.width])]
