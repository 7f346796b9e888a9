"""The model runner: weights, the KV cache, per-step input tensors, the forward pass, sampling.

It executes what the scheduler decided and never changes request state: it
reads ``SchedulerOutput`` and returns ``ModelRunnerOutput``.
"""

from __future__ import annotations

import logging
from operator import itemgetter
from pathlib import Path
from typing import Optional

import torch

from tandem_kernels import ops as kernels
from backend.distributed import get_parallel_state, pp_recv, pp_send
from backend.messages.runner_output import ModelRunnerOutput
from backend.messages.late_grammar import resolve_grammar
from backend.messages.scheduler_output import ScheduledRequest, SchedulerOutput
from backend.models.attention import Attention
from backend.models.gguf_packed import attach_packed_weights
from backend.models.int4_checkpoints import METHODS as CHECKPOINT_METHODS, attach_checkpoint_packs
from backend.models.linear import LinearBase
from backend.models.linear_methods import linear_method_for, runs_4bit_kernel
from backend.models.loader import iter_weights
from backend.models.registry import get_model_class
from backend.models.vocab_parallel import VocabParallelEmbedding
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.sampling_params import SamplingParams
from backend.worker import cuda_graphs
from backend.worker.block_tables import BlockTables
from backend.worker.deferred_step import DeferredStep
from backend.worker.draft_acceptance import accept_drafts
from backend.models.huge_pages import collapse_large_mappings, zeroed_tensor
from backend.worker.host_memory import host_memory_available
from backend.worker.pooler import Pooler
from backend.worker.logprobs import compute_prompt_logprobs
from backend.worker.sampler import Sampler
from backend.worker.sampling_rows import SamplingRows
from backend.worker.staged_upload import StagedUpload, list_tensor
from backend.worker.step_inputs import StepInputs, build_step_inputs

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.parallel = get_parallel_state()  # this worker's TP/PP place (set up before the runner)
        self.dtype = getattr(torch, config.torch_dtype_name)
        self.kv_dtype = getattr(torch, config.kv_cache_dtype_name)
        self.block_size = config.block_size
        self.model = None
        self.attn_layers: list[Attention] = []
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sampling = SamplingRows(device)  # seeded RNGs, the penalty history, each step's rows
        self.pooler = Pooler()  # embedding requests' pooled hidden states
        self.block_tables = BlockTables()  # each running sequence's table, extended step by step
        # Each sequence's last sampled token: what a placeholder in its next step's tokens stands for.
        self.last_sampled: dict[str, int] = {}
        self.pending: Optional[DeferredStep] = None  # the last deferred step, until read
        self.upload = StagedUpload(device)  # a step's input arrays -> the device, in one copy
        self.sampler = Sampler(self.upload)
        # Graphs of decode steps (cuda_graphs.py; None: every step eager; always so with enforce_eager).
        # Not captured over several workers: collectives inside a graph are not set up (yet).
        self.graph_cls = (None if config.enforce_eager or self.parallel.world_size > 1
                          else cuda_graphs.graph_class(device))
        self.graphs: Optional[cuda_graphs.DecodeGraphs] = None

    # ---- set-up -----------------------------------------------------------------

    def load_model(self) -> None:
        if self.device.type == "cpu":
            kernels.cpu.available()  # build (once per machine) or load the fused CPU kernels now
        model_cls = get_model_class(self.config.hf_config)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):  # rotary tables: max_model_len rows, not the config's maximum
                model = model_cls(self.config.hf_config, max_model_len=self.config.max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        weights = iter_weights(self.config.model_path)
        if self.config.quantization in CHECKPOINT_METHODS:  # AWQ / GPTQ layers packed, the rest loaded
            weights = attach_checkpoint_packs(model, weights, self.config.quantization, self.config.hf_config)
        if self.config.quantization == "gguf":  # the file's quantized layers packed, their weights left unread
            attach_packed_weights(model, Path(self.config.model).expanduser(), self.config.hf_config,
                                  self.config.model_path, int8_panels=self.config.int4_activations == "int8")
        model.load_weights(weights)
        method = linear_method_for(self.device, self.dtype, self.config.quantization, self.config.int4_activations)
        for module in model.modules():
            if isinstance(module, LinearBase):
                module.linear_method = method
                method.process_weights_after_loading(module)
        if self.config.int4_activations != "exact" and not any(map(runs_4bit_kernel, model.modules())):
            raise InvalidRequestError(
                f"int4_activations={self.config.int4_activations!r} applies to 4-bit layers, and "
                f"{self.config.model!r} has none (its quantized layers are 5 bits or more): leave it exact.",
                param="int4_activations")
        self.model = model.eval().requires_grad_(False)
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        if self.device.type == "cpu":  # the weights a decode step streams, onto 2 MB pages
            collapse_large_mappings(skip=self._gathered_only_tables())

    def _gathered_only_tables(self) -> list[tuple[int, int]]:
        """(start, nbytes) of each embedding table that no linear layer multiplies by (untied, or
        its tied head runs a form of its own): a step reads only its tokens' rows."""
        multiplied = {m.weight.data_ptr() for m in self.model.modules()
                      if isinstance(m, LinearBase) and not getattr(m, "weight_released", False)}
        return [(m.weight.data_ptr(), m.weight.nbytes) for m in self.model.modules()
                if isinstance(m, VocabParallelEmbedding) and m.weight.data_ptr() not in multiplied]

    def kv_bytes_per_block(self) -> int:
        layer = self.attn_layers[0]
        per_layer = 2 * self.block_size * layer.num_kv_heads * layer.head_dim
        return per_layer * len(self.attn_layers) * self.kv_dtype.itemsize

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit the memory budget (or the configured exact count)."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = self.config.kv_cache_memory_gb * 2 ** 30
        num_blocks = int(budget // self.kv_bytes_per_block())
        # More than every sequence at full length is never used.
        max_useful = self.config.max_num_seqs * -(-self.config.max_model_len // self.block_size)
        return max(1, min(num_blocks, max_useful))

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate and bind the KV cache, then capture the decode graphs (if any)."""
        # Graph padding rows write one scratch block past the scheduler's blocks.
        self._bind_kv_cache(num_blocks + (self.graph_cls is not None))
        if self.graph_cls is not None:
            self.graphs = cuda_graphs.DecodeGraphs(
                self.model, cuda_graphs.capture_sizes(self.config.max_num_seqs, self.device),
                max_blocks_per_seq=-(-self.config.max_model_len // self.block_size),
                max_model_len=self.config.max_model_len, pad_block=num_blocks, block_size=self.block_size,
                device=self.device, graph_cls=self.graph_cls)
            self.graphs.capture()

    def _bind_kv_cache(self, num_blocks: int) -> None:
        """Each layer's K and V cache (layout: ``tandem_kernels.ops.kv_cache_shape``). On the CPU
        the cache takes memory only as it is written, so one larger than the host's available
        memory is refused here (``host_memory_available``) rather than killed later under load."""
        if self.device.type == "cpu":
            self._check_host_memory(num_blocks * self.kv_bytes_per_block())
        self.kv_caches = []
        for layer in self.attn_layers:
            shape = kernels.kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            kv = (self._zeroed_cache(shape), self._zeroed_cache(shape))
            layer.kv_cache = kv
            self.kv_caches.append(kv)

    def _check_host_memory(self, cache_bytes: int) -> None:
        available = host_memory_available()
        if available is not None and cache_bytes > available:
            raise RuntimeError(
                f"The KV cache needs {cache_bytes / 2 ** 30:.2f} GiB, but only {available / 2 ** 30:.2f} GiB of "
                "host memory is available (MemAvailable, and the cgroup's limit): lower kv_cache_memory_gb "
                "(--kv-cache-memory-gb) or num_kv_blocks.")

    def _zeroed_cache(self, shape) -> torch.Tensor:
        """One layer's K or V cache, zeroed; on the CPU zeroed by the kernel as its pages are first
        written, on 2 MB pages (backend.models.huge_pages.zeroed_tensor)."""
        if self.device.type == "cpu":
            return zeroed_tensor(tuple(shape), self.kv_dtype)
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _cuda_kv_budget(self) -> float:
        """Bytes left for the KV cache: gpu_memory_utilization of the device's memory, less
        what is in use now (weights, CUDA context, other processes) and less the peak a
        step adds on top (measured by a profiling step at max_num_batched_tokens)."""
        activation_peak = self._profile_step_memory()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.gpu_memory_utilization - (total - free) - activation_peak
        logger.info("GPU memory: %.2f GiB total, %.2f GiB in use, %.2f GiB step peak -> %.2f GiB for the "
                    "KV cache (gpu_memory_utilization=%.2f)", total / 2 ** 30, (total - free) / 2 ** 30,
                    activation_peak / 2 ** 30, budget / 2 ** 30, self.config.gpu_memory_utilization)
        if budget <= 0:
            raise RuntimeError(f"No GPU memory left for the KV cache at gpu_memory_utilization="
                               f"{self.config.gpu_memory_utilization}; raise it or lower "
                               "max_num_batched_tokens.")
        return budget

    def _profile_step_memory(self) -> int:
        """Peak bytes the profiling step allocates beyond what exists before it (its
        throwaway KV cache not counted)."""
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        kv_bytes = self.profile_step()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - base - kv_bytes

    def profile_step(self) -> int:
        """Run the largest step the scheduler can form: a prefill of max_num_batched_tokens
        tokens over up to max_num_seqs requests, sampled with top-k/p, on a throwaway KV
        cache that is unbound afterwards. Returns that cache's bytes."""
        tokens = min(self.config.max_num_batched_tokens, self.config.max_num_seqs * self.config.max_model_len)
        num_reqs = min(self.config.max_num_seqs, tokens)
        lens = [tokens // num_reqs + (i < tokens % num_reqs) for i in range(num_reqs)]
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)
        scheduled, next_block = [], 0
        for i, n in enumerate(lens):
            blocks = list(range(next_block, next_block + -(-n // self.block_size)))
            next_block += len(blocks)
            scheduled.append(ScheduledRequest(f"profile-{i}", [0] * n, 0, blocks, True, params,
                                              [0] * n, [], None))
        self._bind_kv_cache(next_block)
        kv_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv_caches)
        try:
            self.execute_model(SchedulerOutput(scheduled, tokens))
        finally:
            for layer in self.attn_layers:
                layer.kv_cache = None
            self.kv_caches = []
        return kv_bytes

    # ---- one step -----------------------------------------------------------------

    def _prepare_inputs(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        return build_step_inputs(scheduled, self.block_size, self.block_tables, self.last_sampled, self.upload,
                                 self.pending)

    def _forward(self, inputs: StepInputs) -> Optional[torch.Tensor]:
        """The model's forward on this pipeline stage: receive the previous stage's activations,
        run this stage's layers, and pass them on (None) or return the final hidden states."""
        if self.graphs is not None and self.graphs.fits(inputs.meta):  # one worker only
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        parallel, intermediate = self.parallel, None
        if not parallel.is_first_stage:
            shape = (inputs.input_ids.shape[0], self.model.pp_hidden_size)
            intermediate = pp_recv(self.model.pp_tensor_names, shape, self.dtype, self.device, parallel)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, intermediate)
        if not parallel.is_last_stage:
            pp_send(hidden, parallel)
            return None
        return hidden

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return its results."""
        out = self.launch(sched, defer=False)
        assert isinstance(out, ModelRunnerOutput)
        return out

    def read(self, step: DeferredStep) -> ModelRunnerOutput:
        """A deferred step's results, once its tokens are on the host (waits for them)."""
        out = step.read()
        if self.pending is step:
            self.pending = None
        self._record_sampled(out, count_penalties=not step.penalties_counted)
        return out

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, defer: bool, greedy: bool = False) -> ModelRunnerOutput | DeferredStep:
        """Run one step. defer (only where ``deferral(sched)`` allows): return once its kernels
        are queued, its tokens still on the device, as a ``DeferredStep`` for ``read``; greedy:
        ``deferral`` found every token an argmax (no sampling rows to build)."""
        for request_id in sched.finished_request_ids:
            self.last_sampled.pop(request_id, None)
            if self.pending is not None:
                self.pending.forget(request_id)
        self.block_tables.release(sched.finished_request_ids)
        self.pooler.release(sched.finished_request_ids)
        self.sampling.release(sched.finished_request_ids)
        out = ModelRunnerOutput()
        if not sched.scheduled:
            return out
        inputs = self._prepare_inputs(sched.scheduled)
        hidden = self._forward(inputs)  # [num_tokens, hidden]; None before the last pipeline stage
        if hidden is not None and any(s.sampling_params.pooling is not None for s in sched.scheduled):
            self.pooler.step(sched.scheduled, hidden, out)
        if hidden is None or not inputs.logits_rows:
            return out
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_index))  # [num_rows, vocab]
        if logits is None:  # a TP rank other than 0: rank 0 holds the gathered logits and samples
            return out

        for s, first, count, start in inputs.prompt_rows:
            targets = s.prompt_token_ids[start + 1:start + 1 + count]
            try:
                out.prompt_logprobs[s.request_id] = (start + 1, compute_prompt_logprobs(
                    logits[first:first + count], targets, s.sampling_params.prompt_logprobs))
            except Exception as error:  # noqa: BLE001 -- this request's alone (see _request_failure)
                out.failed[s.request_id] = _request_failure(error, "prompt logprobs")

        if defer:  # deferral: one row per sequence, the logits' rows in order, nothing read back
            counted = False
            if greedy:
                tokens = kernels.argmax_rows(logits)
                request_ids = [s.request_id for s, _, _ in inputs.sample_rows]
            else:
                batch = self.sampling.batch(inputs.sample_rows, logits.shape[1])
                counted = bool(batch.slots)  # counted on the device, before the next step's penalties read them
                tokens = self.sampler.sample_on_device(logits, batch.rows, self.sampling.history, batch.classes,
                                                       count=counted)
                request_ids = batch.request_ids
            self.pending = DeferredStep(out, request_ids, tokens, penalties_counted=counted)
            return self.pending
        if inputs.sample_rows:
            if len(inputs.sample_rows) != len(inputs.logits_rows):  # else every row samples, in order
                index = [i for _, i, _ in inputs.sample_rows]
                logits = logits.index_select(0, list_tensor(index, device=self.device))
            counted = self._sample(logits, inputs.sample_rows, resolve_grammar(sched.grammar), out)
            self._record_sampled(out, count_penalties=not counted)
        return out

    def _record_sampled(self, out: ModelRunnerOutput, count_penalties: bool = True) -> None:
        """Keep each sequence's last token (for placeholders) and count penalized ones' tokens
        (unless counted on the device already)."""
        history = self.sampling.history
        sampled = out.sampled_token_ids
        self.last_sampled.update(zip(sampled.keys(), map(itemgetter(-1), sampled.values())))
        if history is not None and count_penalties:
            history.record_all(out.sampled_token_ids)
        for request_id in out.failed:
            self.last_sampled.pop(request_id, None)

    def _sample(self, logits: torch.Tensor, sample_rows: list[tuple[ScheduledRequest, int, int]],
                grammar, out: ModelRunnerOutput) -> bool:
        """Sample every request's rows at once (logits: [num_sample_rows, vocab]); should that
        raise, sample request by request, so one request's failure (its parameters, seed, grammar
        mask, drafts) lands in ``out.failed`` and every other request still gets its tokens.
        Returns whether the penalized requests' tokens are recorded in the penalty history."""
        if grammar is None and all(s.sampling_params.argmax_only and not s.num_draft_tokens
                                   for s, _, _ in sample_rows):
            # Hot path: every row is a plain greedy pick (no drafts, masks, logprobs or penalties).
            token_ids = kernels.argmax_rows(logits).tolist()
            out.sampled_token_ids.update(zip([s.request_id for s, _, _ in sample_rows], [[t] for t in token_ids]))
            return False
        allowed = None
        if grammar is not None:  # structured outputs: only then is there work here
            # Constrained requests get no drafts (LLMEngine._propose_drafts): one row each.
            allowed = grammar.for_sampler_rows([s.request_id for s, _, _ in sample_rows])
        try:
            batch = self.sampling.batch(sample_rows, logits.shape[1])
            # One row each, no logprobs: the penalized rows' tokens are counted on the device.
            fast = batch.one_row_each and not batch.classes.logprobs
            counted = fast and bool(batch.slots)
            sampled = self.sampler(logits, batch.rows, allowed, self.sampling.history, batch.classes, counted)
            if fast:
                out.sampled_token_ids.update(zip(batch.request_ids, [[t] for t in sampled.token_ids]))
                return counted
            for s, first, count in _groups(sample_rows):
                self._take_tokens(s, sampled, first, count, out)
            return False
        except Exception as error:  # noqa: BLE001
            if _is_device_fault(error):
                raise
            self.sampling.forget_batch()
            logger.warning("Sampling the batch failed (%s: %s); sampling request by request",
                           type(error).__name__, error)
        out.sampled_token_ids.clear()
        out.logprobs.clear()
        for s, first, count in _groups(sample_rows):
            try:
                slots = self.sampling.penalty_slots([s], logits.shape[1])
                rows = [self.sampling.row(s, j, slots) for j in range(count)]
                sub_allowed = allowed.subset(first, count) if allowed is not None else None
                sampled = self.sampler(logits[first:first + count], rows, sub_allowed, self.sampling.history)
                self._take_tokens(s, sampled, 0, count, out)
            except Exception as error:  # noqa: BLE001
                if _is_device_fault(error):
                    raise
                out.sampled_token_ids.pop(s.request_id, None)
                out.logprobs.pop(s.request_id, None)
                out.failed[s.request_id] = _request_failure(error, "sampling")
        return False

    @staticmethod
    def _take_tokens(s: ScheduledRequest, sampled, first: int, count: int, out: ModelRunnerOutput) -> None:
        """Record one request's tokens from its ``count`` sampled rows starting at ``first``."""
        tokens = sampled.token_ids[first:first + count]
        if s.num_draft_tokens:
            tokens = accept_drafts(s.token_ids[-s.num_draft_tokens:], tokens)
        out.sampled_token_ids[s.request_id] = tokens
        if s.sampling_params.wants_logprobs:
            out.logprobs[s.request_id] = sampled.logprobs[first:first + len(tokens)]


def _is_device_fault(error: BaseException) -> bool:
    """A failure of the device rather than of one request's inputs: out of memory, or a CUDA
    error (after which the context is unusable). These stop the engine; others end one request."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return "CUDA error" in str(error) or "device-side assert" in str(error)


def _request_failure(error: BaseException, stage: str) -> str:
    if _is_device_fault(error):
        raise error
    logger.warning("A request's %s failed: %s: %s", stage, type(error).__name__, error)
    return f"The request's {stage} failed inside the engine: {type(error).__name__}: {error}"


def _groups(sample_rows: list[tuple[ScheduledRequest, int, int]]) -> list[tuple[ScheduledRequest, int, int]]:
    """(request, first sample row, row count) per request: one request's rows are consecutive."""
    groups = []
    start = 0
    while start < len(sample_rows):
        s = sample_rows[start][0]
        groups.append((s, start, s.num_draft_tokens + 1))
        start += s.num_draft_tokens + 1
    return groups
