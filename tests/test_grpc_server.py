"""The backend's gRPC server (backend/server/) and the frontend's GrpcEngineClient, on CPU.

One server runs on a tiny random Llama for the whole module, on an event loop
of its own thread; tests talk to it through the generated stubs (as any client
in any language would) and through GrpcEngineClient. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import LoopThread
from prometheus_client.parser import text_string_to_metric_families

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.engine.llm_engine import LLMEngine
from backend.server import grpc_logs
from backend.server import servicer as server_module
from backend.server.grpc_server import BackendServer
from backend.server.servicer import EngineServicer
from backend.types.config import EngineConfig
from backend.types.errors import EngineDeadError
from backend.types.sampling_params import SamplingParams
from backend.types.tokenizer_files import tokenizer_fingerprint
from frontend.grpc_client import BackendUnavailableError, GrpcEngineClient
from protos.grpc.reflection.v1 import reflection_pb2 as reflection_v1_pb2
from protos.grpc.reflection.v1 import reflection_pb2_grpc as reflection_v1_pb2_grpc
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 64
NUM_BLOCKS = 64
VOCAB = 384  # conftest's tiny models
FINISH = engine_pb2.FinishReason


def engine_config(model_dir: Path) -> EngineConfig:
    # max_num_seqs=4 and 64 blocks of 4 tokens: many streams wait, some get preempted.
    return EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=4,
                        max_model_len=MAX_MODEL_LEN, max_num_seqs=4)


@dataclass
class Backend:
    model_dir: Path
    engine: AsyncLLMEngine
    server: BackendServer
    loop: LoopThread
    address: str
    channel: grpc.Channel
    stub: engine_pb2_grpc.EngineServiceStub


@pytest.fixture(scope="module")
def backend(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    loop = LoopThread()
    engine = AsyncLLMEngine(engine_config(model_dir))
    server = BackendServer(engine, "127.0.0.1", 0, metrics_port=0)
    loop.run(server.start())
    address = f"127.0.0.1:{server.port}"
    channel = grpc.insecure_channel(address)
    yield Backend(model_dir, engine, server, loop, address, channel, engine_pb2_grpc.EngineServiceStub(channel))
    channel.close()
    loop.run(server.stop(0))
    engine.shutdown()
    loop.close()


@pytest.fixture
def slow_steps(backend, monkeypatch):
    """Each engine step takes 10 ms more, so streams are surely still running when a test cuts them."""
    step = backend.engine.engine.step

    def slow_step():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(backend.engine.engine, "step", slow_step)


def generate_request(request_id: str, prompt: list[int], **params) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                      sampling_params=engine_pb2.SamplingParams(**params))


def wait_until_idle(backend: Backend, timeout: float = 10.0) -> None:
    """Poll GetLoad until nothing runs, waits or holds a KV block (the engine's own count agrees)."""
    deadline = time.monotonic() + timeout
    while True:
        load = backend.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
        free = backend.engine.engine.block_manager.num_free_blocks
        if (load.num_requests_running, load.num_requests_waiting, load.kv_cache_usage, free) == (0, 0, 0.0, NUM_BLOCKS):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"backend still busy after {timeout} s: {load} free blocks {free}/{NUM_BLOCKS}")
        time.sleep(0.05)


def reference_outputs(model_dir: Path, prompt: list[int], params: SamplingParams):
    """The same request run on a fresh LLMEngine, stepped directly in this thread."""
    engine = LLMEngine(engine_config(model_dir))
    try:
        engine.add_request("reference", prompt, params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs.extend(engine.step())
        return outputs
    finally:
        engine.shutdown()


# ---- Generate ----------------------------------------------------------------------------------


def test_greedy_stream_equals_the_engine_run_directly(backend):
    prompt = [11, 22, 33, 44, 55, 66, 77]
    responses = list(backend.stub.Generate(
        generate_request("greedy", prompt, temperature=0.0, max_tokens=12, logprobs=2, prompt_logprobs=1),
        timeout=30))
    expected = reference_outputs(backend.model_dir, prompt,
                                 SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, prompt_logprobs=1))

    assert [t for r in responses for t in r.new_token_ids] == [t for o in expected for t in o.new_token_ids]
    assert [r.num_completion_tokens for r in responses] == list(range(1, 13))
    assert [r.finish_reason for r in responses] == \
        [FINISH.FINISH_REASON_UNSPECIFIED] * 11 + [FINISH.FINISH_REASON_LENGTH]
    assert all(r.num_prompt_tokens == len(prompt) and r.index == 0 for r in responses)
    # Logprobs: the chosen token first (rank 1 when greedy), then the top alternatives.
    for response, output in zip(responses, expected):
        (position,) = response.new_logprobs
        (token_id, chosen), *alternatives = output.new_logprobs[0].items()
        assert (position.token.token_id, position.token.rank) == (token_id, chosen.rank)
        assert (token_id, chosen.rank) == (response.new_token_ids[0], 1)
        assert position.token.logprob == pytest.approx(chosen.logprob, abs=1e-5)
        assert [a.token_id for a in position.top_logprobs] == [t for t, _ in alternatives]
    # Prompt logprobs only with the first response; position 0 has none.
    assert responses[0].HasField("prompt_logprobs") and not responses[1].HasField("prompt_logprobs")
    assert [p.token.token_id for p in responses[0].prompt_logprobs.positions] == prompt[1:]
    wait_until_idle(backend)


def generated_tokens(backend: Backend) -> int:
    return backend.engine.engine.num_generation_tokens_total


def test_cancelled_stream_and_passed_deadline_free_the_request(backend, slow_steps):
    before = generated_tokens(backend)
    call = backend.stub.Generate(generate_request("to-cancel", [5, 6, 7], max_tokens=50), timeout=30)
    for _, response in zip(range(3), call):
        assert response.finish_reason == FINISH.FINISH_REASON_UNSPECIFIED
    call.cancel()
    wait_until_idle(backend)
    assert generated_tokens(backend) - before < 50  # stopped early, not run to its end

    before = generated_tokens(backend)
    with pytest.raises(grpc.RpcError) as error:
        for _ in backend.stub.Generate(generate_request("too-slow", [8, 9], max_tokens=60), timeout=0.2):
            pass
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until_idle(backend)
    assert generated_tokens(backend) - before < 60


def test_200_concurrent_streams_cancelled_mid_generation_leave_no_load_within_2_s(backend, slow_steps):
    async def run() -> int:
        async with grpc.aio.insecure_channel(backend.address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            calls = [stub.Generate(generate_request(f"many-{i}", [1 + i % 300, 2, 3, 4], max_tokens=200, seed=i))
                     for i in range(200)]
            streaming = asyncio.Event()
            started = 0

            async def read(call):
                nonlocal started
                async for response in call:
                    if response.num_completion_tokens == 2:
                        started += 1
                        if started >= 4:
                            streaming.set()

            readers = [asyncio.create_task(read(call)) for call in calls]
            await streaming.wait()
            load = await stub.GetLoad(engine_pb2.GetLoadRequest())
            for call in calls:
                call.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            assert all(call.cancelled() for call in calls)  # none had finished: all were cut mid-way
            return load.num_requests_waiting

    before = generated_tokens(backend)
    waiting_while_busy = asyncio.run(asyncio.wait_for(run(), 60))
    assert waiting_while_busy > 0  # the scenario did queue requests behind max_num_seqs
    wait_until_idle(backend, timeout=2.0)
    assert generated_tokens(backend) - before < 200 * 10  # each of the 200 could have made 200


def test_a_started_backend_logs_a_status_its_caller_missed_at_info(backend):
    # The soak saw gRPC log, once in 76,000 requests, a status whose call the frontend had just cancelled.
    assert any(isinstance(f, grpc_logs.CallerGoneFilter) for f in logging.getLogger(grpc_logs.GRPC_CORE_LOGGER).filters)


@pytest.mark.parametrize("request_id, prompt, params, param, message", [
    ("empty-prompt", [], {}, "prompt", "empty"),
    ("top-p", [1, 2], {"top_p": 0.0}, "top_p", "top_p must be in (0, 1]"),
    ("temperature", [1, 2], {"temperature": -0.5}, "temperature", "temperature must be non-negative"),
    ("max-tokens", [1, 2], {"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1"),
    ("long-prompt", [3] * MAX_MODEL_LEN, {}, "prompt", "too long"),
    ("vocab", [1, VOCAB], {}, "prompt", f"Token ID {VOCAB} is out of vocabulary"),
    ("", [1, 2], {}, "request_id", "request_id must not be empty"),
])
def test_invalid_requests_get_invalid_argument_and_the_server_keeps_serving(backend, request_id, prompt, params,
                                                                             param, message):
    with pytest.raises(grpc.RpcError) as error:
        list(backend.stub.Generate(generate_request(request_id, prompt, **params), timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()
    assert dict(error.value.trailing_metadata())["tandem-error-param"] == param

    after = list(backend.stub.Generate(generate_request(f"ok-after-{param}", [1, 2], max_tokens=2), timeout=10))
    assert after[-1].finish_reason == FINISH.FINISH_REASON_LENGTH and after[-1].num_completion_tokens == 2


def test_a_dead_engine_makes_generate_unavailable(backend):
    class DeadEngine:
        async def generate(self, request_id, prompt_token_ids, params, **options):
            raise EngineDeadError("The engine stopped after an error: boom")
            yield  # an async generator, like AsyncLLMEngine.generate

        async def abort(self, request_id):
            pass

    async def start():
        server = grpc.aio.server()
        servicer = EngineServicer(DeadEngine(), str(backend.model_dir))
        engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    async def through_client(address: str):
        client = GrpcEngineClient(address)
        try:
            async for _ in client.generate("dead", [1, 2], SamplingParams()):
                pass
        finally:
            await client.close()

    server, port = backend.loop.run(start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as error:
                list(engine_pb2_grpc.EngineServiceStub(channel).Generate(generate_request("dead", [1, 2]), timeout=5))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "boom" in error.value.details()
        with pytest.raises(BackendUnavailableError, match="boom"):
            asyncio.run(asyncio.wait_for(through_client(f"127.0.0.1:{port}"), 10))
    finally:
        backend.loop.run(server.stop(None))


def test_abort_rpc_ends_each_sequence_with_abort_and_the_stream_ok(backend, slow_steps):
    call = backend.stub.Generate(generate_request("to-abort", [9, 8, 7], n=2, max_tokens=200, seed=1), timeout=30)
    before = [next(call) for _ in range(2)]
    backend.stub.Abort(engine_pb2.AbortRequest(request_ids=["to-abort", "never-existed"]), timeout=5)
    after = list(call)  # ends without an error

    assert call.code() == grpc.StatusCode.OK
    finals = [r for r in before + after if r.finish_reason != FINISH.FINISH_REASON_UNSPECIFIED]
    assert sorted(r.index for r in finals) == [0, 1]
    assert all(r.finish_reason == FINISH.FINISH_REASON_ABORT and not r.new_token_ids for r in finals)
    for final in finals:  # the final carries the sequence's total
        sent = sum(len(r.new_token_ids) for r in before + after if r.index == final.index)
        assert final.num_completion_tokens == sent < 200
    wait_until_idle(backend)


def test_n2_streams_two_sequences_that_each_finish_once(backend):
    responses = list(backend.stub.Generate(generate_request("pair", [4, 5, 6], n=2, max_tokens=5, seed=7), timeout=30))
    for index in (0, 1):
        mine = [r for r in responses if r.index == index]
        assert [r.num_completion_tokens for r in mine] == [1, 2, 3, 4, 5]
        assert [r.finish_reason for r in mine].count(FINISH.FINISH_REASON_LENGTH) == 1
        assert mine[-1].finish_reason == FINISH.FINISH_REASON_LENGTH
    assert len(responses) == 10


# ---- the other RPCs, health, reflection, metrics -------------------------------------------------


def test_health_and_reflection(backend):
    health = health_pb2_grpc.HealthStub(backend.channel)
    for service in ("", "tandem.engine.v1.EngineService"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING

    reflection = reflection_pb2_grpc.ServerReflectionStub(backend.channel)
    (reply,) = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               timeout=5)
    names = {service.name for service in reply.list_services_response.service}
    assert {"tandem.engine.v1.EngineService", "grpc.health.v1.Health"} <= names


def test_reflection_v1_answers_as_v1alpha_does(backend):
    """grpcurl asks grpc.reflection.v1: same services, same descriptors, errors and order as v1alpha."""
    def ask(pb2, stub_class):
        requests = [pb2.ServerReflectionRequest(list_services=""),
                    pb2.ServerReflectionRequest(file_containing_symbol="tandem.engine.v1.EngineService"),
                    pb2.ServerReflectionRequest(file_by_filename="tandem/engine/v1/engine.proto"),
                    pb2.ServerReflectionRequest(file_containing_symbol="no.such.Service")]
        replies = list(stub_class(backend.channel).ServerReflectionInfo(iter(requests), timeout=5))
        assert [reply.original_request for reply in replies] == requests  # one answer per request, in order
        return replies

    v1 = ask(reflection_v1_pb2, reflection_v1_pb2_grpc.ServerReflectionStub)
    v1alpha = ask(reflection_pb2, reflection_pb2_grpc.ServerReflectionStub)
    assert [reply.SerializeToString() for reply in v1] == [reply.SerializeToString() for reply in v1alpha]

    names = {service.name for service in v1[0].list_services_response.service}
    assert names == {"tandem.engine.v1.EngineService", "grpc.health.v1.Health",
                     "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}
    for reply in v1[1:3]:
        files = [descriptor_pb2.FileDescriptorProto.FromString(blob)
                 for blob in reply.file_descriptor_response.file_descriptor_proto]
        assert files[0].name == "tandem/engine/v1/engine.proto"
        assert "GenerateStream" in [method.name for method in files[0].service[0].method]
    assert v1[3].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_model_info_describes_the_model_and_its_tokenizer(backend):
    from frontend.tokenizer import tokenizer_fingerprint as frontend_fingerprint

    info = backend.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5)
    engine_info = backend.engine.engine.model_info()
    assert (info.model_name, info.max_model_len, info.vocab_size) == (str(backend.model_dir), MAX_MODEL_LEN, VOCAB)
    assert list(info.eos_token_ids) == engine_info.eos_token_ids
    assert info.HasField("bos_token_id") == (engine_info.bos_token_id is not None)
    assert info.hidden_size == engine_info.hidden_size == backend.engine.engine.config.hf_config.hidden_size
    # One fingerprint, whichever side computes it.
    assert info.tokenizer_fingerprint == tokenizer_fingerprint(str(backend.model_dir))
    assert info.tokenizer_fingerprint == frontend_fingerprint(str(backend.model_dir))
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    assert f'\nversion = "{info.backend_version}"\n' in pyproject


def test_get_tokenizer_chunks_files_that_rebuild_the_tokenizer(backend, tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setattr(server_module, "TOKENIZER_CHUNK_BYTES", 1000)  # force multi-chunk files
    chunks = list(backend.stub.GetTokenizer(engine_pb2.GetTokenizerRequest(), timeout=10))
    names = list(dict.fromkeys(c.file_name for c in chunks))
    assert names == sorted(names) and "tokenizer.json" in names and "chat_template.jinja" in names
    for name in names:
        mine = [c for c in chunks if c.file_name == name]
        assert [c.offset for c in mine] == list(range(0, len(mine) * 1000, 1000))[:len(mine)]
        assert sum(len(c.data) for c in mine) == mine[0].file_size == os.path.getsize(backend.model_dir / name)
    assert any(len([c for c in chunks if c.file_name == n]) > 1 for n in names)

    async def fetch() -> Path:
        client = GrpcEngineClient(backend.address)
        try:
            return await client.fetch_tokenizer(tmp_path / "tok")
        finally:
            await client.close()

    fetched = asyncio.run(asyncio.wait_for(fetch(), 30))
    assert tokenizer_fingerprint(str(fetched)) == tokenizer_fingerprint(str(backend.model_dir))
    original = PreTrainedTokenizerFast.from_pretrained(str(backend.model_dir))
    rebuilt = PreTrainedTokenizerFast.from_pretrained(str(fetched))
    for text in ("The capital of France is Paris.", "你好，世界！ 😀", "def add(a, b):"):
        assert rebuilt.encode(text) == original.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert rebuilt.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(chat, tokenize=False)


def scrape(backend: Backend) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from the server's /metrics."""
    url = f"http://127.0.0.1:{backend.server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_endpoint_exposes_vllm_names_and_counts_requests(backend):
    wait_until_idle(backend)
    model = (("model_name", str(backend.model_dir)),)
    before = scrape(backend)
    for name in ("tandem:num_requests_running", "tandem:num_requests_waiting", "tandem:kv_cache_usage_perc",
                 "tandem:prompt_tokens_total", "tandem:generation_tokens_total", "tandem:num_preemptions_total",
                 "tandem:time_to_first_token_seconds_count", "tandem:e2e_request_latency_seconds_count",
                 "tandem:time_per_output_token_seconds_count", "tandem:request_prompt_tokens_count",
                 "tandem:request_generation_tokens_count"):
        assert (name, model) in before, name

    list(backend.stub.Generate(generate_request("metered", [100, 101, 102, 103, 104], max_tokens=6), timeout=30))
    after = scrape(backend)

    def delta(name: str, labels: tuple = model) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert delta("tandem:generation_tokens_total") == 6
    assert delta("tandem:prompt_tokens_total") == 5  # the whole prompt, cached or not (vLLM's count)
    length = tuple(sorted(model + (("finished_reason", "length"),)))
    assert delta("tandem:request_success_total", length) == 1
    assert delta("tandem:time_to_first_token_seconds_count") == 1
    assert delta("tandem:time_per_output_token_seconds_count") == 5
    assert delta("tandem:request_generation_tokens_sum") == 6
    assert after[("tandem:num_requests_running", model)] == 0


def test_the_metrics_port_counts_whole_prompts_prefix_hits_included(backend):
    """vLLM's prompt_tokens_total on the backend's own port: both prompts in full, though the second's
    shared prefix came from the cache (counted apart, in prefix_cache_hits)."""
    wait_until_idle(backend)
    model = (("model_name", str(backend.model_dir)),)
    prefix = list(range(300, 324))  # 6 full blocks of 4
    prompts = [prefix + [7], prefix + [8, 9]]
    before = scrape(backend)
    for i, prompt in enumerate(prompts):
        request = engine_pb2.GenerateRequest(request_id=f"whole-prompt-{i}", prompt_token_ids=prompt,
                                             sampling_params=engine_pb2.SamplingParams(max_tokens=1))
        list(backend.stub.Generate(request, timeout=30))
    after = scrape(backend)

    def delta(name: str) -> float:
        return after.get((name, model), 0.0) - before.get((name, model), 0.0)

    assert delta("tandem:prefix_cache_hits_total") >= len(prefix)
    assert delta("tandem:prompt_tokens_total") == sum(map(len, prompts))
    # Tandem's own count of the prompt tokens the model ran: the cache hits left out.
    assert delta("tandem:prompt_tokens_computed_total") == sum(map(len, prompts)) - delta("tandem:prefix_cache_hits_total")


def test_cache_salt_isolates_prefixes_over_grpc(backend):
    prompt = list(range(200, 221))  # 5 full blocks of 4, and a token

    def cached(request_id: str, salt) -> int:
        request = engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, cache_salt=salt,
                                             sampling_params=engine_pb2.SamplingParams(max_tokens=1))
        return list(backend.stub.Generate(request, timeout=30))[-1].num_cached_tokens

    assert cached("salt-a-1", "tenant-a") == 0
    assert cached("salt-b-1", "tenant-b") == 0  # same prompt, another tenant: no hit
    assert cached("unsalted-1", None) == 0
    assert cached("salt-a-2", "tenant-a") == 20  # same tenant: its prefix is reused
    assert cached("unsalted-2", None) == 20
    wait_until_idle(backend)
