"""Every Triton kernel the CUDA path launches, compiled for real GPU targets without a GPU:
registers, spill bytes and shared memory per specialization, as a markdown table.

    python bench/kernel_compile_table.py                       # sm_80, sm_90a, sm_100a; bf16, fp16
    python bench/kernel_compile_table.py --targets 90 --dtypes bf16,fp16,fp32 --models Llama
    python bench/kernel_compile_table.py --json rows.json      # also every row, for a test

The launches are the real launchers' (tandem_kernels.compile_probe records them at the shapes
of SmolLM2-135M, Qwen2.5-0.5B, Llama-3.2-1B, Llama-3.1-8B and head dims 80/96/256); each
cell is "registers / spill bytes / shared KB" for that target. It exits 1 if any
specialization fails to compile (the table says ERROR, the JSON has the message). Triton
caches what it compiles (~/.triton/cache), so a second run takes seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script, bench/ is sys.path[0]: the repository's root goes there
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernel_compile_table.py compiles for GPUs: unset TRITON_INTERPRET")

from tandem_kernels.compile_probe import DTYPES, SHAPES, SHARED_LIMIT, probe, supported_targets

TARGET_NAMES = {80: "sm_80", 90: "sm_90a", 100: "sm_100a"}
SHOWN_CONSTEXPRS = ("GROUP", "BLOCK_M", "TILE", "SPLIT", "BLOCK", "HEAD_DIM_PAD", "HAS_RESIDUAL", "BLOCK_N", "BLOCK_K", "EVEN_K")


def mma_kinds(instructions: list[str]) -> str:
    """'wgmma bf16, mma bf16' from PTX names such as wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16."""
    kinds = set()
    for name in instructions:
        parts = name.split(".")
        kinds.add(f"{parts[0]} " + next((p for p in parts if p in ("bf16", "f16", "tf32")), "f32"))
    return ", ".join(sorted(kinds)) or "-"


def format_markdown(rows: list[dict]) -> str:
    """One line per specialization, a 'registers / spill B / shared KB' cell per target."""
    targets = sorted({r["target"] for r in rows})
    head = ["kernel", "case", "first launched by", "dtype", "d", "constexprs", "warps", "stages"]
    head += [f"{TARGET_NAMES.get(t, t)}" for t in targets] + ["sm_90a tensor cores"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_spec: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        key = (r["kernel"], r["case"], r["model"], r["dtype"], r["head_dim"], json.dumps(r.get("constexprs")))
        by_spec.setdefault(key, {})[r["target"]] = r
    for (kernel, case, model, dtype, head_dim, _), per_target in by_spec.items():
        ok = [r for r in per_target.values() if "error" not in r]
        first = ok[0] if ok else {}
        shown = " ".join(f"{k}={v}" for k, v in first.get("constexprs", {}).items() if k in SHOWN_CONSTEXPRS)
        cells = []
        for t in targets:
            r = per_target.get(t)
            cells.append("-" if r is None else "ERROR" if "error" in r else
                         f"{r['registers']} / {r['spill_bytes']} / {r['shared_bytes'] / 1024:.1f}")
        mma = mma_kinds(per_target[90].get("mma", [])) if 90 in per_target else "-"
        lines.append("| " + " | ".join([kernel, case, model, dtype, str(head_dim), shown,
                                        str(first.get("num_warps", "-")), str(first.get("num_stages", "-"))]
                                       + cells + [mma]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="all", help="compute capabilities, e.g. 80,90 (all: 80, 90, 100 "
                                                         "where the installed Triton has Blackwell)")
    parser.add_argument("--dtypes", default="bf16,fp16", help=f"comma-separated, of {sorted(DTYPES)}")
    parser.add_argument("--models", default="all", help="comma-separated prefixes of the model names")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="compile processes")
    parser.add_argument("--json", type=Path, help="also write every row (KernelReport fields) here")
    args = parser.parse_args()
    targets = supported_targets() if args.targets == "all" else [int(t) for t in args.targets.split(",")]
    if not set(targets) <= set(SHARED_LIMIT):
        parser.error(f"--targets: {targets} not all in {sorted(SHARED_LIMIT)}")
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= set(DTYPES):
        parser.error(f"--dtypes: {dtypes} not all in {sorted(DTYPES)}")
    shapes = SHAPES if args.models == "all" else [
        s for s in SHAPES if any(s.name.startswith(p) for p in args.models.split(","))]
    if not shapes:
        parser.error(f"--models: {args.models} names none of {[s.name for s in SHAPES]}")
    if not 1 <= args.jobs <= 64:
        parser.error("--jobs: 1..64")
    rows = list(probe(shapes, dtypes, targets, args.jobs))
    print("cells: registers / spill bytes / shared KB (limits: "
          + ", ".join(f"{TARGET_NAMES[t]} {SHARED_LIMIT[t] // 1024} KB" for t in targets) + ")\n")
    print(format_markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"\n{r['kernel']} ({r['model']} {r['dtype']} {r['case']}) on {TARGET_NAMES[r['target']]}: "
              f"{r['error']}", file=sys.stderr)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
