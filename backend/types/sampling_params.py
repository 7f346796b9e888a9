"""Sampling parameters and structured-output constraints: how a request wants its tokens picked.

Pure Python (no torch): both processes use these, in process or over gRPC.
"""

from __future__ import annotations

import functools

import json
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from backend.types.errors import InvalidRequestError
from backend.types.pooling import PoolingParams

# The longest schema, regex or grammar (in characters) a request may carry: compiling
# one costs time and memory on the backend, so it is bounded before anything is queued.
MAX_STRUCTURED_OUTPUT_CHARS = 64 * 1024
MAX_CHOICES = 1024  # structured_outputs.choice entries


@dataclass
class StructuredOutputsParams:
    """Constrain the generated text to a language (vLLM's ``structured_outputs``).

    Exactly one of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``
    is set. The backend enforces it token by token (``backend.core.structured_output``).

    - ``json``: a JSON Schema (a dict, or its JSON text); the output is JSON valid
      for it. Properties not in the schema are never generated (vLLM with
      xgrammar does the same), so ``disable_additional_properties`` is always in effect.
    - ``json_object``: any JSON object.
    - ``regex``: the output matches the regular expression (JSON Schema's
      ``pattern`` dialect, a subset of ECMA-262) from start to end.
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: an EBNF grammar in the GBNF dialect (llama.cpp's, with rule
      ``root`` as the start); the output is a sentence of it.
    - ``disable_any_whitespace``: JSON without whitespace between tokens.
    """

    json: Union[str, dict, None] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False  # there is one grammar backend: never a fallback

    KINDS = ("json", "json_object", "regex", "choice", "grammar")

    def __post_init__(self) -> None:
        def bad(message: str) -> None:
            raise InvalidRequestError(message, param="structured_outputs")

        given = [kind for kind in self.KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            bad("structured_outputs needs exactly one of json, json_object, regex, choice or grammar; "
                f"got {', '.join(given) if given else 'none'}.")
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        if self.json is not None:
            if not isinstance(self.json, str):
                bad(f"structured_outputs.json must be a JSON Schema object, got {type(self.json).__name__}.")
            try:
                schema = json.loads(self.json)
            except ValueError as error:
                bad(f"structured_outputs.json is not valid JSON: {error}.")
            if not isinstance(schema, (dict, bool)):
                bad("structured_outputs.json must be a JSON Schema (an object).")
        for kind in ("json", "regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                bad(f"structured_outputs.{kind} must be a non-empty string.")
            if value is not None and len(value) > MAX_STRUCTURED_OUTPUT_CHARS:
                bad(f"structured_outputs.{kind} is {len(value)} characters long; at most "
                    f"{MAX_STRUCTURED_OUTPUT_CHARS} are accepted.")
        if self.choice is not None:
            if (not isinstance(self.choice, list) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                bad("structured_outputs.choice must be a non-empty list of non-empty strings.")
            if len(self.choice) > MAX_CHOICES or sum(map(len, self.choice)) > MAX_STRUCTURED_OUTPUT_CHARS:
                bad(f"structured_outputs.choice may hold at most {MAX_CHOICES} strings of "
                    f"{MAX_STRUCTURED_OUTPUT_CHARS} characters in all.")

    @property
    def kind(self) -> str:
        return next(kind for kind in self.KINDS if getattr(self, kind) not in (None, False))

    def cache_key(self) -> tuple:
        """Equal keys compile to the same grammar."""
        return (self.kind, self.json, self.regex, tuple(self.choice or ()), self.grammar,
                self.disable_any_whitespace)

    @classmethod
    def coerce(cls, value: Any) -> Optional["StructuredOutputsParams"]:
        """None, an instance, or vLLM's dict form."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f for f in cls.__dataclass_fields__})
            if unknown:
                raise InvalidRequestError(f"structured_outputs does not take {', '.join(unknown)}.",
                                          param="structured_outputs")
            return cls(**value)
        raise InvalidRequestError("structured_outputs must be an object.", param="structured_outputs")


_REAL_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass
class SamplingParams:
    """How to pick tokens for one request (vLLM's names and defaults).

    Validated on creation: a bad value raises ``InvalidRequestError`` that names
    the parameter.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: Optional[int] = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: Optional[list[str]] = None  # matched on text by the frontend
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-k logprobs per generated token (0: sampled only; -1: all)
    prompt_logprobs: Optional[int] = None  # top-k logprobs per prompt token (-1: the whole vocabulary)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Logprobs of exactly these tokens at each generated position (besides the
    # chosen one), instead of the top ``logprobs``.
    logprob_token_ids: Optional[list[int]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Beam search (vLLM's): ``n`` beams, scored by cumulative logprob / length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Token ID -> a bias in [-100, 100] added to its logit before sampling and logprobs (OpenAI's).
    logit_bias: Optional[dict[int, float]] = None
    # Set only by the engine's embed path (never from a Generate request): the request computes its
    # prompt, returns the pooled hidden state with its one (greedy) token, and ends.
    pooling: Optional[PoolingParams] = None

    def __post_init__(self) -> None:
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = list(self.logprob_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias) or None  # empty: off
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str) -> None:
            raise InvalidRequestError(message, param=param)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"n must be at least 1, got {self.n}.")
        for name in _REAL_PARAMS:  # JSON and protobuf both carry NaN and infinities
            if not math.isfinite(getattr(self, name)):
                bad(name, f"{name} must be a finite number, got {getattr(self, name)}.")
        if self.temperature < 0.0:
            bad("temperature", f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            bad("top_k", f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad("min_tokens", f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):  # -1: the whole vocabulary (vLLM's)
            value = getattr(self, name)
            if value is not None and value < -1:
                bad(name, f"{name} must be -1 (the whole vocabulary) or non-negative, got {value}.")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must not be empty.")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "stop_token_ids must be non-negative token IDs.")
        if self.logprob_token_ids is not None:
            if not self.logprob_token_ids or any(t < 0 for t in self.logprob_token_ids):
                bad("logprob_token_ids", "logprob_token_ids must be a non-empty list of token IDs.")
            if self.logprobs is not None:
                bad("logprob_token_ids", "Give logprobs (the top k) or logprob_token_ids (these tokens), not both.")
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                    bad("logit_bias", f"logit_bias keys must be token IDs (non-negative integers), got {token_id!r}.")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                    bad("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {bias!r} "
                        f"for token {token_id}.")
        if self.use_beam_search:
            # Beams are ranked by the raw logprobs, as vLLM's are: temperature does not change
            # them; the filters and penalties below would, and are not implemented for beams.
            for name, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("presence_penalty", 0.0),
                              ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("min_tokens", 0),
                              ("structured_outputs", None), ("logprob_token_ids", None), ("logit_bias", None)):
                if getattr(self, name) != off:
                    bad(name, f"{name} cannot be combined with use_beam_search.")
            if self.logprobs not in (None, 0):
                bad("logprobs", "With use_beam_search only the chosen tokens' logprobs (logprobs=0) are returned.")

    @functools.cached_property  # parameters are fixed once constructed
    def wants_logprobs(self) -> bool:
        """Each generated token comes with its logprobs (top-k or of logprob_token_ids)."""
        return self.logprobs is not None or self.logprob_token_ids is not None

    @functools.cached_property
    def logit_bias_entries(self) -> tuple[list[int], list[float]]:
        """logit_bias as (token IDs, biases), made once per request."""
        bias = self.logit_bias or {}
        return list(bias), [float(value) for value in bias.values()]

    @functools.cached_property
    def argmax_only(self) -> bool:
        """Each token is the argmax of the raw logits: greedy, and nothing else changes them or
        asks for more than the token (no logprobs, penalties, logit_bias or min_tokens)."""
        return (self.greedy and not self.wants_logprobs and not self.has_penalties and not self.logit_bias
                and self.min_tokens == 0)

    @functools.cached_property  # parameters are fixed once constructed
    def samples_on_device(self) -> Optional[bool]:
        """Whether a decode token can be picked without reading the device back mid-step: False
        for a plain argmax (``argmax_only``), True for a pick on the device (temperature, top-k,
        min-p, seeds, penalties, logit_bias, min_tokens); None where the host reads the device
        while sampling or after it (logprobs, prompt logprobs, pooling, top-p's wide-nucleus
        fallback)."""
        if self.prompt_logprobs is not None or self.pooling is not None:
            return None
        if self.argmax_only:
            return False
        return None if self.wants_logprobs or self.top_p < 1.0 else True

    @functools.cached_property  # parameters are fixed once constructed
    def has_penalties(self) -> bool:
        """A repetition, frequency or presence penalty is on."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @functools.cached_property  # parameters are fixed once constructed
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1
