"""Tokens per engine step, kept as a histogram the metrics collector reads at scrape time.

The engine observes each step's tokens as vLLM counts them: the tokens the step generated, plus
the whole prompt of each sequence that got its first token in it (a prefill step that samples
counts prompt + 1; a step of prompt chunks only is not observed). The backend's ``/metrics`` reads the counts from another thread (``backend.server.metrics``). Each
observation is a bisect and two increments, so it costs nothing per step.
"""

from __future__ import annotations

import bisect

# Bucket upper bounds in tokens (vLLM's iteration_tokens_total uses powers of two up to its budget).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class TokenHistogram:
    """Counts of observed values per bucket (``bounds`` ascending; the last bucket is +Inf)."""

    def __init__(self, bounds: tuple[int, ...] = ITERATION_TOKEN_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # not cumulative; counts[-1]: above the last bound
        self.sum = 0

    def observe(self, value: int) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> tuple[list[tuple[str, int]], int]:
        """Prometheus' form: ``[(upper bound, cumulative count), ..., ("+Inf", total)]`` and the sum.
        Read from another thread while the engine steps: a snapshot of the counts, the sum read
        after it (it may include a step the counts do not)."""
        counts, total = list(self.counts), 0
        buckets = []
        # Bounds as Prometheus writes them ("16.0"); the engine core does not import prometheus_client,
        # which a GPU machine running bench/gpu_check.py may lack.
        for bound, count in zip((*(repr(float(b)) for b in self.bounds), "+Inf"), counts):
            total += count
            buckets.append((bound, total))
        return buckets, self.sum
