"""Host time per decode step, measured on a simulated device.

    python bench/host_overhead.py                          # the full matrix, ~3-5 min on 2 cores
    python bench/host_overhead.py --batches 256 --contexts 1024 --device-ms 2
    python bench/host_overhead.py --json host_overhead.json

The engine runs for real, in this process (the ``uni`` executor): scheduling, the block
manager, input preparation, sampling, penalties, structured-output masks, output processing.
Only the model is simulated. The model is a tiny random Llama (1 layer, 64 wide, vocabulary
512), and its forward is replaced by a simulated device that does no arithmetic. It models a
GPU's queue: a step's forward queues D ms of device work and returns at once, and reading the
step's tokens waits in ``time.sleep`` (which releases the GIL, as a wait on a GPU does) until
that work has ended. With async scheduling greedy decode steps are left pending until the next
is queued, as on CUDA (backend/executor/uni.py). The logits are a fixed random tensor per
row count, so the sampler does its real work on them. Decode graphs are off
(``enforce_eager``): a captured graph would run the real model and bypass the simulated forward.

For each batch size B and context C, B sequences with distinct random C-token prompts are
prefilled. Then N decode steps are timed at D = 0 and at each ``--device-ms``. Each is done
with plain greedy sampling and with penalties (repetition 1.1, presence 0.5, frequency 0.5);
one point (``--structured``) also runs with every sequence constrained by a JSON Schema.
Reported, as medians over the timed steps:

- host ms: a step's wall time minus the time spent waiting for the simulated device, at D = 0.
  This is the work a GPU would wait on if nothing overlapped it. With async scheduling
  (``--scheduling async``: each step is launched before the one before is processed; a plain
  decode step on the engine's thread, any other on the executor's step thread) it is the period
  at D = 0: the host's work per step;
- period at D: a step's wall time with the device busy D ms per step. Host work hidden
  behind the device gives period ~ max(D, host); host work that is not hidden gives
  period ~ D + host. The table also gives period / max(D, host): 1.0 when the host is
  fully hidden, (D + host) / max(D, host) when host and device take turns.

Host times on a 2-core machine depend on it being otherwise idle: torch's two-thread
parallel regions wait for a core another process holds (~8 ms per region on a loaded
machine). Measure when the 1-minute load average is low (the report gives it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

# Run as a script, bench/ is sys.path[0]: the repository's root goes there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from backend.engine.llm_engine import LLMEngine  # noqa: E402
from backend.types.config import EngineConfig  # noqa: E402
from backend.types.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from backend.types.startup_heap import tune_gc_for_serving  # noqa: E402
from backend.worker.deferred_step import DeferredStep  # noqa: E402

HIDDEN = 64
VOCAB = 512
BLOCK_SIZE = 16
MAX_POSITIONS = 32768  # room for 16k-token contexts and beyond
PREFILL_BUDGET = 65536  # tokens per step: a 256 x 16k prefill in 64 steps (decode steps use ~batch)
# A schema whose text is mostly one free string: the constrained sequences stay inside it
# (see SimulatedDevice.logits), as a long JSON answer spends most of its tokens in values.
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
MIN_STEPS = 3
PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
VARIANTS = ("plain", "penalties", "structured")


def make_checkpoint(out_dir: Path) -> Path:
    """A random-weight 1-layer Llama with a small byte-level BPE tokenizer, saved to out_dir."""
    import transformers as T
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    T.logging.disable_progress_bar()
    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=1, vocab_size=VOCAB,
                           max_position_embeddings=MAX_POSITIONS, bos_token_id=None, eos_token_id=None,
                           pad_token_id=None)
    T.LlamaForCausalLM(config).save_pretrained(str(out_dir))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [json.dumps({"answer": f"item {i} of the list, with some words and numbers {i * 37}"})
              for i in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    T.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<|endoftext|>").save_pretrained(str(out_dir))
    return out_dir


def _precise_sleeps() -> None:
    """Linux wakes a sleeping thread up to 50 us late (timer slack); 1 ns makes a simulated
    D ms step last D ms, not D + 0.07 (best effort, per thread)."""
    try:
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        pass


class SimulatedDevice:
    """Stands in for the model runner's forward and logits (patched onto one runner).

    It models a GPU's queue: the forward queues ``device_ms`` of work and returns at once, as a
    CUDA launch does; the queue runs in order (a step's work starts when the one before ends).
    Reading a step's tokens waits, sleeping (so the GIL is free), until that step's work has
    ended: in the synchronous sampling path (``_sample``), or when a deferred step is read
    (async scheduling leaves greedy decode steps pending, as on CUDA). The hidden states are a
    zero buffer cut to the step's token count. The logits are a copy of a fixed random
    [rows, vocab] tensor for that row count; a copy, because the grammar mask is applied to the
    logits in place. ``busy_s`` adds up the time the host spent waiting for the device.
    """

    def __init__(self, runner, max_tokens: int) -> None:
        self.device_ms = 0.0
        self.busy_s = 0.0
        self.free_at = 0.0  # when the queued work ends (perf_counter seconds)
        self._hidden = torch.zeros(max_tokens, HIDDEN, dtype=runner.dtype)  # [max_tokens, hidden]
        self._logits: dict[int, torch.Tensor] = {}
        self._quote_tokens = _tokens_with_quote(runner.config.tokenizer_path)
        self._threads_set_up: set[int] = set()
        runner._forward = self.forward
        runner.model.compute_logits = self.compute_logits
        runner.model.forward = _model_must_not_run  # a path around the simulated forward fails loudly
        sample, launch, read = runner._sample, runner.launch, runner.read

        def sample_when_done(*args, **kwargs):
            self.wait(self.free_at)  # the synchronous path reads the tokens of the step just queued
            return sample(*args, **kwargs)

        def launch_marking_its_end(sched, defer, greedy=False):
            step = launch(sched, defer, greedy)
            if isinstance(step, DeferredStep):
                step.simulated_end = self.free_at
            return step

        def read_when_done(step):
            self.wait(step.simulated_end)
            return read(step)

        runner._sample, runner.launch, runner.read = sample_when_done, launch_marking_its_end, read_when_done

    def forward(self, inputs) -> torch.Tensor:
        if threading.get_ident() not in self._threads_set_up:
            _precise_sleeps()
            self._threads_set_up.add(threading.get_ident())
        self.free_at = max(time.perf_counter(), self.free_at) + self.device_ms / 1e3
        return self._hidden[:inputs.input_ids.shape[0]]  # [num_tokens, hidden]

    def wait(self, until: float) -> None:
        if threading.get_ident() not in self._threads_set_up:
            _precise_sleeps()
            self._threads_set_up.add(threading.get_ident())
        start = time.perf_counter()
        while (left := until - time.perf_counter()) > 0:
            time.sleep(left)
        self.busy_s += time.perf_counter() - start

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden.shape[0]).clone()  # [rows, vocab]

    def logits(self, rows: int) -> torch.Tensor:
        """Fixed random logits for ``rows`` rows. Tokens holding a double quote are the least
        likely, so a greedy constrained sequence never closes its JSON string and the batch
        stays full for the whole run."""
        if rows not in self._logits:
            generator = torch.Generator().manual_seed(rows)
            logits = torch.randn(rows, VOCAB, generator=generator)
            logits[:, self._quote_tokens] = -20.0
            self._logits[rows] = logits
        return self._logits[rows]


def _model_must_not_run(*args, **kwargs):
    raise AssertionError("the real model ran: a step bypassed the simulated forward")


def _tokens_with_quote(tokenizer_path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    return [i for i in range(len(tokenizer)) if '"' in tokenizer.decode([i])]


@dataclass
class Point:
    """One (batch, context, variant): its medians and every timed step."""

    batch: int
    context: int
    variant: str
    scheduling: str = "sync"  # or "async" (EngineConfig.async_scheduling)
    host_ms: float = math.nan  # at D = 0: wall - time inside the simulated device (async: the period)
    period_ms: dict[str, float] = field(default_factory=dict)  # str(D) -> median step wall time
    device_ms_elapsed: dict[str, float] = field(default_factory=dict)  # str(D) -> median device time
    steps_ms: dict[str, list[float]] = field(default_factory=dict)  # str(D) -> every step's wall time
    load_average: float = math.nan  # the machine's 1-minute load average once the point was timed
    # At D = 0: the engine thread's own CPU time per step (min, median), which the load of other
    # processes on the machine barely moves (async: a step run on the step thread is not in it)
    engine_cpu_ms: tuple[float, float] = (math.nan, math.nan)


def sampling_params(variant: str) -> SamplingParams:
    """Greedy, no EOS, no max_tokens: every sequence runs until the bench aborts it."""
    extra = {"penalties": PENALTIES,
             "structured": dict(structured_outputs=StructuredOutputsParams(json=SCHEMA))}.get(variant, {})
    return SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, **extra)


def run_point(engine: LLMEngine, device: SimulatedDevice, batch: int, context: int, variant: str,
              device_ms: list[float], steps: int, warmup: int, max_seconds: float, seed: int) -> Point:
    """Prefill ``batch`` sequences of ``context`` prompt tokens, then time ``steps`` decode steps
    at each D (fewer, but at least MIN_STEPS, once a D has taken ``max_seconds``)."""
    rng = random.Random(seed)
    params = sampling_params(variant)
    grammar = engine.structured_output.compile(params.structured_outputs) if variant == "structured" else None
    ids = [f"{variant}-{batch}-{context}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(VOCAB) for _ in range(context)], params, grammar=grammar)
    device.device_ms = 0.0
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()  # the prefill (and each sequence's first token)
    point = Point(batch, context, variant, "async" if engine.async_scheduling else "sync")
    for d in [0.0, *device_ms]:
        device.device_ms = d
        walls, busy, cpu = [], [], []
        began = time.perf_counter()
        for i in range(warmup + steps):
            if len(walls) >= min(steps, MIN_STEPS) and time.perf_counter() - began > max_seconds:
                break  # a slow point: enough steps to take a median of
            device.busy_s = 0.0
            start, start_cpu = time.perf_counter(), time.thread_time()
            outputs = engine.step()
            wall, step_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
            if len(outputs) != batch or any(o.finish_reason is not None for o in outputs):
                ended = {(o.finish_reason, o.error) for o in outputs if o.finish_reason is not None}
                raise RuntimeError(f"{batch} x {context} {variant}: the batch did not stay full "
                                   f"({len(outputs)} outputs; ended: {ended})")
            if i >= warmup:
                walls.append(wall)
                busy.append(device.busy_s)
                cpu.append(step_cpu)
        key = f"{d:g}"
        point.steps_ms[key] = [round(w * 1e3, 4) for w in walls]
        point.period_ms[key] = statistics.median(walls) * 1e3
        point.device_ms_elapsed[key] = statistics.median(busy) * 1e3
        if d == 0.0:
            point.engine_cpu_ms = (min(cpu) * 1e3, statistics.median(cpu) * 1e3)
            point.host_ms = (statistics.median(walls) if engine.async_scheduling
                             else statistics.median(w - b for w, b in zip(walls, busy))) * 1e3
    point.load_average = os.getloadavg()[0]
    engine.abort_request(ids)
    return point


def build_engine(checkpoint: Path, max_batch: int, max_context: int, max_decode: int,
                 async_scheduling: bool = False) -> LLMEngine:
    """max_decode: decode steps after the prefill; sequences prefilled first also decode while
    the others prefill, up to one token per prefill step."""
    budget = max(PREFILL_BUDGET, max_batch)
    max_model_len = max_context + max_decode + -(-max_batch * max_context // budget) + BLOCK_SIZE
    num_blocks = max_batch * -(-max_model_len // BLOCK_SIZE)
    engine = LLMEngine(EngineConfig(
        model=str(checkpoint), dtype="float32", device="cpu", distributed_executor_backend="uni",
        enforce_eager=True, block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, max_model_len=max_model_len,
        max_num_seqs=max(max_batch, 1), max_num_batched_tokens=budget,
        grammar_compile_workers=2, async_scheduling=async_scheduling))
    if engine.async_scheduling:  # greedy decode steps left pending on the device, as on CUDA
        engine.executor.defer_steps = True
    return engine


def markdown_table(points: list[Point], device_ms: list[float]) -> str:
    head = "| batch | context | sampling | scheduling | host ms / step |"
    rule = "|---|---|---|---|---|"
    for d in device_ms:
        head += f" period at D = {d:g} ms | period / max(D, host) |"
        rule += "---|---|"
    lines = [head, rule]
    for p in points:
        line = f"| {p.batch} | {p.context:,} | {p.variant} | {p.scheduling} | {p.host_ms:.2f} |"
        for d in device_ms:
            period = p.period_ms[f"{d:g}"]
            line += f" {period:.2f} | {period / max(d, p.host_ms):.2f} |"
        lines.append(line)
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Optional[list[str]] = None) -> list[Point]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=_ints, default=[1, 64, 256], help="comma-separated batch sizes")
    parser.add_argument("--contexts", type=_ints, default=[1024, 4096, 16384],
                        help="comma-separated prompt lengths (tokens cached per sequence)")
    parser.add_argument("--device-ms", type=lambda s: [float(x) for x in s.split(",") if x], default=[0.5, 2.0],
                        help="simulated device time per step, ms (D = 0 always runs, for the host time)")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=["plain", "penalties"],
                        help=f"sampling at every point, of {', '.join(VARIANTS[:2])}")
    parser.add_argument("--structured", default="64x1024",
                        help="BxC: the point that also runs with a JSON Schema on every sequence ('' for none)")
    parser.add_argument("--scheduling", type=lambda s: s.split(","), default=["sync", "async"],
                        help="comma-separated: sync and/or async (async scheduling), each a run of the matrix")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per D")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps before each D")
    parser.add_argument("--max-seconds", type=float, default=8.0,
                        help=f"stop timing a D after this long, once {MIN_STEPS} steps are timed")
    parser.add_argument("--checkpoint", type=Path, help="reuse this tiny checkpoint (default: a fresh one)")
    parser.add_argument("--gc-default", action="store_true",
                        help="CPython's collector settings (the server freezes the start-up heap, which a "
                             "full collection then walks, a pause of 100+ ms, and makes young collections rare)")
    parser.add_argument("--json", type=Path, help="also write every point (and each step's time) here")
    args = parser.parse_args(argv)
    if not all(v in VARIANTS[:2] for v in args.variants):
        parser.error(f"--variants takes {', '.join(VARIANTS[:2])}")
    if not args.scheduling or not set(args.scheduling) <= {"sync", "async"}:
        parser.error("--scheduling takes sync, async or both")
    if any(x < 1 for x in args.batches + args.contexts) or args.steps < 1 or args.warmup < 0:
        parser.error("batches, contexts and --steps must be positive, --warmup not negative")
    plan = [(b, c, v) for b in args.batches for c in args.contexts for v in args.variants]
    if args.structured:
        try:
            b, c = (int(x) for x in args.structured.split("x"))
        except ValueError:
            parser.error(f"--structured takes BxC, such as 64x1024, not {args.structured!r}")
        if b < 1 or c < 1:
            parser.error("--structured: batch and context must be positive")
        plan.append((b, c, "structured"))

    max_decode = (len(args.device_ms) + 1) * (args.steps + args.warmup) + 8
    max_batch = max(b for b, _, _ in plan)
    max_context = max(c for _, c, _ in plan)
    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as scratch:
        checkpoint = args.checkpoint or make_checkpoint(Path(scratch))
        points = []
        for scheduling in args.scheduling:
            engine = build_engine(checkpoint, max_batch, max_context, max_decode, scheduling == "async")
            if not args.gc_default:
                tune_gc_for_serving()  # as the backend server does once its engine is up
            try:
                runner = engine.executor.worker.runner
                device = SimulatedDevice(runner, engine.config.max_num_batched_tokens)
                for i, (b, c, v) in enumerate(plan):
                    start = time.perf_counter()
                    points.append(run_point(engine, device, b, c, v, args.device_ms, args.steps, args.warmup,
                                            args.max_seconds, seed=i))
                    slowest = max(max(steps) for steps in points[-1].steps_ms.values())
                    low, median = points[-1].engine_cpu_ms
                    print(f"# {b} x {c:,} {v} {scheduling}: host {points[-1].host_ms:.2f} ms/step, engine thread CPU "
                          f"min {low:.2f} / median {median:.2f} ms, slowest step {slowest:.1f} ms "
                          f"({time.perf_counter() - start:.1f} s, load {points[-1].load_average:.2f})",
                          file=sys.stderr, flush=True)
                kv_mib = engine.block_manager.num_blocks * runner.kv_bytes_per_block() / 2 ** 20
            finally:
                engine.shutdown()

    machine = {"cpu": _cpu_model(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
               "torch": torch.__version__, "python": platform.python_version(),
               "load_average_before": load_before, "load_average_after": list(os.getloadavg())}
    print(markdown_table(points, args.device_ms))
    print(f"\nModel: 1-layer Llama, {HIDDEN} wide, vocabulary {VOCAB}, fp32, blocks of {BLOCK_SIZE} tokens, "
          f"{kv_mib:.0f} MiB of KV cache; greedy; medians of {args.steps} steps after {args.warmup} "
          f"(at least {MIN_STEPS} where a D took over {args.max_seconds:g} s). {machine['cpu']}, "
          f"{machine['cpus']} CPUs, torch {machine['torch']} ({machine['torch_threads']} threads), "
          f"Python {machine['python']}; 1-minute load average {load_before[0]:.2f} before, "
          f"{machine['load_average_after'][0]:.2f} after.")
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join(["python", "bench/host_overhead.py", *(argv if argv is not None else sys.argv[1:])]),
            "device_ms": args.device_ms, "steps": args.steps, "warmup": args.warmup, "machine": machine,
            "model": {"layers": 1, "hidden": HIDDEN, "vocab": VOCAB, "dtype": "float32", "block_size": BLOCK_SIZE,
                      "kv_cache_mib": round(kv_mib, 1)},
            "points": [asdict(p) for p in points]}, indent=1))
    return points


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
