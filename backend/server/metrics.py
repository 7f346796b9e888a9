"""Prometheus metrics of one backend, under vLLM's names with the ``tandem:`` prefix.

Gauges and counters are read from the engine core at scrape time (a custom
collector), so they cannot drift from the engine's own numbers. Histograms are
observed by the gRPC servicer, which sees each sequence's timeline. Each
``EngineMetrics`` has its own ``CollectorRegistry``, so one process (a test)
can run several servers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from backend.engine.llm_engine import LLMEngine

# Bucket bounds (seconds / tokens), close to vLLM's.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)
# A sequence's phases (seconds): queued, prefill (to its first token), inference (scheduled to its end).
_PHASE_BUCKETS = _E2E_BUCKETS
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)


class _EngineCollector(Collector):
    """Reads the engine core's load and totals whenever Prometheus scrapes.

    Runs on the metrics server's thread while the engine thread steps: it only
    reads ints and list lengths, which is safe under the GIL.
    """

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        load = self._engine.get_load()
        values = (
            (GaugeMetricFamily, "tandem:num_requests_running",
             "Number of sequences running on the engine.", load.num_requests_running),
            (GaugeMetricFamily, "tandem:num_requests_waiting",
             "Number of sequences waiting to run, preempted ones included.", load.num_requests_waiting),
            (GaugeMetricFamily, "tandem:kv_cache_usage_perc",
             "Fraction of KV-cache blocks in use (1 = full).", load.kv_cache_usage),
            (CounterMetricFamily, "tandem:prompt_tokens",
             "Prompt tokens of the sequences that got their first token (prefix-cache hits included).",
             self._engine.num_prompt_tokens_total),
            (CounterMetricFamily, "tandem:prompt_tokens_computed",
             "Prompt tokens the model ran (prefix-cache hits excluded, recomputed ones included).",
             self._engine.num_prompt_tokens_computed_total),
            (CounterMetricFamily, "tandem:generation_tokens",
             "Tokens generated.", self._engine.num_generation_tokens_total),
            (CounterMetricFamily, "tandem:num_preemptions",
             "Sequences preempted to free KV-cache blocks.", self._engine.scheduler.num_preemptions_total),
        )
        if self._engine.proposer is not None:  # as vLLM: only with speculative decoding configured
            values += (
                (CounterMetricFamily, "tandem:spec_decode_num_draft_tokens",
                 "Speculative tokens proposed.", self._engine.num_draft_tokens_total),
                (CounterMetricFamily, "tandem:spec_decode_num_accepted_tokens",
                 "Speculative tokens accepted.", self._engine.num_accepted_tokens_total),
            )
        for family, name, documentation, value in values:
            metric = family(name, documentation, labels=["model_name"])
            metric.add_metric([self._model_name], value)
            yield metric
        config = self._engine.config
        info = GaugeMetricFamily("tandem:cache_config_info", "The KV cache's configuration (value 1).",
                                 labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"])
        info.add_metric([str(config.block_size), str(self._engine.block_manager.num_blocks),
                         str(config.enable_prefix_caching), str(config.kv_cache_dtype_name)], 1)
        yield info
        buckets, total = self._engine.iteration_tokens.cumulative()
        iteration = HistogramMetricFamily("tandem:iteration_tokens_total",
                                          "Tokens per engine step: those generated, plus the whole prompt of each "
                                          "sequence given its first token.",
                                          labels=["model_name"])
        iteration.add_metric([self._model_name], buckets, total)
        yield iteration


class EngineMetrics:
    """All metrics of one served model, in a registry of their own."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self._model_name = model_name
        self._http_server: Optional[WSGIServer] = None

        def histogram(name: str, documentation: str, buckets: tuple) -> Histogram:
            return Histogram(name, documentation, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self._time_to_first_token = histogram(
            "tandem:time_to_first_token_seconds", "Seconds from arrival to a sequence's first token.",
            _TTFT_BUCKETS)
        self._time_per_output_token = histogram(
            "tandem:time_per_output_token_seconds", "Seconds between a sequence's successive tokens.",
            _TPOT_BUCKETS)
        self._e2e_request_latency = histogram(
            "tandem:e2e_request_latency_seconds", "Seconds from arrival to a sequence's end.",
            _E2E_BUCKETS)
        self._request_prompt_tokens = histogram(
            "tandem:request_prompt_tokens", "Prompt length of each finished sequence.", _TOKEN_BUCKETS)
        self._request_generation_tokens = histogram(
            "tandem:request_generation_tokens", "Tokens generated by each finished sequence.",
            _TOKEN_BUCKETS)
        self._request_params_n = histogram(
            "tandem:request_params_n", "The n of each finished request.", _N_BUCKETS)
        self._request_params_max_tokens = histogram(
            "tandem:request_params_max_tokens", "The max_tokens of each finished sequence.", _TOKEN_BUCKETS)
        self._request_decode_time = histogram(
            "tandem:request_decode_time_seconds", "Seconds from a sequence's first token to its end.",
            _E2E_BUCKETS)
        self._request_queue_time = histogram(
            "tandem:request_queue_time_seconds", "Seconds from a sequence's arrival to its first schedule "
            "(waiting in the queue; a grammar's compile included).", _PHASE_BUCKETS)
        self._request_prefill_time = histogram(
            "tandem:request_prefill_time_seconds", "Seconds from a sequence's first schedule to its first token.",
            _PHASE_BUCKETS)
        self._request_inference_time = histogram(
            "tandem:request_inference_time_seconds", "Seconds from a sequence's first schedule to its end.",
            _PHASE_BUCKETS)
        self._inter_token_latency = histogram(
            "tandem:inter_token_latency_seconds", "Seconds between a sequence's successive tokens.",
            _TPOT_BUCKETS)
        self._request_success = Counter(
            "tandem:request_success", "Finished sequences, by why they finished (stop, length, abort).",
            ["model_name", "finished_reason"], registry=self.registry)
        self._prefix_cache_queries = Counter(
            "tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", ["model_name"],
            registry=self.registry).labels(model_name)
        self._prefix_cache_hits = Counter(
            "tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed again).",
            ["model_name"], registry=self.registry).labels(model_name)
        self._rejected = Counter(
            "tandem:grpc_errors", "gRPC calls ended with an error status, by method and status code "
            "(invalid_argument, resource_exhausted = admission control, unavailable, unauthenticated, ...).",
            ["model_name", "method", "code"], registry=self.registry)
        self._deadline_expired = Counter(
            "tandem:request_deadline_expired", "Generate calls cut off by their deadline.", ["model_name"],
            registry=self.registry).labels(model_name)
        self._engine_errors = Counter(
            "tandem:engine_errors", "Engine steps that failed (each one kills the engine).", ["model_name"],
            registry=self.registry).labels(model_name)

    def observe_first_token(self, seconds: float) -> None:
        self._time_to_first_token.observe(seconds)

    def observe_prefix_cache(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A request's prompt was scheduled: ``num_cached_tokens`` of it came from the cache."""
        self._prefix_cache_queries.inc(num_prompt_tokens)
        self._prefix_cache_hits.inc(num_cached_tokens)

    def observe_token_interval(self, seconds: float) -> None:
        self._time_per_output_token.observe(seconds)
        self._inter_token_latency.observe(seconds)

    def observe_params(self, n: int, max_tokens: Optional[int]) -> None:
        """A request's parameters, once per request (vLLM's request_params_*)."""
        self._request_params_n.observe(n)
        if max_tokens is not None:
            self._request_params_max_tokens.observe(max_tokens)

    def observe_scheduled(self, queue_seconds: float, prefill_seconds: float) -> None:
        """A sequence's first token came: how long it waited to be scheduled, then to get the token."""
        self._request_queue_time.observe(queue_seconds)
        self._request_prefill_time.observe(prefill_seconds)

    def observe_inference_time(self, seconds: float) -> None:
        self._request_inference_time.observe(seconds)

    def observe_decode_time(self, seconds: float) -> None:
        self._request_decode_time.observe(seconds)

    def observe_finished(self, seconds: float, num_prompt_tokens: int, num_generation_tokens: int,
                         finished_reason: str) -> None:
        """One sequence ended (any reason, abort included: vLLM counts those too)."""
        self._e2e_request_latency.observe(seconds)
        self._request_prompt_tokens.observe(num_prompt_tokens)
        self._request_generation_tokens.observe(num_generation_tokens)
        self._request_success.labels(self._model_name, finished_reason).inc()

    def observe_rejected(self, method: str, code: str) -> None:
        self._rejected.labels(self._model_name, method, code).inc()

    def observe_deadline_expired(self) -> None:
        self._deadline_expired.inc()

    def observe_engine_error(self) -> None:
        self._engine_errors.inc()

    def start_http_server(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on a thread; returns the bound port (port 0 picks a free one)."""
        self._http_server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self._http_server.server_port

    def stop_http_server(self) -> None:
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None
