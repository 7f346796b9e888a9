"""Run by test_engines_in_sequence.py in a fresh interpreter (nothing started Ray before it):
build ``LLM`` objects one after another, generate greedily with each, shut each down, and
report as one JSON line on stdout, per engine: its tokens, how long ``shutdown()`` took, and
which of the processes this one had started (at any depth: mp workers, Ray's GCS, raylet,
dashboard and actors) were still running 10 s after it.

    python engines_in_sequence_child.py '{"model": DIR, "prompts": [[...]], "max_tokens": N,
                                          "engines": [{LLM kwargs}, ...]}'
"""

from __future__ import annotations

import json
import os
import sys
import time

LEFTOVER_WAIT_S = 10.0


def descendant_pids(root: int) -> set[int]:
    """Live processes below ``root`` (children, their children, ...), from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # comm may hold spaces
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main(spec: dict) -> list[dict]:
    from backend.types.sampling_params import SamplingParams
    from frontend.entrypoints.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    reports, started = [], set()
    for kwargs in spec["engines"]:
        llm = LLM(spec["model"], **kwargs)
        outputs = llm.generate(spec["prompts"], params, use_tqdm=False)
        started |= descendant_pids(os.getpid())  # everything this engine runs on, before it stops
        start = time.monotonic()
        llm.shutdown()
        shutdown_s = time.monotonic() - start
        deadline = time.monotonic() + LEFTOVER_WAIT_S
        while any(is_running(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        reports.append({"engine": kwargs, "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                        "shutdown_s": shutdown_s,
                        "leftover": sorted(pid for pid in started if is_running(pid)),
                        "started": sorted(started)})
    return reports


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
