"""/v1/responses' stored responses are kept by the backends: two frontends, each routing over the
same two backends (as behind a load balancer), continue, return and delete each other's responses."""

from __future__ import annotations

import asyncio

import openai
import pytest
from helpers import LoopThread, tiny_llama_1k_engine, uvicorn_on

from backend.server.grpc_server import BackendServer
from frontend.app import create_app
from frontend.backend_response_store import BackendResponseStore
from frontend.router import Router, parse_targets
from frontend.tokenizer import load_tokenizer


@pytest.mark.timeout(300)
def test_a_response_stored_through_one_frontend_is_continued_returned_and_deleted_through_another(
        tiny_checkpoint, tmp_path):
    loop = LoopThread()
    engine = tiny_llama_1k_engine(tiny_checkpoint("llama"), tmp_path / "tiny-llama", num_kv_blocks=512)
    backends = [BackendServer(engine, "127.0.0.1", 0) for _ in range(2)]  # two stores, one engine
    routers = []
    try:
        for backend in backends:
            loop.run(backend.start())
        addresses = ",".join(f"127.0.0.1:{b.port}" for b in backends)
        info = engine.engine.model_info()
        tokenizer = load_tokenizer(info.tokenizer_path)

        async def start_router() -> Router:
            router = Router(parse_targets(addresses), check_interval=0.5)
            await router.start()
            while sum(b.usable for b in router.backends.values()) < 2:
                await asyncio.sleep(0.05)
            return router

        routers = [loop.run(asyncio.wait_for(start_router(), 30)) for _ in range(2)]
        apps = [create_app(router, tokenizer, info, response_store=BackendResponseStore(router)) for router in routers]
        with uvicorn_on(loop, apps[0]) as url_a, uvicorn_on(loop, apps[1]) as url_b:
            a, b = (openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
                    for url in (url_a, url_b))
            first = a.responses.create(model=info.model_name, input="Hello there", max_output_tokens=4, temperature=0)
            held = [len(backend.servicer._stored_responses) for backend in backends]
            assert sorted(held) == [0, 1]  # on one backend only: the other frontend must ask both

            second = b.responses.create(model=info.model_name, input="And again", previous_response_id=first.id,
                                        max_output_tokens=4, temperature=0)
            assert second.previous_response_id == first.id and second.status == "incomplete"
            assert b.responses.retrieve(first.id).output_text == first.output_text
            events = list(b.responses.create(model=info.model_name, input="Once more", previous_response_id=second.id,
                                             max_output_tokens=3, temperature=0, stream=True))
            assert events[-1].type == "response.incomplete"  # cut by max_output_tokens, stored all the same
            third = events[-1].response
            assert a.responses.retrieve(third.id).output_text == third.output_text  # stored before its last event

            b.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                a.responses.retrieve(first.id)
            with pytest.raises(openai.NotFoundError):
                a.responses.create(model=info.model_name, input="Hi", previous_response_id=first.id)
            unstored = a.responses.create(model=info.model_name, input="Hi", max_output_tokens=2, store=False)
            with pytest.raises(openai.NotFoundError):
                b.responses.retrieve(unstored.id)
            assert sum(len(backend.servicer._stored_responses) for backend in backends) == 2  # second, third
    finally:
        for router in routers:
            loop.run(router.close())
        for backend in backends:
            loop.run(backend.stop(0))
        engine.shutdown()
        loop.close()
