"""The router's metrics: its own state as a Prometheus collector, and the backends' engine metrics
merged into one exposition (torch-free; ``frontend.router.Router.collector`` and ``metrics_text``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Iterator

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from backend.types.errors import TandemError

logger = logging.getLogger(__name__)


async def merged_engine_metrics(backends: list, timeout_s: float) -> str:
    """The ``backends``' engine metrics (each client's ``metrics_text``) as one Prometheus text
    exposition, every sample labelled with its ``backend`` address, so several backends' families
    merge instead of repeating. A backend that fails or takes over ``timeout_s`` is left out (logged)."""
    texts = await asyncio.gather(*(asyncio.wait_for(b.client.metrics_text(), timeout_s) for b in backends),
                                 return_exceptions=True)
    families: dict[str, Metric] = {}
    for backend, text in zip(backends, texts):
        if isinstance(text, (TandemError, asyncio.TimeoutError)):
            logger.warning("Could not fetch the metrics of backend %s: %s", backend.address, text or "timed out")
            continue
        if isinstance(text, BaseException):
            raise text
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation,
                                                             family.type, family.unit))
            merged.samples.extend(sample._replace(labels={**sample.labels, "backend": backend.address})
                                  for sample in family.samples)
    return generate_latest(Families(list(families.values()))).decode()


class Families(Collector):
    """Metric families already collected (what ``generate_latest`` renders)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


class RouterCollector(Collector):
    """Requests per backend and reason, and each backend's health and load, read at scrape time."""

    def __init__(self, router) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("tandem:router_requests", "Requests sent to each backend, by why it was "
                                       "chosen (prefix, load, round-robin, least-loaded).",
                                       labels=["backend", "reason"])
        healthy = GaugeMetricFamily("tandem:router_backend_healthy", "1 while the backend takes requests.",
                                    labels=["backend"])
        load = GaugeMetricFamily("tandem:router_backend_load", "The backend's running + waiting sequences, "
                                 "as the router estimates them.", labels=["backend"])
        for backend in self._router.backends.values():
            for reason, count in backend.requests.items():
                requests.add_metric([backend.address, reason], count)
            healthy.add_metric([backend.address], float(backend.usable))
            load.add_metric([backend.address], backend.load)
        yield from (requests, healthy, load)
