"""vLLM-compatible results, and the one place engine deltas become text.

The offline ``LLM`` and the HTTP server both turn ``EngineOutput`` deltas into
text here, so the two cannot drift apart.

How a sequence ends (vLLM's rules):

- EOS or a stop token ID (engine ``finish_reason="stop"``): the token's ID is
  kept in ``token_ids`` (and its logprobs), but its text is left out unless
  ``include_stop_str_in_output``; ``stop_reason`` is the stop token ID, or None
  for EOS.
- A stop string (found here, on text): ``finish_reason="stop"`` and
  ``stop_reason`` the string; the text ends before it (or after it with
  ``include_stop_str_in_output``); the token that completed it is the last one
  kept, later tokens are dropped, and ``stopped_by_string`` tells the caller
  the engine may still be generating it (abort it; see ``RequestOutputBuilder``).
- ``max_tokens`` / ``max_model_len``: ``finish_reason="length"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from transformers import PreTrainedTokenizerFast

from backend.types.outputs import EngineOutput, FinishReason, Logprob, PositionLogprobs
from backend.types.sampling_params import SamplingParams
from frontend.tokenizer import IncrementalDetokenizer, StopStringMatcher, decode_token


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's field names)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]  # None unless logprobs were requested
    logprobs: Optional[list[PositionLogprobs]]  # one entry per token_ids entry
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"; None while running
    stop_reason: Union[int, str, None] = None  # stop token ID or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All sequences of one request (vLLM's field names)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]]  # position 0 is None
    outputs: list[CompletionOutput]  # ordered by index
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(slots=True)
class TextDelta:
    """What one ``EngineOutput`` added to a sequence, ready to stream."""

    text: str
    token_ids: list[int]
    logprobs: Optional[list[PositionLogprobs]]  # aligned with token_ids; None unless requested
    finish_reason: Optional[str] = None  # set on the sequence's last delta only
    stop_reason: Union[int, str, None] = None
    # A stop string ended it while the engine may still be generating: abort the
    # request (with n > 1, once every sequence is done: RequestOutputBuilder.finished).
    stopped_by_string: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def with_decoded_tokens(tokenizer: PreTrainedTokenizerFast,
                        position: Optional[PositionLogprobs]) -> Optional[PositionLogprobs]:
    """A copy of one position's logprobs with every ``decoded_token`` filled in."""
    if position is None:
        return None
    return {token_id: Logprob(lp.logprob, lp.rank, decode_token(tokenizer, token_id))
            for token_id, lp in position.items()}


class SequenceDecoder:
    """Detokenizes and stop-checks one sequence (one ``index`` of one request)."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, prompt_token_ids: list[int],
                 params: SamplingParams, index: int = 0) -> None:
        self.index = index
        self._tokenizer = tokenizer
        self._params = params
        self._min_tokens = params.min_tokens
        self._show_stop = params.include_stop_str_in_output
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens)
        self._stops = StopStringMatcher(params.stop or [], params.include_stop_str_in_output)
        self._has_stop_strings = bool(params.stop)
        self._pieces: list[str] = []  # the text so far, joined only when asked (``text``)
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[PositionLogprobs]] = [] if params.wants_logprobs else None
        self.cumulative_logprob: Optional[float] = 0.0 if params.wants_logprobs else None
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[int, str, None] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The sequence's text so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def update(self, delta: EngineOutput) -> TextDelta:
        """Apply one engine delta; deltas after the sequence finished add nothing.

        Per token: one detokenizer step and, with stop strings, one matcher step;
        nothing here grows with the sequence's length.
        """
        if self.finish_reason is not None:
            return TextDelta("", [], [] if self.logprobs is not None else None)
        new_ids = delta.new_token_ids
        new_logprobs = delta.new_logprobs
        if self.logprobs is not None and (new_logprobs is None or len(new_logprobs) != len(new_ids)):
            raise ValueError(f"sequence {self.index}: expected logprobs for each of {len(new_ids)} new tokens, "
                             f"got {None if new_logprobs is None else len(new_logprobs)}")
        finish = delta.finish_reason
        # The engine's stop token (EOS / stop_token_ids) is the delta's last token.
        hide_last = finish is not None and finish == FinishReason.STOP and not self._show_stop
        num_shown = len(new_ids) - 1 if hide_last and new_ids else len(new_ids)
        stops = self._stops
        if self._has_stop_strings:
            kept, text = self._push_until_stop(new_ids, num_shown)
        else:  # no stop string can end it: every token is kept, the text is the detokenizer's
            kept = len(new_ids)
            text = self._detokenizer.push(new_ids if num_shown == kept else new_ids[:num_shown]) if num_shown else ""

        token_ids = list(new_ids) if kept == len(new_ids) else new_ids[:kept]
        text_delta = TextDelta(text, token_ids, None)
        if self.logprobs is not None:
            text_delta.logprobs = [with_decoded_tokens(self._tokenizer, p) for p in new_logprobs[:kept]]
            self.logprobs.extend(text_delta.logprobs)
            self.cumulative_logprob += sum(_sampled_logprob(p, t) for p, t in zip(new_logprobs, token_ids))
        self.token_ids.extend(token_ids)

        if stops.stop_string is None and finish is not None:
            text += stops.push(self._detokenizer.flush(), len(self.token_ids) > self._min_tokens)
            text += stops.flush()
            text_delta.text = text
        if stops.stop_string is not None:
            self.finish_reason, self.stop_reason = FinishReason.STOP.value, stops.stop_string
            text_delta.stopped_by_string = True
        elif finish is not None:
            self.finish_reason, self.stop_reason = FinishReason(finish).value, delta.stop_reason
        text_delta.finish_reason, text_delta.stop_reason = self.finish_reason, self.stop_reason
        if text:
            self._pieces.append(text)
        return text_delta

    def _push_until_stop(self, new_ids: list[int], num_shown: int) -> tuple[int, str]:
        """Detokenize and stop-check token by token (a stop string drops the tokens after it);
        (how many tokens are kept, the text they release)."""
        kept = 0
        out: list[str] = []
        for i, token_id in enumerate(new_ids):
            kept += 1
            if i == num_shown:  # the hidden stop token
                break
            piece = self._detokenizer.push([token_id])
            # vLLM checks stop strings only once more than min_tokens tokens exist.
            out.append(self._stops.push(piece, len(self.token_ids) + kept > self._min_tokens))
            if self._stops.stop_string is not None:
                break
        return kept, "".join(out)

    def output(self) -> CompletionOutput:
        """A snapshot of the sequence so far."""
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


def _sampled_logprob(position: PositionLogprobs, token_id: int) -> float:
    # The chosen token is always in its position's dict (listed first).
    return position[token_id].logprob if token_id in position else next(iter(position.values())).logprob


@dataclass
class RequestOutputBuilder:
    """Routes one request's deltas to its ``n`` sequences and assembles the ``RequestOutput``.

    ``finished`` turns true once every sequence has ended, which can be before
    the engine says so (stop strings): abort the request in the engine then.
    """

    tokenizer: PreTrainedTokenizerFast = field(repr=False)
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    num_cached_tokens: int = 0
    sequences: list[SequenceDecoder] = field(init=False)
    _num_running: int = field(init=False, repr=False)  # sequences not finished (they finish only in add)

    def __post_init__(self) -> None:
        self.sequences = [SequenceDecoder(self.tokenizer, self.prompt_token_ids, self.params, index=i)
                          for i in range(self.params.n)]
        self._num_running = len(self.sequences)

    @property
    def finished(self) -> bool:
        return self._num_running == 0

    def add(self, delta: EngineOutput) -> TextDelta:
        """Apply one delta to the sequence it belongs to."""
        if not 0 <= delta.index < len(self.sequences):
            raise ValueError(f"request {self.request_id!r}: delta for sequence {delta.index}, "
                             f"but it has {len(self.sequences)}")
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [with_decoded_tokens(self.tokenizer, p) for p in delta.prompt_logprobs]
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        sequence = self.sequences[delta.index]
        was_running = sequence.finish_reason is None
        text_delta = sequence.update(delta)
        if was_running and sequence.finish_reason is not None:
            self._num_running -= 1
        return text_delta

    def build(self) -> RequestOutput:
        """The request as it stands: every sequence, ordered by index."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            prompt_logprobs=self.prompt_logprobs,
            outputs=[sequence.output() for sequence in self.sequences],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
        )
