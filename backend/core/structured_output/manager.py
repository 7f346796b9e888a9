"""Structured outputs: grammars that constrain generated tokens, enforced in the sampler (xgrammar).

A constrained request's life:

1. ``SamplingParams.structured_outputs`` names one constraint (a JSON Schema, any
   JSON object, a regex, a choice of strings, an EBNF grammar).
2. ``compile_async`` compiles it off the engine thread, before the request is
   queued (``backend.core.structured_output.compiler``: cached by spec, at most
   ``grammar_compile_workers`` at once, each bounded by
   ``grammar_compile_timeout_s``). A spec that does not compile in time, or at
   all, raises ``InvalidRequestError`` (gRPC INVALID_ARGUMENT, HTTP 400) before
   the first token.
3. Each sequence gets its own matcher (``add``). Every step, before the model
   runs, ``grammar_bitmask`` fills one row of allowed tokens per constrained
   sequence that samples; the sampler sets every other token's logit to -inf
   (``TokenBitmask.apply_``).
4. After the step the engine advances the matcher with the sampled token
   (``accept``); once the grammar is complete only EOS is allowed.

Nothing here runs while no request is constrained: the engine checks
``has_matchers`` first, and xgrammar is imported on the first constrained request.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

import torch

from backend.core.structured_output.compiler import GrammarCompiler
from backend.messages.grammar_mask import GrammarBitmask
from backend.types.config import EngineConfig
from backend.types.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class GrammarViolation(RuntimeError):
    """A sampled token the grammar does not allow; the sequence cannot go on."""


class StructuredOutputManager:
    """Compiled grammars and each constrained sequence's matcher. Matchers are touched only by
    the engine thread; compiling is ``self.compiler``'s (``backend.core.structured_output.compiler``), off it."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int],
                 compile_timeout_s: float = EngineConfig.grammar_compile_timeout_s,
                 compile_workers: int = EngineConfig.grammar_compile_workers,
                 json_max_whitespace: int = EngineConfig.json_max_whitespace) -> None:
        self.compiler = GrammarCompiler(tokenizer_path, vocab_size, stop_token_ids, compile_timeout_s,
                                        compile_workers, json_max_whitespace)
        self.vocab_size = vocab_size
        self._matchers: dict[str, Any] = {}  # request ID -> xgrammar.GrammarMatcher
        self._bitmask: Optional[torch.Tensor] = None  # reused across steps, grown as needed

    @property
    def has_matchers(self) -> bool:
        return bool(self._matchers)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar, blocking the caller (never call it on the engine thread while serving)."""
        return self.compiler.compile(spec)

    async def compile_async(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar; the event loop and the engine keep running meanwhile."""
        return await self.compiler.compile_async(spec)

    def add(self, request_id: str, compiled: Any) -> None:
        import xgrammar

        self._matchers[request_id] = xgrammar.GrammarMatcher(compiled)

    def remove(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def grammar_bitmask(self, sampling_request_ids: Iterable[str],
                        failed: dict[str, str]) -> Optional[GrammarBitmask]:
        """Fill the allowed tokens of the constrained ones among ``sampling_request_ids``.

        A matcher that raises is that request's failure alone: its ID goes into ``failed`` (with
        the reason), it gets no row, and the engine ends it after the step."""
        constrained = [rid for rid in sampling_request_ids if rid in self._matchers]
        if not constrained:
            return None
        import xgrammar

        if self._bitmask is None or self._bitmask.shape[0] < len(constrained):
            self._bitmask = xgrammar.allocate_token_bitmask(max(len(constrained), 8), self.vocab_size)
        row_of_request: dict[str, int] = {}
        for request_id in constrained:
            row = len(row_of_request)
            try:
                self._matchers[request_id].fill_next_token_bitmask(self._bitmask, row)
            except Exception as error:  # noqa: BLE001 -- one grammar's fault ends only its request
                logger.exception("Filling the grammar mask of %r failed", request_id)
                failed[request_id] = f"The request's structured-output grammar failed: {type(error).__name__}: {error}"
                continue
            row_of_request[request_id] = row
        if not row_of_request:
            return None
        return GrammarBitmask(self._bitmask[:len(row_of_request)], row_of_request)

    def accept(self, request_id: str, token_id: int) -> Optional[bool]:
        """Advance a sequence's matcher. None: not constrained; True: its text is complete (the
        grammar ended, with EOS); False: it goes on. A token the grammar refuses (possible only
        when other settings left no allowed token, e.g. min_tokens forbidding the EOS a complete
        grammar needs) raises ``GrammarViolation``."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return None
        if not matcher.accept_token(token_id):
            raise GrammarViolation(f"Request {request_id!r}: token {token_id} breaks its structured-output grammar.")
        return matcher.is_terminated()

    def shutdown(self) -> None:
        self.compiler.shutdown()
