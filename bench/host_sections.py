"""Where a decode step's host time goes: the engine thread's CPU time in each part of the step.

    python bench/host_sections.py                               # 256 x 1k and 256 x 16k, plain
    python bench/host_sections.py --batch 256 --contexts 1024 --variant penalties --steps 200

The engine and its simulated device are ``bench/host_overhead.py``'s (sync scheduling, D = 0).
After the prefill, each part of ``--steps`` decode steps is timed by the thread's CPU time
(``time.thread_time``, which other processes on the machine barely move): the scheduler, the
step's input tensors, sampling, the engine's output processing, and the whole step. Reported
per part: the minimum and the median, in ms. Run it with ``OMP_NUM_THREADS=1`` on a shared
machine (torch's parallel regions otherwise wait for a core another process holds).
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

# Run as a script, bench/ is sys.path[0]: host_overhead puts the repository's root there.
import host_overhead as H  # noqa: E402

PARTS = (("scheduler", "schedule"), ("runner", "_prepare_inputs"), ("runner", "_sample"),
         ("engine", "_process"), ("engine", "step"))
LABELS = {"schedule": "scheduler", "_prepare_inputs": "input tensors", "_sample": "sampling",
          "_process": "engine outputs", "step": "whole step"}


def _timed(function: Callable, samples: list[float]) -> Callable:
    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            samples.append(time.thread_time() - start)
    return timed


def measure(checkpoint: Path, batch: int, context: int, variant: str, steps: int) -> dict[str, list[float]]:
    """Each part's CPU seconds in each of ``steps`` decode steps of ``batch`` x ``context``."""
    engine = H.build_engine(checkpoint, batch, context, steps + 16)
    H.tune_gc_for_serving()  # as the backend server does once its engine is up
    try:
        runner = engine.executor.worker.runner
        H.SimulatedDevice(runner, engine.config.max_num_batched_tokens)  # D = 0: patched onto the runner
        rng = random.Random(0)
        params = H.sampling_params(variant)
        for i in range(batch):
            engine.add_request(f"r{i}", [rng.randrange(H.VOCAB) for _ in range(context)], params)
        while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
            engine.step()  # the prefill
        for _ in range(4):
            engine.step()  # warm-up
        owners = {"scheduler": engine.scheduler, "runner": runner, "engine": engine}
        samples: dict[str, list[float]] = collections.defaultdict(list)
        for owner, name in PARTS:  # instance attributes shadow the methods for this engine only
            setattr(owners[owner], name, _timed(getattr(owners[owner], name), samples[LABELS[name]]))
        for _ in range(steps):
            engine.step()
        return samples
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 16384])
    parser.add_argument("--variant", choices=H.VARIANTS[:2], default="plain")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print("| batch x context | " + " | ".join(LABELS.values()) + " |")
    print("|---|" + "---|" * len(LABELS))
    with tempfile.TemporaryDirectory(prefix="host-sections-") as scratch:
        checkpoint = H.make_checkpoint(Path(scratch))
        for context in args.contexts:
            samples = measure(checkpoint, args.batch, context, args.variant, args.steps)
            cells = [f"{min(samples[label]) * 1e3:.3f} / {statistics.median(samples[label]) * 1e3:.3f}"
                     for label in LABELS.values()]
            print(f"| {args.batch} x {context:,} {args.variant} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nEngine-thread CPU ms per decode step, min / median of {args.steps} steps (sync, D = 0).",
          file=sys.stderr)


if __name__ == "__main__":
    main()
