"""What a structured-output mask costs per decode step, at a given batch size.

    python bench/structured_output.py [--batch 32] [--steps 30] [--model DIR]

Runs ``batch`` greedy sequences of the default model (SmolLM2-135M-Instruct,
fp32) twice in one process: unconstrained, then every sequence constrained by a
JSON Schema. Decode steps only (prefill excluded). Prints the median step time
of each run and, within the constrained run, the median time spent filling the
grammar bitmask (xgrammar, engine thread) and applying it to the logits
(the sampler hook) -- as a share of that run's step time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo's root, not bench/

from backend.engine.llm_engine import LLMEngine  # noqa: E402
from backend.messages import grammar_mask  # noqa: E402
from backend.types.config import EngineConfig  # noqa: E402
from backend.types.sampling_params import SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "tags", "address"],
}
PROMPT = "<|im_start|>user\nDescribe a person as JSON with name, age, tags and address.<|im_end|>\n<|im_start|>assistant\n"


class Timer:
    """Wraps a function, recording the seconds of each call made since the last ``lap``."""

    def __init__(self) -> None:
        self.current = 0.0
        self.laps: list[float] = []

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current += time.perf_counter() - start
        return timed

    def lap(self) -> None:
        self.laps.append(self.current)
        self.current = 0.0


def decode_steps(engine: LLMEngine, prompt: list[int], params: SamplingParams, batch: int, steps: int,
                 timers: list[Timer]) -> list[float]:
    for i in range(batch):
        engine.add_request(f"r{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()  # prefill
    step_times = []
    for timer in timers:
        timer.laps.clear()
    for _ in range(steps):
        for timer in timers:
            timer.current = 0.0
        start = time.perf_counter()
        outputs = engine.step()
        step_times.append(time.perf_counter() - start)
        for timer in timers:
            timer.lap()
        if len(outputs) != batch:
            raise RuntimeError(f"a step sampled {len(outputs)} of {batch} sequences; raise max_tokens")
    engine.abort_request([f"r{i}" for i in range(batch)])
    return step_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", max_model_len=1024))
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(engine.config.tokenizer_path))
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    free = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.steps + 8,
                                 structured_outputs={"json": SCHEMA})
    engine.structured_output.compile(constrained.structured_outputs)  # compile outside the timing

    fill, apply = Timer(), Timer()
    manager = engine.structured_output
    manager.grammar_bitmask = fill.wrap(manager.grammar_bitmask)
    grammar_mask.TokenBitmask.apply_ = apply.wrap(grammar_mask.TokenBitmask.apply_)

    decode_steps(engine, prompt, free, args.batch, 3, [])  # warm-up
    free_steps = decode_steps(engine, prompt, free, args.batch, args.steps, [])
    constrained_steps = decode_steps(engine, prompt, constrained, args.batch, args.steps, [fill, apply])

    free_ms = statistics.median(free_steps) * 1e3
    constrained_ms = statistics.median(constrained_steps) * 1e3
    fill_ms = statistics.median(fill.laps) * 1e3
    apply_ms = statistics.median(apply.laps) * 1e3
    print(f"batch {args.batch}, {args.steps} decode steps each, fp32, {engine.vocab_size}-token vocabulary")
    print("| run | median step (ms) |")
    print("|---|---|")
    print(f"| unconstrained | {free_ms:.1f} |")
    print(f"| every sequence JSON-Schema constrained | {constrained_ms:.1f} |")
    print()
    print("| part of the constrained step | median (ms) | share of the step |")
    print("|---|---|---|")
    print(f"| fill bitmask (xgrammar, {args.batch} matchers) | {fill_ms:.2f} | {fill_ms / constrained_ms:.1%} |")
    print(f"| apply bitmask to logits (sampler hook) | {apply_ms:.2f} | {apply_ms / constrained_ms:.1%} |")
    print(f"| mask in all | {fill_ms + apply_ms:.2f} | {(fill_ms + apply_ms) / constrained_ms:.1%} |")
    engine.shutdown()


if __name__ == "__main__":
    main()
