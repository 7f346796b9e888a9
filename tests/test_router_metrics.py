"""The router's /metrics text (frontend/router.py): the usable backends' families merged, each
sample labelled by its backend.

The backends are fakes (tests/router_fakes.py).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from router_fakes import make_router, refresh, run

from frontend.grpc_client import BackendUnavailableError


def test_metrics_text_merges_the_usable_backends_families_labelled_by_backend():
    async def scenario():
        router, fakes = make_router()
        await router.refresh()
        for i, fake in enumerate(fakes.values()):
            fake.num_running = i + 1
        all_three = await router.metrics_text()
        fakes["b:1"].metrics_error = BackendUnavailableError("b:1: connection refused")
        fakes["c:1"].healthy = False
        await refresh(router)
        only_a = await router.metrics_text()
        await router.close()
        return all_three, only_a

    def samples(text):
        families = list(text_string_to_metric_families(text))
        assert len({f.name for f in families}) == len(families)  # each family once
        return {(s.name, s.labels["backend"]): s.value for f in families for s in f.samples}

    all_three, only_a = run(scenario())
    assert samples(all_three) == {
        **{("tandem:num_requests_running", b): n for b, n in (("a:1", 1), ("b:1", 2), ("c:1", 3))},
        **{("tandem:generation_tokens_total", b): 10 * n for b, n in (("a:1", 1), ("b:1", 2), ("c:1", 3))}}
    assert samples(only_a) == {("tandem:num_requests_running", "a:1"): 1,
                               ("tandem:generation_tokens_total", "a:1"): 10}
