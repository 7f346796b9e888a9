"""One GPU check of the CUDA backend, sized for 8 minutes on one H200 with no network.

It needs only the repository and torch, triton, transformers, numpy, safetensors
(grpcio/protobuf come with the backend package but are not used here). Models are
built from the config files in bench/configs/ with random weights from a seed.
Results are written to --out (JSON, plus a Markdown copy beside it) after every
phase, so a run cut short still leaves what it measured:

1. ceilings: device copy and read GB/s (the better is the 100 % of every bandwidth figure),
   bf16 matmul TFLOP/s;
2. kernels: each Triton kernel vs its torch reference (error, µs, % of bandwidth) at
   (batch, context) = (1, 1k), (1, 8k), (64, 1k), (256, 1k), (256, 4k) (bench/triton_kernels.py);
3. logits: engine vs HF transformers on the same seeded fp32 weights, per config
   (max |Δ logprob| over prompt tokens, greedy tokens equal: eager, graphs, graphs with async
   scheduling), then both in bf16 (max |Δ logprob|);
4. graphs: batch-1 decode, eager vs CUDA graphs (tok/s, ratio, same tokens), per config,
   with the step's achieved bandwidth (weights + KV read per step over step time);
5. sweep: decode batch 1 ... 256 at context ~1,024 (step ms, tok/s, % bandwidth);
6. prefill: the 1B config's time to first token for 1 x 1k, 1 x 8k and 8 x 1k prompt tokens
   (tok/s, matmul TFLOP/s against the ceiling);
7. nano_vllm: nano-vllm's offline workload (256 sequences, input and output lengths
   uniform in [100, 1024], EOS ignored) against its bandwidth floor: the time to read,
   at the measured copy rate, the weights once per decode step plus each step's KV;
8. long_context: the 1B config served at its whole 131,072-token length with CUDA graphs:
   batch-1 decode at ~1k context against the same at the sweep's max_model_len (the step
   must not grow with max_model_len: the split-KV layout follows the real context), then
   at ~32k context (% bandwidth), with the graphs' capture memory and the KV cache size.

    python bench/gpu_check.py --out /tmp/gpu_check.json    # on the GPU
    python bench/gpu_check.py --tiny --out /tmp/tiny.json  # CPU: tiny shapes, Triton's
        interpreter, fake graph capture; proves the script runs end to end

Step times are the engine's whole step (schedule, inputs, forward, sampling), the
median over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # run as a script, bench/ is sys.path[0]: the repository's root goes there
    sys.path[0] = str(REPO)
    if "--tiny" in sys.argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from bench.gpu_models import (CONFIGS, Plan, build_checkpoint, decode_steps, kv_bytes_per_token, make_engine,
                              random_prompts, release, runner_of, weight_bytes)
# Not installed on the H200 machine: the engine path this script drives must not import them.
ABSENT_ON_GPU_MACHINE = {"fastapi", "uvicorn", "starlette", "gguf", "grpc_health", "grpc_reflection",
                         "prometheus_client"}


class Results:
    """Phase name -> rows (or an error); rewritten to disk after every phase."""

    def __init__(self, path: Path, meta: dict) -> None:
        self.path = path
        self.data = {"meta": meta, "phases": {}}

    def record(self, phase: str, value) -> None:
        self.data["phases"][phase] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=float))
        self.path.with_suffix(".md").write_text(self.markdown())

    def markdown(self) -> str:
        out = [f"# gpu_check: {self.data['meta'].get('device')}", ""]
        for phase, value in self.data["phases"].items():
            out.append(f"## {phase}")
            if isinstance(value, dict) and "error" in value:
                out.append(f"ERROR: {value['error']}")
            elif isinstance(value, list) and value and isinstance(value[0], dict):
                keys = list(dict.fromkeys(k for row in value for k in row))
                out.append("| " + " | ".join(keys) + " |")
                out.append("|" + "---|" * len(keys))
                for row in value:
                    out.append("| " + " | ".join(_fmt(row.get(k, "")) for k in keys) + " |")
            else:
                out.append(json.dumps(value, default=float))
            out.append("")
        return "\n".join(out)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


# ---- phases ------------------------------------------------------------------------------------

def phase_ceilings(plan: Plan, state: dict) -> list[dict]:
    from bench.triton_kernels import copy_bandwidth_gbs, read_bandwidth_gbs, time_us

    copy = copy_bandwidth_gbs(plan.device, plan.copy_bytes)
    read = read_bandwidth_gbs(plan.device, plan.copy_bytes)
    state["bandwidth_gbs"] = max(copy, read)  # the 100 % of every bandwidth figure below
    n = plan.matmul_n
    dtype = torch.float32 if plan.tiny else torch.bfloat16
    a = torch.randn(n, n, device=plan.device, dtype=dtype)
    b = torch.randn(n, n, device=plan.device, dtype=dtype)
    us = time_us(lambda: a @ b, plan.device)
    state["matmul_tflops"] = 2 * n ** 3 / (us * 1e-6) / 1e12
    return [{"ceiling": "copy (read + write)", "value": copy, "unit": "GB/s"},
            {"ceiling": "read (bf16 sum)", "value": read, "unit": "GB/s"},
            {"ceiling": f"{dtype} matmul {n}^3", "value": 2 * n ** 3 / (us * 1e-6) / 1e12, "unit": "TFLOP/s"}]


def phase_kernels(plan: Plan, state: dict) -> list[dict]:
    from bench import triton_kernels as kbench

    return kbench.run(plan.tiny, state["bandwidth_gbs"])[1]


def phase_logits(plan: Plan, state: dict, tmp: Path) -> list[dict]:
    """fp32 engine (eager, CUDA graphs, graphs with async scheduling) against HF on the same
    weights: prompt logprobs and greedy tokens; then the engine in the serving dtype against HF
    in that dtype (prompt logprobs only: rounding may flip a near tie)."""
    from backend.types.sampling_params import SamplingParams

    def run(engine, prompts, params):
        got = {str(i): [] for i in range(len(prompts))}
        prompt_lps = {}
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
                if out.prompt_logprobs is not None:
                    prompt_lps[out.request_id] = out.prompt_logprobs
        release(engine)
        return [got[str(i)] for i in range(len(prompts))], prompt_lps

    def prompt_logprobs_of(model, prompts) -> dict:
        """HF's prompt logprobs in the engine's layout: request ID -> [None, {token: logprob}, ...]."""
        out = {}
        with torch.no_grad():
            for i, p in enumerate(prompts):
                ref = torch.log_softmax(model(torch.tensor([p], device=plan.device)).logits[0].float(), dim=-1)
                # [len, vocab]: row pos - 1 predicts token pos
                out[str(i)] = [None] + [{p[pos]: ref[pos - 1, p[pos]].item()} for pos in range(1, len(p))]
        return out

    def max_diff(reference: dict, prompt_lps: dict) -> float:
        diff = 0.0
        for request_id, positions in reference.items():
            for pos, want in enumerate(positions[1:], start=1):
                (token, value), = want.items()
                got = prompt_lps[request_id][pos][token]
                diff = max(diff, abs((got.logprob if hasattr(got, "logprob") else got) - value))
        return diff

    rows = []
    for name in CONFIGS:
        model_dir, hf = build_checkpoint(name, tmp / f"{name}-fp32", torch.float32, plan)
        prompts = random_prompts(plan.logit_prompts, hf.config.vocab_size, seed=1)
        with_prompt_lps = SamplingParams(temperature=0.0, max_tokens=plan.greedy_tokens, ignore_eos=True,
                                         prompt_logprobs=1)
        # No prompt logprobs: with async scheduling, decode steps are then left on the device
        # until the next is queued (the CUDA default), the path serving takes.
        plain = SamplingParams(temperature=0.0, max_tokens=plan.greedy_tokens, ignore_eos=True)
        runs = {}
        for mode, eager, pipelined, params in (("eager", True, False, with_prompt_lps),
                                               ("graphs", False, False, plain),
                                               ("graphs_async", False, True, plain)):
            engine = make_engine(model_dir, plan, dtype="float32", enforce_eager=eager, max_num_seqs=8,
                                 async_scheduling=pipelined)
            runs[mode] = run(engine, prompts, params)
        want = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p], device=plan.device)
                greedy = []  # without a KV cache or EOS: what the engine does with ignore_eos
                for _ in range(plan.greedy_tokens):
                    greedy.append(int(hf(ids).logits[0, -1].argmax()))
                    ids = torch.cat([ids, ids.new_tensor([[greedy[-1]]])], dim=1)
                want.append(greedy)
        rows.append({"model": name, "dtype": "float32",
                     "max_abs_logprob_diff": max_diff(prompt_logprobs_of(hf, prompts), runs["eager"][1]),
                     "greedy_equal_eager": runs["eager"][0] == want,
                     "greedy_equal_graphs": runs["graphs"][0] == want,
                     "greedy_equal_graphs_async": runs["graphs_async"][0] == want, "prompts": len(prompts)})
        # bf16 (the GPU's serving dtype; --tiny too, to rehearse it): the engine's error against
        # fp32 HF beside HF's own in bf16 (the rounding a bf16 model cannot avoid).
        engine = make_engine(model_dir, plan, dtype="bfloat16", max_num_seqs=8)
        tokens, prompt_lps = run(engine, prompts, with_prompt_lps)
        fp32_lps = prompt_logprobs_of(hf, prompts)
        hf = hf.to(torch.bfloat16)
        hf_lps = prompt_logprobs_of(hf, prompts)
        rows.append({"model": name, "dtype": "bfloat16",
                     "max_abs_logprob_diff": max_diff(fp32_lps, prompt_lps),
                     "hf_bf16_max_abs_logprob_diff": max_diff(fp32_lps, hf_lps),
                     "tokens_as_fp32_hf": tokens == want, "prompts": len(prompts)})
        release(hf)
    return rows


def serving_checkpoint(name: str, plan: Plan, state: dict, tmp: Path) -> tuple[Path, int]:
    """(directory, vocab size) of the config's checkpoint in the serving dtype, built once per run."""
    made = state.setdefault("serving", {})
    if name not in made:
        model_dir, hf = build_checkpoint(name, tmp / f"{name}-serving", plan.dtype, plan)
        made[name] = (model_dir, hf.config.vocab_size)
        release(hf)
    return made[name]


def phase_graphs(plan: Plan, state: dict, tmp: Path) -> list[dict]:
    rows = []
    for name in CONFIGS:
        model_dir, vocab = serving_checkpoint(name, plan, state, tmp)
        prompt = random_prompts([plan.b1_prompt], vocab, seed=2)
        result = {"model": name}
        for mode, eager in (("eager", True), ("graphs", False)):
            engine = make_engine(model_dir, plan, enforce_eager=eager, max_num_seqs=8)
            step_s, context, tokens = decode_steps(engine, prompt, plan.b1_steps)
            result[f"{mode}_step_ms"] = step_s * 1e3
            result[f"{mode}_tok_s"] = 1 / step_s
            result[f"{mode}_tokens"] = tokens[0]
            if not eager:
                moved = weight_bytes(engine) + context * kv_bytes_per_token(engine)
                result["graphs_pct_bandwidth"] = 100 * moved / step_s / 1e9 / state["bandwidth_gbs"]
                result["capture_s"] = runner_of(engine).graphs.capture_seconds
            release(engine)
        result["graphs_vs_eager"] = result["eager_step_ms"] / result["graphs_step_ms"]
        # In bf16 (the GPU run) graphs split long contexts by max_model_len, eager by the step's length, so
        # the sums may round differently (exactness is checked in fp32, phase "logits").
        result["same_tokens_eager_graphs"] = result.pop("eager_tokens") == result.pop("graphs_tokens")
        rows.append(result)
    return rows


def phase_sweep(plan: Plan, state: dict, tmp: Path, deadline: float) -> list[dict]:
    rows = []
    for name in ("smollm2-135m", "llama-3.2-1b"):
        model_dir, vocab = serving_checkpoint(name, plan, state, tmp)
        engine = make_engine(model_dir, plan)
        runner = runner_of(engine)
        capture = (runner.graphs.capture_seconds, runner.graphs.capture_mib) if runner.graphs else (0.0, 0.0)
        for batch in plan.sweep:
            if time.monotonic() > deadline:
                rows.append({"model": name, "batch": batch, "skipped": "time budget"})
                continue
            prompts = random_prompts([plan.sweep_prompt] * batch, vocab, seed=batch)
            step_s, context, _ = decode_steps(engine, prompts, plan.sweep_steps)
            moved = weight_bytes(engine) + batch * context * kv_bytes_per_token(engine)
            rows.append({"model": name, "batch": batch, "context": int(context), "step_ms": step_s * 1e3,
                         "tok_s": batch / step_s,
                         "pct_bandwidth": 100 * moved / step_s / 1e9 / state["bandwidth_gbs"],
                         "capture_s": capture[0], "capture_mib": capture[1]})
        release(engine)
    return rows


def phase_prefill(plan: Plan, state: dict, tmp: Path) -> list[dict]:
    """Time to the first token of prompts alone in the engine (no prefix-cache hits): one step
    when the prompts fit max_num_batched_tokens, with the matmul share of its FLOPs against the
    measured bf16 matmul ceiling (attention's FLOPs not counted)."""
    from backend.types.sampling_params import SamplingParams

    model_dir, vocab = serving_checkpoint("llama-3.2-1b", plan, state, tmp)
    longest = max(length for _, length in plan.prefill_shapes)
    engine = make_engine(model_dir, plan, max_model_len=longest + plan.block_size,
                         max_num_batched_tokens=max(longest, plan.max_num_batched_tokens))
    params_per_token = weight_bytes(engine) / plan.dtype.itemsize
    rows = []
    for seed, (batch, length) in enumerate([(1, plan.prefill_len), *plan.prefill_shapes]):
        for attempt in ("warm-up", "timed"):
            prompts = random_prompts([length] * batch, vocab, seed=2 * seed + (attempt == "timed"))
            ids = [f"{attempt}-{i}" for i in range(batch)]
            start = time.perf_counter()
            for request_id, prompt in zip(ids, prompts):
                engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
            elapsed = time.perf_counter() - start
        tokens = batch * length
        rows.append({"batch": batch, "prompt": length, "ttft_ms": elapsed * 1e3, "tok_s": tokens / elapsed,
                     "matmul_tflops": 2 * params_per_token * tokens / elapsed / 1e12,
                     "pct_matmul_ceiling": 100 * 2 * params_per_token * tokens / elapsed / 1e12
                     / state["matmul_tflops"]})
    release(engine)
    return rows


def nano_vllm_workload(num_seqs: int, low: int, high: int, vocab: int, seed: int = 0):
    """nano-vllm's bench: random token IDs < 10,000, input and output lengths uniform in [low, high]."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) % vocab for _ in range(rng.randint(low, high))] for _ in range(num_seqs)]
    return prompts, [rng.randint(low, high) for _ in range(num_seqs)]


def phase_nano_vllm(plan: Plan, state: dict, tmp: Path) -> list[dict]:
    from backend.types.sampling_params import SamplingParams

    rows = []
    for name in ("smollm2-135m", "qwen2.5-0.5b"):
        model_dir, vocab = serving_checkpoint(name, plan, state, tmp)
        prompts, out_lens = nano_vllm_workload(**plan.nano, vocab=vocab)
        engine = make_engine(model_dir, plan)
        for i, (p, n) in enumerate(zip(prompts, out_lens)):
            engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        produced = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            produced += sum(len(o.new_token_ids) for o in engine.step())
        elapsed = time.perf_counter() - start
        # The floor: all sequences decode together; step t reads the weights once and the
        # KV of every sequence still running (prompt + t tokens).
        weights, kv = weight_bytes(engine), kv_bytes_per_token(engine)
        moved = sum(weights + sum((len(p) + t) * kv for p, n in zip(prompts, out_lens) if n > t)
                    for t in range(max(out_lens)))
        floor_s = moved / (state["bandwidth_gbs"] * 1e9)
        release(engine)
        assert produced == sum(out_lens), (produced, sum(out_lens))
        rows.append({"model": name, "sequences": len(prompts), "output_tokens": produced,
                     "seconds": elapsed, "tok_s": produced / elapsed, "floor_s": floor_s,
                     "pct_of_floor": 100 * floor_s / elapsed})
    return rows


def phase_long_context(plan: Plan, state: dict, tmp: Path) -> list[dict]:
    """Batch-1 decode on the 1B config at a short and a long context, with graphs, at the
    sweep's max_model_len and at the config's whole length."""
    model_dir, vocab = serving_checkpoint("llama-3.2-1b", plan, state, tmp)
    short, long = plan.long_contexts
    rows = []
    for max_model_len, contexts in ((plan.max_model_len, (short,)), (plan.long_max_model_len, (short, long))):
        kwargs = dict(max_num_seqs=8, max_model_len=max_model_len)
        if plan.tiny:  # the tiny rehearsal sizes its cache by hand: room for the long context
            kwargs["num_kv_blocks"] = -(-max_model_len // 16) * 2
        engine = make_engine(model_dir, plan, **kwargs)
        runner = runner_of(engine)
        capture_mib = runner.graphs.capture_mib if runner.graphs else 0.0
        for context in contexts:
            prompt = random_prompts([context], vocab, seed=context)
            step_s, mean_context, tokens = decode_steps(engine, prompt, plan.long_steps)
            moved = weight_bytes(engine) + mean_context * kv_bytes_per_token(engine)
            rows.append({"max_model_len": max_model_len, "context": int(mean_context), "step_ms": step_s * 1e3,
                         "tok_s": 1 / step_s, "pct_bandwidth": 100 * moved / step_s / 1e9 / state["bandwidth_gbs"],
                         "capture_mib": capture_mib,
                         "kv_cache_gib": engine.block_manager.num_blocks * runner.kv_bytes_per_block() / 2 ** 30,
                         "first_tokens": tokens[0][:4]})
        release(engine)
    base = rows[0]["step_ms"]
    for row in rows:
        row["step_vs_short_engine"] = row["step_ms"] / base
    # The same prompt at the same context: the split-KV layout, and so the tokens, must not
    # depend on max_model_len.
    rows[1]["same_tokens_as_short_engine"] = rows[1]["first_tokens"] == rows[0]["first_tokens"]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU rehearsal: tiny shapes, interpreter, fake graphs")
    parser.add_argument("--out", default="gpu_check.json", help="results (JSON; Markdown beside it)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="later phases stop after this")
    parser.add_argument("--phases", default="", help="comma-separated phase names to run (default: all)")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --tiny for the CPU rehearsal")
    plan = Plan(args.tiny)
    start = time.monotonic()
    deadline = start + args.budget_s
    if args.tiny:  # graph capture logic on the CPU: FakeGraph replays the captured calls
        from backend.worker import cuda_graphs

        torch.set_num_threads(1)  # tiny shapes gain nothing from threads; a busy machine's barriers cost

        cuda_sizes = cuda_graphs.capture_sizes
        cuda_graphs.graph_class = lambda device: cuda_graphs.FakeGraph
        cuda_graphs.capture_sizes = lambda max_num_seqs, device: cuda_sizes(max_num_seqs, torch.device("cuda"))
    import transformers
    import triton

    device_name = torch.cuda.get_device_name() if plan.device.type == "cuda" else "cpu (--tiny)"
    results = Results(Path(args.out), {"device": device_name, "torch": torch.__version__,
                                       "triton": triton.__version__, "transformers": transformers.__version__,
                                       "tiny": args.tiny})
    state: dict = {}
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp_name:
        tmp = Path(tmp_name)
        phases = [("ceilings", lambda: phase_ceilings(plan, state)),
                  ("kernels", lambda: phase_kernels(plan, state)),
                  ("logits", lambda: phase_logits(plan, state, tmp)),
                  ("graphs", lambda: phase_graphs(plan, state, tmp)),
                  ("sweep", lambda: phase_sweep(plan, state, tmp, deadline)),
                  ("prefill", lambda: phase_prefill(plan, state, tmp)),
                  ("nano_vllm", lambda: phase_nano_vllm(plan, state, tmp)),
                  ("long_context", lambda: phase_long_context(plan, state, tmp))]
        wanted = {p for p in args.phases.split(",") if p}
        unknown = wanted - {name for name, _ in phases}
        if unknown:
            parser.error(f"unknown phases: {sorted(unknown)}")
        for name, fn in phases:
            if wanted and name not in wanted and name != "ceilings":  # ceilings: the 100 % of later rows
                continue
            if time.monotonic() > deadline and name != "ceilings":
                results.record(name, {"error": "skipped: time budget spent"})
                ok = False
                continue
            phase_start = time.monotonic()
            try:
                value = fn()
            except Exception as exc:  # record and go on: later phases may still measure
                traceback.print_exc()
                value, ok = {"error": f"{type(exc).__name__}: {exc}"}, False
            results.record(name, value)
            if name == "logits" and isinstance(value, list) and not all(
                    row[key] for row in value for key in row if key.startswith("greedy_equal")):
                print("WRONG TOKENS: the engine's greedy tokens differ from HF's (phase logits)", flush=True)
                ok = False
            print(f"[{time.monotonic() - start:6.1f} s] {name} done in {time.monotonic() - phase_start:.1f} s",
                  flush=True)
    imported = {m.split(".")[0] for m in sys.modules}
    results.record("total", {"seconds": time.monotonic() - start,
                             "imported_but_absent_on_gpu_machine": sorted(imported & ABSENT_ON_GPU_MACHINE)})
    print(results.markdown())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
