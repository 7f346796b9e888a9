"""Shared by the distributed tests: child-process bookkeeping and engine runs."""

from __future__ import annotations

import os
import time

import pytest


def child_pids(parent: int | None = None) -> set[int]:
    """PIDs of the live (or not yet reaped) children of ``parent`` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # pid (comm) state ppid ...: comm may hold spaces, so split after its ")".
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.add(int(entry))
    return found


def is_alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped by whoever adopted it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition, timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll ``condition`` until true; fail naming ``what`` after ``timeout`` s. Returns seconds waited."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what}: not after {timeout} s")
        time.sleep(interval)
    return time.monotonic() - start


@pytest.fixture
def no_leftover_children():
    """The test leaves no child process behind (whatever it started, it stopped)."""
    before = child_pids()
    yield
    wait_until(lambda: child_pids() <= before, 10, f"child processes left: {child_pids() - before}")
