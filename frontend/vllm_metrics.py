"""The engine's metric families also under vLLM's names, for dashboards and tools built for vLLM.

The backends export ``tandem:``-prefixed families named as vLLM's (``tandem:num_requests_running``
is vLLM's ``vllm:num_requests_running``). The API port's ``/metrics`` serves each family vLLM also
has a second time, prefixed ``vllm:``, with the same samples and labels
(``frontend.serving.status``). Families vLLM has no counterpart for (the gRPC and router ones)
keep their ``tandem:`` name only. Torch-free.
"""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from frontend.router_metrics import Families

TANDEM_PREFIX = "tandem:"
VLLM_PREFIX = "vllm:"
# The engine families (names without a prefix) whose meaning is vLLM's family of the same name.
VLLM_FAMILIES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions",
    "prompt_tokens", "generation_tokens", "cache_config_info", "iteration_tokens_total",
    "time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
    "request_inference_time_seconds", "request_decode_time_seconds",
    "request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens",
    "request_success", "prefix_cache_queries", "prefix_cache_hits",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
})


def vllm_named(text: str) -> str:
    """The families of an engine exposition (``text``) that vLLM also has, renamed ``vllm:...``, as
    an exposition of their own (empty when there are none)."""
    renamed = []
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(TANDEM_PREFIX) or family.name[len(TANDEM_PREFIX):] not in VLLM_FAMILIES:
            continue
        copy = Metric(VLLM_PREFIX + family.name[len(TANDEM_PREFIX):], family.documentation, family.type, family.unit)
        copy.samples = [sample._replace(name=VLLM_PREFIX + sample.name[len(TANDEM_PREFIX):])
                        for sample in family.samples]
        renamed.append(copy)
    return generate_latest(Families(renamed)).decode() if renamed else ""
