"""bench/gpu_check.py end to end on the CPU (--tiny), so its first GPU run is not its first run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_tiny_runs_every_phase(tmp_path):
    out = tmp_path / "check.json"
    result = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--tiny", "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    phases = json.loads(out.read_text())["phases"]
    assert list(phases) == ["ceilings", "kernels", "logits", "graphs", "sweep", "prefill", "nano_vllm",
                            "long_context", "total"]
    assert out.with_suffix(".md").read_text().startswith("# gpu_check")
    for name, rows in phases.items():
        assert "error" not in rows, (name, rows)
    kernels = {r["kernel"] for r in phases["kernels"]}
    assert kernels == {"paged_attention", "fused_add_rms_norm", "apply_rotary", "write_kv_cache"}
    assert all(r["max_abs_err"] < 0.1 and r["triton_us"] > 0 for r in phases["kernels"])
    models = ["smollm2-135m", "llama-3.2-1b", "qwen2.5-0.5b"]
    assert [(r["model"], r["dtype"]) for r in phases["logits"]] == [
        (m, dtype) for m in models for dtype in ("float32", "bfloat16")]
    fp32 = [r for r in phases["logits"] if r["dtype"] == "float32"]
    assert all(r["greedy_equal_eager"] and r["greedy_equal_graphs"] and r["greedy_equal_graphs_async"]
               and r["max_abs_logprob_diff"] < 1e-3 for r in fp32)
    bf16 = [r for r in phases["logits"] if r["dtype"] == "bfloat16"]
    # Against fp32 HF: the engine's bf16 error is of the size of HF's own in bf16.
    assert all(r["max_abs_logprob_diff"] < max(3 * r["hf_bf16_max_abs_logprob_diff"], 1e-2) for r in bf16)
    assert all(r["same_tokens_eager_graphs"] and r["capture_s"] > 0 for r in phases["graphs"])
    assert [r["batch"] for r in phases["sweep"]] == [1, 2, 4] * 2
    assert [(r["batch"], r["prompt"]) for r in phases["prefill"]] == [(1, 40), (1, 300), (3, 40)]
    assert all(r["ttft_ms"] > 0 and r["pct_matmul_ceiling"] > 0 for r in phases["prefill"])
    assert all(r["output_tokens"] > 0 and r["pct_of_floor"] > 0 for r in phases["nano_vllm"])
    long_rows = phases["long_context"]
    assert [(r["max_model_len"], r["context"] > 900) for r in long_rows] == [(256, False), (4096, False), (4096, True)]
    assert long_rows[1]["same_tokens_as_short_engine"] and all(r["step_ms"] > 0 for r in long_rows)
    assert phases["total"]["imported_but_absent_on_gpu_machine"] == []


def test_step_profile_tiny_reports_every_batch_and_sampling(tmp_path):
    out = tmp_path / "profile.md"
    result = subprocess.run([sys.executable, str(REPO / "bench" / "step_profile.py"), "--tiny", "--batches", "1,3",
                             "--steps", "3", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = out.read_text()
    for sampling in ("greedy", "temperature 0.8, top-k 50", "temperature 0.8, top-p 0.9"):
        assert f"- {sampling}: batch 1: " in report and ", batch 3: " in report
    for batch in (1, 3):
        assert f"## batch {batch}, context" in report
    assert report.count("### Python: by own time") == 2 and "ops by self_cpu_time_total" in report
