"""Where a decode step's time goes: Python (cProfile) and the device (torch.profiler), per batch.

    python bench/step_profile.py --out /tmp/step_profile.md              # on a GPU: the 1B config
    python bench/step_profile.py --tiny --out /tmp/step_profile.md       # CPU rehearsal, tiny shapes

First the wall ms per decode step on an engine with the device's default scheduling (async on
CUDA), greedy and with temperature sampling. Then, on an engine without async scheduling, for
each batch size B, B random prompts of --context tokens are prefilled (untimed), and
--steps greedy decode steps are timed three times: plain (wall ms per step), under cProfile (the
functions with the most own time, so the host's Python cost shows), and under torch.profiler
(the device's busy time per step, and the ops that take it). Wall minus device busy is the time
the device waited on the host. Models are the dummy-weight configs of bench/gpu_check.py.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script, bench/ is sys.path[0]: the repository's root goes there
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    if "--tiny" in sys.argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from bench.gpu_models import CONFIGS, Plan, build_checkpoint, make_engine, random_prompts, release


# Sampling of the async wall-time rows: name -> SamplingParams fields (greedy is profiled too).
SAMPLING = {"greedy": dict(temperature=0.0), "temperature 0.8, top-k 50": dict(temperature=0.8, top_k=50),
            "temperature 0.8, top-p 0.9": dict(temperature=0.8, top_p=0.9)}


def prefill(engine, prompts, sampling: str = "greedy") -> list[str]:
    """Add the prompts and step until each has sampled once; their request IDs."""
    from backend.types.sampling_params import SamplingParams

    params = SamplingParams(ignore_eos=True, max_tokens=engine.config.max_model_len - max(map(len, prompts)),
                            **SAMPLING[sampling])
    ids = [str(i) for i in range(len(prompts))]
    for i, p in zip(ids, prompts):
        engine.add_request(i, p, params)
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    return ids


def drain(engine, ids) -> None:
    engine.abort_request(ids)
    for _ in range(4):  # async scheduling: a launched step is still in flight
        if not engine.has_unfinished_requests():
            return
        engine.step()


def wall_ms_per_step(engine, batch: int, context: int, steps: int, vocab: int, sampling: str = "greedy") -> float:
    ids = prefill(engine, random_prompts([context] * batch, vocab, seed=batch), sampling)
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    drain(engine, ids)
    return statistics.median(times) * 1e3


def profile_batch(engine, batch: int, context: int, steps: int, vocab: int, device) -> str:
    """The profiles of one batch on an engine without async scheduling: cProfile sees only the
    calling thread, where such an engine does all of its host work."""
    wall_ms = wall_ms_per_step(engine, batch, context, steps, vocab)
    ids = prefill(engine, random_prompts([context] * batch, vocab, seed=batch))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    py = cProfile.Profile()
    py.enable()
    for _ in range(steps):
        engine.step()
    py.disable()
    text = io.StringIO()
    stats = pstats.Stats(py, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    profiled_ms = (time.perf_counter() - start) * 1e3 / steps
    events = prof.key_averages()
    busy_ms = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 1e3 / steps
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = events.table(sort_by=sort, row_limit=20)
    drain(engine, ids)
    lines = [f"## batch {batch}, context {context}, async scheduling off",
             f"wall ms/step (median of {steps}): {wall_ms:.3f}",
             f"under torch.profiler: {profiled_ms:.3f} ms/step, device busy {busy_ms:.3f} ms/step "
             f"({100 * busy_ms / profiled_ms:.0f} %)",
             "", "### Python: by own time, then by cumulative time (cProfile, all steps)",
             "```", text.getvalue().strip(), "```",
             "", f"### ops by {sort}", "```", table, "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU rehearsal: tiny shapes")
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(CONFIGS))
    parser.add_argument("--batches", default="1,256", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=1008, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=20, help="decode steps per measurement")
    parser.add_argument("--out", default="step_profile.md", help="the report (Markdown)")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --tiny for the CPU rehearsal")
    plan = Plan(args.tiny)
    batches = [int(b) for b in args.batches.split(",")]
    context = min(args.context, plan.max_model_len // 2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = [f"# step_profile: {args.model} on {torch.cuda.get_device_name() if not args.tiny else 'cpu (--tiny)'}",
              ""]
    with tempfile.TemporaryDirectory(prefix="step_profile-") as tmp:
        model_dir, hf = build_checkpoint(args.model, Path(tmp), plan.dtype, plan)
        vocab = hf.config.vocab_size
        release(hf)
        max_num_seqs = max(max(batches), plan.max_num_seqs)
        engine = make_engine(model_dir, plan, max_num_seqs=max_num_seqs)  # the device's default scheduling
        report.append(f"graphs: {not engine.config.enforce_eager}; wall ms/step (median of {args.steps}) "
                      f"with async scheduling {'on' if engine.async_scheduling else 'off'}:")
        for sampling in SAMPLING:
            walls = [f"batch {b}: {wall_ms_per_step(engine, b, context, args.steps, vocab, sampling):.3f}"
                     for b in batches]
            report.append(f"- {sampling}: " + ", ".join(walls))
        report.append("")
        release(engine)
        engine = make_engine(model_dir, plan, max_num_seqs=max_num_seqs, async_scheduling=False)
        for batch in batches:
            report.append(profile_batch(engine, batch, context, args.steps, vocab, plan.device))
            out.write_text("\n".join(report))
            print(report[-1], flush=True)
        release(engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
