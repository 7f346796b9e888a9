"""LLMEngine: one synchronous ``step()`` (``AsyncLLMEngine`` runs it in an asyncio background loop).

A step is: the scheduler picks tokens -> the executor runs the model on every
worker and samples -> the engine appends tokens, checks stop conditions and
emits ``EngineOutput`` deltas; finished requests free their blocks.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import time
from typing import Iterable, Optional

from backend.core.beam_search import BeamSearch
from backend.core.block_manager import BlockManager
from backend.core.iteration_stats import TokenHistogram
from backend.core.request import Request
from backend.core.scheduler import Scheduler
from backend.core.spec_decode import NgramProposer, propose_drafts
from backend.core.structured_output.manager import GrammarViolation, StructuredOutputManager
from backend.engine.decode_step import apply_decode_tokens
from backend.engine.inflight import InFlightStep
from backend.engine.request_checks import eos_token_ids, validate_request
from backend.engine.sampled_tokens import apply_sampled_tokens
from backend.messages.late_grammar import LateGrammar
from backend.executor import create_executor
from backend.models.resolve import load_cpu_kernels_early, resolve_config
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError, RequestFailedError
from backend.types.limits import Limits
from backend.types.outputs import EngineLoad, EngineOutput, FinishReason, ModelInfo
from backend.types.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _failure_message(error: BaseException) -> str:
    """What a client is told when its request failed inside the engine."""
    return f"The request failed inside the engine: {type(error).__name__}: {error}"


class LLMEngine:
    """The engine core. Not thread-safe: one caller drives ``add_request``/``step``."""

    def __init__(self, config: EngineConfig, limits: Optional[Limits] = None) -> None:
        load_cpu_kernels_early(config)  # a first build overlaps with fetching and converting the model
        self.config = resolve_config(config)
        self.limits = limits or Limits()
        self.executor = create_executor(config)
        try:
            num_blocks = self._init_kv_cache()
        except BaseException:
            self.executor.shutdown()  # no worker outlives a failed start
            raise
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len,
                                   config.enable_chunked_prefill)
        self.vocab_size = config.hf_config.vocab_size
        self.eos_token_ids = eos_token_ids(config)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        # Client request IDs are labels only: every sequence the engine runs (each of ``n``, each
        # beam-search child) gets an internal ID from this counter, so no client ID can collide with
        # one. The scheduler, the block manager and the workers know only internal IDs.
        self._sequence_ids = itertools.count()
        self.children: dict[str, list[str]] = {}  # client request ID -> its sequences' internal IDs
        self.deadlines: list[tuple[float, str]] = []  # heap of (time.monotonic() deadline, client ID)
        self.deadline_of: dict[str, float] = {}  # client request ID -> its deadline (requests with one)
        self.beams: dict[str, BeamSearch] = {}  # beam-search request ID -> its search
        self.structured_output = StructuredOutputManager(
            str(config.tokenizer_path), self.vocab_size, self.eos_token_ids,
            compile_timeout_s=config.grammar_compile_timeout_s, compile_workers=config.grammar_compile_workers,
            json_max_whitespace=config.json_max_whitespace)
        # As vLLM's prompt_tokens_total: the whole prompt of each sequence, counted at its first token
        # (prefix-cache hits included; a preempted sequence's recompute is not counted again).
        self.num_prompt_tokens_total = 0
        # Prompt tokens the model ran (prefix-cache hits excluded, recomputation after a preemption
        # included): Tandem's own count, beside vLLM's.
        self.num_prompt_tokens_computed_total = 0
        self.num_generation_tokens_total = 0
        # Tokens per step as vLLM counts them (for /metrics): the tokens generated in the step, plus
        # the whole prompt of each sequence whose first token it generated; steps with neither
        # (prompt chunks only) are not observed.
        self.iteration_tokens = TokenHistogram()
        self._first_token_prompts = 0  # prompt tokens of sequences given their first token this step
        self.speculative = config.speculative
        self.proposer = NgramProposer(self.speculative) if self.speculative else None
        self.async_scheduling = self.config.use_async_scheduling
        self._inflight: Optional[InFlightStep] = None  # the step launched and not processed yet
        self.num_draft_tokens_total = 0  # speculative tokens proposed, and accepted
        self.num_accepted_tokens_total = 0
        logger.info("Engine ready: %s, %s, %d KV blocks of %d tokens (%s)%s", config.served_model_name,
                    config.torch_dtype_name, num_blocks, config.block_size, config.kv_cache_dtype_name,
                    ", async scheduling" if self.async_scheduling else "")

    def _init_kv_cache(self) -> int:
        num_blocks = self.executor.determine_num_blocks()
        if num_blocks * self.config.block_size < self.config.max_model_len:
            raise InvalidRequestError(
                f"The KV cache holds {num_blocks * self.config.block_size} tokens, fewer than "
                f"max_model_len ({self.config.max_model_len}); raise the KV-cache budget or lower "
                "max_model_len.", param="max_model_len")
        self.executor.init_kv_cache(num_blocks)
        return num_blocks

    # ---- requests -------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError, naming the problem, for a request we cannot serve."""
        validate_request(prompt_token_ids, params, self.vocab_size, self.config.max_model_len, self.limits)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: Optional[float] = None, grammar: object = None, deadline: Optional[float] = None,
                    cache_salt: Optional[str] = None) -> None:
        """Queue a request (``params.n`` sequences). Raises InvalidRequestError for bad input.

        ``grammar``: ``params.structured_outputs`` compiled already (``compile_async``);
        without it a constrained request is compiled here, on the caller's thread.
        ``deadline`` (``time.monotonic()`` seconds): ``abort_expired`` ends the request then.
        ``cache_salt``: only requests with the same salt share cached prefix blocks.
        """
        if request_id in self.children:
            raise InvalidRequestError(f"Request ID {request_id!r} is already in use.",
                                      param="request_id")
        self.validate(prompt_token_ids, params)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.structured_output.compile(params.structured_outputs)
        try:
            self._add_sequences(request_id, prompt_token_ids, params, arrival_time, grammar, deadline,
                                cache_salt)
        except Exception as error:  # the request's own fault (its grammar, say): undo it, raise it typed
            self._discard(request_id)
            raise RequestFailedError(_failure_message(error)) from error

    def _add_sequences(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       arrival_time: Optional[float], grammar: object, deadline: Optional[float],
                       cache_salt: Optional[str]) -> None:
        if deadline is not None:
            self.deadline_of[request_id] = deadline
            heapq.heappush(self.deadlines, (deadline, request_id))
        if params.use_beam_search:
            search = BeamSearch(request_id, prompt_token_ids, params, self.eos_token_ids,
                                self.config.max_model_len, arrival_time or time.monotonic())
            self.beams[request_id] = search
            self._start_beam_round(search)
            return
        ids = [self._new_sequence_id() for _ in range(params.n)]
        self.children[request_id] = ids
        for index, child_id in enumerate(ids):
            child_params = params
            if params.seed is not None and params.n > 1:
                child_params = dataclasses.replace(params, seed=params.seed + index)
            if grammar is not None:
                self.structured_output.add(child_id, grammar)
            self.scheduler.add_request(Request(child_id, prompt_token_ids, child_params,
                                               self.eos_token_id, parent_id=request_id,
                                               index=index, arrival_time=arrival_time,
                                               cache_salt=cache_salt))

    def _new_sequence_id(self) -> str:
        return f"seq-{next(self._sequence_ids)}"

    def sequence_ids(self, request_id: str) -> list[str]:
        """The internal IDs of a client request's sequences still in the engine (for tests and tools)."""
        return [sid for sid in self.children.get(request_id, ()) if sid in self.scheduler.requests]

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Stop requests (all their sequences) and free their blocks; unknown IDs are ignored."""
        for request_id in request_ids:
            self._discard(request_id)

    def _discard(self, request_id: str) -> list[Request]:
        """Forget a client request: finish (ABORT) its sequences still in the engine, which it returns."""
        ended = []
        for child_id in self.children.get(request_id, ()):
            request = self.scheduler.requests.get(child_id)
            if request is not None:
                self._finish(request, FinishReason.ABORT)
                ended.append(request)
        self._forget_request(request_id)
        return ended

    def _forget_request(self, request_id: str) -> None:
        """Drop a client request's bookkeeping (its sequences have ended)."""
        self.children.pop(request_id, None)
        self.beams.pop(request_id, None)
        self.deadline_of.pop(request_id, None)

    def _end_request(self, request_id: str, error: Optional[str] = None) -> list[EngineOutput]:
        """End a client request now: each sequence it still has gets a final ABORT output (with
        ``error``, if given) and frees its blocks. A beam search reports all its ``n`` indices."""
        search = self.beams.get(request_id)
        ended = self._discard(request_id)
        if search is not None:
            indices, num_prompt = range(search.width), len(search.prompt_token_ids)
        else:
            indices, num_prompt = [r.index for r in ended], ended[0].num_prompt_tokens if ended else 0
        cached = {r.index: max(r.num_cached_tokens, 0) for r in ended} if search is None else {}
        return [EngineOutput(request_id=request_id, index=index, new_token_ids=[],
                             finish_reason=FinishReason.ABORT, num_prompt_tokens=num_prompt,
                             num_cached_tokens=cached.get(index, 0), error=error)
                for index in indices]

    def _fail_request(self, request_id: str, message: str) -> list[EngineOutput]:
        """End a client request that failed inside the engine, alone, with ``message``; the rest
        of the batch goes on."""
        logger.warning("Request %r failed inside the engine and was ended: %s", request_id, message)
        return self._end_request(request_id, error=message)

    def abort_expired(self, now: Optional[float] = None) -> list[EngineOutput]:
        """Abort the requests whose deadline has passed (freeing their blocks); their
        sequences' final ABORT outputs."""
        now = time.monotonic() if now is None else now
        outputs: list[EngineOutput] = []
        while self.deadlines and self.deadlines[0][0] <= now:
            deadline, request_id = heapq.heappop(self.deadlines)
            # Gone: finished already; another deadline: a later request that reuses the ID.
            if self.deadline_of.get(request_id) == deadline:
                outputs.extend(self._end_request(request_id))
        if len(self.deadlines) > 2 * len(self.deadline_of) + 64:  # drop entries of finished requests
            self.deadlines = [(d, r) for d, r in self.deadlines if self.deadline_of.get(r) == d]
            heapq.heapify(self.deadlines)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._inflight is not None

    # ---- the step -------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """One engine step. A failure that belongs to one request (its grammar, sampling,
        logprobs, drafts, beam bookkeeping) ends that request with an error output and the step
        goes on; only a failure of the step itself (the executor, a worker, the device) raises.

        With async scheduling a call launches the next step, then processes the one launched
        by the call before (the first call returns no outputs; ``has_unfinished_requests`` stays
        true until the last step in flight is processed)."""
        if self.async_scheduling:
            return self._step_async()
        failed: dict[str, str] = {}  # internal sequence ID -> why it failed this step
        if self.proposer is not None:
            self._propose_drafts(failed)
        step = InFlightStep(self.scheduler.schedule(), failed=failed)
        if self.structured_output.has_matchers:
            step.sched.grammar = self.structured_output.grammar_bitmask(
                (s.request_id for s in step.sched.scheduled if s.needs_sample), step.failed)
        return self._process(step, self.executor.execute_model(step.sched))

    def _step_async(self) -> list[EngineOutput]:
        """Launch step N+1, then process step N while it runs (see backend/engine/inflight.py)."""
        sched = self.scheduler.schedule()
        launched = None
        if sched.scheduled or sched.finished_request_ids:
            launched = InFlightStep(sched, preemptions=self.scheduler.num_preemptions_total)
            if sched.scheduled and self.structured_output.has_matchers:
                launched.grammar = sched.grammar = LateGrammar()
            launched.future = self.executor.execute_model_async(sched)
        previous, self._inflight = self._inflight, launched
        try:
            return self._process(previous, previous.future.result()) if previous is not None else []
        finally:  # the runner waits on the grammar to sample: it is always resolved
            if launched is not None and launched.grammar is not None:
                self._fill_late_grammar(launched)

    def _fill_late_grammar(self, step: InFlightStep) -> None:
        """Step N+1's allowed tokens, now that step N's tokens advanced the grammars."""
        bitmask = None
        try:
            bitmask = self.structured_output.grammar_bitmask(
                (s.request_id for s in step.sched.scheduled if s.needs_sample), step.failed)
        finally:
            step.grammar.set_result(bitmask)

    def _process(self, step: InFlightStep, runner_out) -> list[EngineOutput]:
        """Apply a step's results: each sequence's tokens, stops and outputs; beam rounds."""
        outputs: list[EngineOutput] = []
        failed = step.failed
        failed.update(runner_out.failed)
        constrained = self.structured_output.has_matchers
        finished_rounds: list[BeamSearch] = []
        now = time.monotonic()
        requests = self.scheduler.requests
        # Preemptions since the step was launched, if any: their sequences' results are stale.
        since = step.preemptions if step.preemptions != self.scheduler.num_preemptions_total else None
        # The decode fast path (apply_decode_tokens) serves sequences that need nothing but their token.
        plain = not (constrained or self.beams or runner_out.prompt_logprobs or runner_out.pooled)
        num_decoded, generated_before, self._first_token_prompts = 0, self.num_generation_tokens_total, 0
        sampled, logprobs = runner_out.sampled_token_ids, runner_out.logprobs
        eos_token_ids, max_model_len, block_manager = self.eos_token_ids, self.config.max_model_len, self.block_manager
        scheduled, i = step.sched.scheduled, 0
        while i < len(scheduled):
            if plain:  # a run of plain decodes, in one loop (backend/engine/decode_step.py)
                j, ended, error = apply_decode_tokens(scheduled, i, requests, sampled, logprobs, since, failed,
                                                      eos_token_ids, max_model_len, block_manager, outputs)
                num_decoded += j - i - (error is not None)
                i = j
                if ended is not None:
                    try:
                        if error is not None:
                            raise error
                        self._finish(ended, outputs[-1].finish_reason)
                        self._forget_child(ended)
                    except Exception as error:  # noqa: BLE001 -- this request's bookkeeping: it alone ends
                        logger.exception("Updating request %r failed", ended.parent_id)
                        outputs.extend(self._fail_request(ended.parent_id, _failure_message(error)))
                    continue
                if i == len(scheduled):
                    break
            s = scheduled[i]
            i += 1
            request = requests.get(s.request_id)
            if request is None:  # ended since it was scheduled (a sibling failed, it stopped, an abort)
                continue
            if s.request_id in failed:
                outputs.extend(self._fail_request(request.parent_id, failed[s.request_id]))
                continue
            stale = since is not None and request.preempted_at > since
            try:
                self._update(request, s, runner_out, constrained, now, outputs, finished_rounds, stale)
            except Exception as error:  # noqa: BLE001 -- this request's bookkeeping: it alone ends
                logger.exception("Updating request %r failed", request.parent_id)
                outputs.extend(self._fail_request(request.parent_id, _failure_message(error)))
        self.num_generation_tokens_total += num_decoded
        step_tokens = self.num_generation_tokens_total - generated_before + self._first_token_prompts
        if step_tokens:
            self.iteration_tokens.observe(step_tokens)
        for search in finished_rounds:
            if self.beams.get(search.request_id) is not search:  # it failed meanwhile
                continue
            try:
                if search.advance():
                    outputs.extend(search.outputs())
                    self._forget_request(search.request_id)
                else:
                    self._start_beam_round(search)
            except Exception as error:  # noqa: BLE001
                logger.exception("Beam search %r failed", search.request_id)
                outputs.extend(self._fail_request(search.request_id, _failure_message(error)))
        return outputs

    def _update(self, request: Request, s, runner_out, constrained: bool, now: float,
                outputs: list[EngineOutput], finished_rounds: list[BeamSearch], stale: bool = False) -> None:
        """Apply one scheduled request's step results: computed tokens, sampled tokens, stops.
        ``stale``: preempted since the step was scheduled (only its sampled token counts)."""
        if request.draft_token_ids:
            request.draft_token_ids = []
        if s.start_pos + len(s.token_ids) <= len(request.prompt_token_ids):  # a prompt chunk
            self.num_prompt_tokens_computed_total += len(s.token_ids)
        if s.request_id in runner_out.prompt_logprobs:
            request.record_prompt_logprobs(*runner_out.prompt_logprobs[s.request_id])
        if not s.needs_sample:
            request.complete_step(s.num_tokens, 0, False, stale)
            if not stale:
                self.block_manager.cache_full_blocks(request, request.num_computed_tokens)
            return
        search = self.beams.get(request.parent_id) if self.beams else None
        if search is not None:  # a beam's one-token child (no drafts): its logprobs are the candidates
            request.complete_step(s.num_tokens, 0, True, stale)
            if not stale:
                self.block_manager.cache_full_blocks(request, request.num_computed_tokens)  # for the next round
            self.num_generation_tokens_total += 1
            self.num_prompt_tokens_total += len(request.prompt_token_ids)  # each child: its whole prompt
            self._finish(request, FinishReason.LENGTH)
            if search.record(request.request_id, runner_out.logprobs[s.request_id][0]):
                finished_rounds.append(search)
            return
        output, accepted = apply_sampled_tokens(
            request, s, runner_out, now, stale, self.eos_token_ids, self.config.max_model_len,
            self.block_manager, self._advance_grammar if constrained else None)
        outputs.append(output)
        self.num_generation_tokens_total += len(output.new_token_ids)
        if output.scheduled_time is not None:  # its first token (set on the first output only)
            self._first_token_prompts += output.num_prompt_tokens
            self.num_prompt_tokens_total += output.num_prompt_tokens
        self.num_draft_tokens_total += s.num_draft_tokens
        self.num_accepted_tokens_total += accepted
        reason = output.finish_reason
        if reason is not None:
            self._finish(request, reason)
            self._forget_child(request)

    def _start_beam_round(self, search: BeamSearch) -> None:
        children = search.next_children(self.eos_token_id, self._new_sequence_id)
        self.children[search.request_id] = [child.request_id for child in children]
        for child in children:
            self.scheduler.add_request(child)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.finish_request(request, reason)
        if self.structured_output.has_matchers:
            self.structured_output.remove((request.request_id,))

    def _advance_grammar(self, request: Request, token_id: int) -> Optional[FinishReason]:
        """Feed a kept token to the sequence's grammar: STOP once its text is complete."""
        try:
            complete = self.structured_output.accept(request.request_id, token_id)
        except GrammarViolation as error:  # no allowed token was left (see accept)
            logger.warning("%s; ending the sequence.", error)
            return FinishReason.ABORT
        return FinishReason.STOP if complete else None

    def _propose_drafts(self, failed: dict[str, str]) -> None:
        """N-gram drafts for this step (backend/core/spec_decode.py). Structured-output and
        beam-search sequences get none: a grammar's mask is filled for one position per step,
        and a beam child samples exactly one token."""
        def gets_drafts(request: Request) -> bool:
            return request.sampling_params.structured_outputs is None and request.parent_id not in self.beams

        for request, error in propose_drafts(self.scheduler.running, self.proposer, self.speculative,
                                             self.config.max_model_len, gets_drafts):
            logger.error("Drafting for request %r failed", request.parent_id, exc_info=error)
            failed[request.request_id] = _failure_message(error)  # it ends after this step

    def _forget_child(self, request: Request) -> None:
        siblings = self.children.get(request.parent_id)
        if siblings and all(sid not in self.scheduler.requests for sid in siblings):
            self._forget_request(request.parent_id)

    # ---- information ------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        cfg = self.config
        return ModelInfo(
            model_name=cfg.served_model_name, max_model_len=cfg.max_model_len,
            vocab_size=self.vocab_size, eos_token_ids=list(self.eos_token_ids),
            bos_token_id=getattr(cfg.hf_config, "bos_token_id", None),
            pad_token_id=getattr(cfg.hf_config, "pad_token_id", None),
            tokenizer_path=str(cfg.tokenizer_path), hidden_size=getattr(cfg.hf_config, "hidden_size", None))

    def get_load(self) -> EngineLoad:
        return EngineLoad(self.scheduler.num_running, self.scheduler.num_waiting,
                          self.block_manager.usage)

    def shutdown(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is not None:  # let the worker finish the step it runs
            if inflight.grammar is not None and not inflight.grammar.done():
                inflight.grammar.set_result(None)
            try:
                inflight.future.result()
            except Exception:  # noqa: BLE001 -- shutting down: its error was or will be reported
                logger.debug("The step in flight at shutdown failed", exc_info=True)
        self.structured_output.shutdown()
        self.executor.shutdown()
