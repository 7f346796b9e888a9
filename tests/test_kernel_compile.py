"""Every Triton kernel the CUDA path launches compiles for real GPU targets, on this CPU.

bench/kernel_compile_table.py (in a process without TRITON_INTERPRET: it needs Triton's
compiler, not the interpreter) runs the real launchers at the shapes of SmolLM2-135M,
Qwen2.5-0.5B, Llama-3.2-1B, Llama-3.1-8B and head dims 80/96/256, records each kernel launch,
and compiles it for sm_80, sm_90a and sm_100a (bf16, fp16 and fp32 on sm_90a, bf16 on the others,
to keep this test near two minutes on two cores; the script runs any matrix). The tests read its
rows: compile errors, shared memory against each target's limit, register spills, decode
registers, tensor-core input types, and the launch parameters against launch_config.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tandem_kernels import compile_probe
from tandem_kernels.launch_config import attention_config, int4_matmul_config, merge_config

ROOT = Path(__file__).resolve().parents[1]
# (targets, dtypes) per run of the script; every model shape in each.
MATRIX = [("90", "bf16,fp16,fp32"), ("80,100", "bf16")]
ATTENTION = "_attention_kernel"
INT4 = "_int4_matmul_kernel"


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    found = []
    for targets, dtypes in MATRIX:
        if targets == "80,100" and 100 not in compile_probe.supported_targets():
            targets = "80"
        out = tmp_path_factory.mktemp("compile") / "rows.json"
        result = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "kernel_compile_table.py"), "--targets", targets,
             "--dtypes", dtypes, "--jobs", "2", "--json", str(out)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
        print(result.stdout)  # the table (pytest -s shows it)
        assert out.exists(), f"the script failed before writing rows:\n{result.stderr[-4000:]}"
        found += json.loads(out.read_text())
    return found


def where(row: dict) -> str:
    return f"{row['kernel']} ({row['model']} {row['dtype']} {row['case']}) on sm_{row['target']}"


@pytest.mark.timeout(900)
def test_every_launched_kernel_compiles_for_every_target(rows):
    errors = [f"{where(r)}: {r['error'][:400]}" for r in rows if "error" in r]
    assert not errors, "\n".join(errors)
    assert {r["kernel"] for r in rows} == compile_probe.entry_kernels()
    assert {r["target"] for r in rows} >= {80, 90}
    assert {r["head_dim"] for r in rows} == {64, 80, 96, 128, 256}
    # Every module with a jit kernel is one the probe runs the launchers of.
    probed = {Path(m.__file__).name for m in compile_probe.LAUNCHER_MODULES}
    with_kernels = {p.name for p in (ROOT / "kernels" / "tandem_kernels").glob("*.py")
                    if re.search(r"^@triton\.jit", p.read_text(), re.M)}
    assert with_kernels <= probed


@pytest.mark.timeout(900)
def test_shared_memory_fits_and_nothing_spills(rows):
    over = [f"{where(r)}: {r['shared_bytes']} > {r['shared_limit']}" for r in rows
            if r["shared_bytes"] > r["shared_limit"]]
    assert not over, "\n".join(over)
    spills = [f"{where(r)}: {r['spill_bytes']} B, {r['registers']} registers" for r in rows if r["spill_bytes"]]
    assert not spills, "\n".join(spills)


@pytest.mark.timeout(900)
def test_decode_attention_registers(rows):
    """At head dims 64 and 128 a decode program fits 128 registers a thread on sm_90a."""
    decode = [r for r in rows if r["kernel"] == ATTENTION and r["target"] == 90
              and r["constexprs"]["BLOCK_Q"] == 1 and r["head_dim"] in (64, 128)]
    assert {r["head_dim"] for r in decode} == {64, 128}
    heavy = [f"{where(r)}: {r['registers']}" for r in decode if r["registers"] > 128]
    assert not heavy, "\n".join(heavy)


@pytest.mark.timeout(900)
def test_attention_dots_run_on_half_precision_tensor_cores(rows):
    """bf16/fp16 operands go to the tensor cores as they are (fp32 accumulation), not upcast to tf32."""
    for r in rows:
        if r["kernel"] != ATTENTION or r["target"] not in (80, 90) or r["dtype"] == "fp32":
            continue  # fp32 dots are exact (IEEE): FMA loops, no tensor cores
        kind = {"bf16": "bf16", "fp16": "f16"}[r["dtype"]]
        assert r["mma"], f"{where(r)}: no tensor-core instruction"
        for name in r["mma"]:
            assert f".{kind}" in name and ".tf32" not in name and ".f32" in name, f"{where(r)}: {name}"


@pytest.mark.timeout(900)
def test_launches_use_launch_config(rows):
    """What the launcher passed (recorded) is the pure functions' answer for that shape."""
    models = {s.name: s for s in compile_probe.SHAPES}
    cases = {label: (requests, splits) for label, requests, splits in compile_probe.ATTENTION_CASES}
    checked = set()
    for r in rows:
        c = r["constexprs"]
        if r["kernel"] == "_merge_splits_kernel":
            merge = merge_config(cases[r["case"]][1])
            assert (c["SPLITS_PAD"], r["num_warps"]) == (merge.block, merge.num_warps), where(r)
        elif r["kernel"] == ATTENTION:
            shape = models[r["model"]]
            group = shape.heads // shape.kv_heads
            max_query_len = max(n for _, n in cases[r["case"]][0])
            config = attention_config(shape.head_dim, group, max_query_len, 4 if r["dtype"] == "fp32" else 2)
            assert (c["GROUP"], c["BLOCK_Q"], c["BLOCK_M"], c["TILE"], c["HEAD_DIM_PAD"]) == (
                group, config.block_q, config.block_m, config.tile_n, config.head_dim_pad), where(r)
            assert (r["num_warps"], r["num_stages"]) == (config.num_warps, config.num_stages), where(r)
        elif r["kernel"] == INT4:  # case "int4[f] linear, R rows"; block_m, warps and stages follow R alone
            config = int4_matmul_config(int(r["case"].split()[2]), 2048, 2048)
            assert (c["BLOCK_M"], r["num_warps"], r["num_stages"]) == (
                config.block_m, config.num_warps, config.num_stages), where(r)
        else:
            continue
        checked.add(r["kernel"])
    assert checked == {ATTENTION, "_merge_splits_kernel", INT4}


def test_the_probe_refuses_the_interpreter():
    """With TRITON_INTERPRET=1 kernels are interpreted functions: the probe says so, not a traceback."""
    result = subprocess.run([sys.executable, "-c", "from tandem_kernels import compile_probe; "
                             "compile_probe.jit_kernels()"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=120)
    assert result.returncode != 0 and "unset TRITON_INTERPRET" in result.stderr
