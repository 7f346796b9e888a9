"""A request's stream through the router (frontend/router.py): aborts reach the backend running it,
and closing the stream closes the backend client's at once.

The backends are fakes (tests/router_fakes.py).
"""

from __future__ import annotations

from router_fakes import make_router, run

from backend.types.outputs import EngineOutput, FinishReason
from backend.types.sampling_params import SamplingParams


def test_abort_goes_to_the_backend_running_the_request():
    async def scenario():
        router, fakes = make_router()
        await router.refresh()
        stream = router.generate("req-1", [3] * 8, SamplingParams())
        await anext(stream)
        await router.abort("req-1")
        await router.abort("unknown")
        await stream.aclose()
        await router.close()
        return {a: f.aborted for a, f in fakes.items() if f.aborted}

    aborted = run(scenario())
    assert list(aborted.values()) == [["req-1"]]


def test_closing_a_stream_closes_the_backend_clients_stream_at_once():
    """The backend client's stream is closed with the router's, in the same task (its cleanup,
    e.g. an abort, is not left to the event loop's finalizer for async generators)."""
    async def scenario():
        router, fakes = make_router(("a:1",))
        await router.refresh()
        closed = []

        async def generate(request_id, prompt_token_ids, params, **options):
            try:
                yield EngineOutput(request_id, 0, [1])
                yield EngineOutput(request_id, 0, [2], finish_reason=FinishReason.LENGTH)
            finally:
                closed.append(request_id)

        fakes["a:1"].generate = generate
        stream = router.generate("r", [3], SamplingParams())
        await anext(stream)
        await stream.aclose()
        closed_with_it = list(closed)  # before any other task or callback has run
        await router.close()
        return closed_with_it

    assert run(scenario()) == ["r"]
