"""Start-up progress: one line per phase, so whoever waits sees what runs and how long it took.

    [start-up] PHASE: WHAT (S.S s)

Each line is logged at INFO by the module doing the work: ``model`` (found, or fetched and
converted), ``CPU kernels`` (built or loaded; on a CPU engine in the background beside ``model``,
its WHAT then ending "in the background"), ``weights``, ``KV cache``, ``decode graphs`` and
``ready`` (whose seconds count from the process's start). ``PHASE_LINE`` reads them back
(bench/startup.py and the tests). ``tandem_kernels``, which imports nothing of the backend, writes
the same format itself (tandem_kernels/cpu.py).

Torch-free (stdlib only): the frontend's entry points use it too.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Optional

TAG = "[start-up]"
PHASE_LINE = re.compile(r"\[start-up\] (?P<phase>[^:]+): (?P<what>.*) \((?P<seconds>\d+(?:\.\d+)?) s\)\s*$")

_IMPORTED_AT = time.monotonic()  # the fallback start where /proc cannot say


def log_phase(logger: logging.Logger, phase: str, what: str, seconds: float) -> None:
    """Log one phase line (``phase`` must hold no colon: it ends at the first one)."""
    logger.info("%s %s: %s (%.1f s)", TAG, phase, what, seconds)


def parse_phases(text: str) -> list[tuple[str, str, float]]:
    """The (phase, what, seconds) of every phase line in ``text`` (a log), in order."""
    found = []
    for line in text.splitlines():
        match = PHASE_LINE.search(line)
        if match:
            found.append((match["phase"], match["what"], float(match["seconds"])))
    return found


def seconds_since_process_start() -> float:
    """Seconds since this process started (its interpreter's start-up and imports included): from
    /proc on Linux, else since this module was imported."""
    started = _process_start_uptime()
    if started is not None:
        try:
            with open("/proc/uptime") as f:
                return max(0.0, float(f.read().split()[0]) - started)
        except (OSError, ValueError, IndexError):
            pass
    return time.monotonic() - _IMPORTED_AT


def _process_start_uptime() -> Optional[float]:
    """When this process started, in seconds after boot (field 22 of /proc/self/stat), or None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
