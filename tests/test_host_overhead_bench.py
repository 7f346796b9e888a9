"""bench/host_overhead.py end to end at its smallest size: every row is there, every figure is a
real time, and each step waited for the simulated device's D. No speed is asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEVICE_MS = 0.5
STEPS = 3


@pytest.mark.timeout(300)
def test_smallest_matrix_reports_every_row_with_real_times(tmp_path):
    out = tmp_path / "host.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "host_overhead.py"), "--batches", "1,2", "--contexts", "64",
         "--device-ms", str(DEVICE_MS), "--steps", str(STEPS), "--warmup", "1", "--structured", "2x64",
         "--scheduling", "sync,async", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=290)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())

    rows = {(p["batch"], p["context"], p["variant"], p["scheduling"]): p for p in report["points"]}
    assert set(rows) == {(b, 64, v, s) for b, v in [(1, "plain"), (1, "penalties"), (2, "plain"), (2, "penalties"),
                                                    (2, "structured")] for s in ("sync", "async")}
    for key, point in rows.items():
        assert math.isfinite(point["host_ms"]) and point["host_ms"] > 0, key
        assert set(point["steps_ms"]) == {"0", "0.5"}, key
        assert all(len(steps) == STEPS for steps in point["steps_ms"].values()), key
        if point["scheduling"] == "async":
            # Steps overlap, so one step may return in less than D, but each returns only once the
            # device ran its step: N steps in a row span at least N - 1 device steps.
            assert sum(point["steps_ms"]["0.5"]) >= (STEPS - 1) * DEVICE_MS, key
            continue
        # The host waited for the device in every timed step (less than D: the host's own work
        # between the launch and the read overlaps it), and the step lasted at least D. (No upper
        # bound: on a loaded machine a sleep overruns by any amount.)
        assert point["device_ms_elapsed"]["0.5"] > 0, key
        assert min(point["steps_ms"]["0.5"]) >= DEVICE_MS, key
        assert point["period_ms"]["0.5"] >= DEVICE_MS, key
        # At D = 0 the simulated device only hands back its buffers: the step is nearly all host.
        assert point["device_ms_elapsed"]["0"] < point["period_ms"]["0"], key

    table = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(rows)  # header, rule, one line per point
    assert "period at D = 0.5 ms" in table[0]
    assert any("| structured |" in line for line in table)


@pytest.mark.timeout(300)
def test_host_sections_reports_each_part_of_the_step(tmp_path):
    """bench/host_sections.py at its smallest: a row per context, each part's min / median a real
    time, no part's minimum above the whole step's. No speed is asserted."""
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "host_sections.py"), "--batch", "2", "--contexts", "32,64",
         "--variant", "penalties", "--steps", "3"], cwd=REPO, capture_output=True, text=True, timeout=290)
    assert result.returncode == 0, result.stderr[-3000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert table[0].split("|")[2:-1] == [" scheduler ", " input tensors ", " sampling ", " engine outputs ",
                                          " whole step "]
    rows = table[2:]
    assert [row.split("|")[1].strip() for row in rows] == ["2 x 32 penalties", "2 x 64 penalties"]
    for row in rows:
        cells = [[float(x) for x in cell.split("/")] for cell in row.split("|")[2:-1]]
        assert all(0 < low <= median for low, median in cells), row
        # Every part runs inside the step, so in each step it takes no more: nor does its minimum.
        assert all(low <= cells[-1][0] for low, _ in cells[:-1]), row
