"""`tandem serve` end to end: real backend and frontend processes on loopback, the `openai` client.

One `tandem serve` on a tiny random Llama runs for the whole module; the
SIGINT and child-failure tests start their own. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.grpc_client import ChannelSecurity, GrpcEngineClient
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "256"]
STARTUP_TIMEOUT_S = 90
# The module's serve gets this backend token (as $TANDEM_GRPC_TOKEN), so tests can call its gRPC port.
GRPC_TOKEN = "serve-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str) -> Optional[int]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def child_pids(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (from /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return children


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Served:
    process: subprocess.Popen
    log: Path
    port: int
    grpc_port: int
    metrics_port: int
    model: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, port: Optional[int] = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{port or self.port}/v1", api_key="unused",
                             max_retries=0, timeout=60)


def start_serve(model_dir: Path, work_dir: Path, *flags: str,
                grpc_token: Optional[str] = GRPC_TOKEN) -> tuple[subprocess.Popen, Path, int, int, int]:
    """``tandem serve`` with ``flags``; ``grpc_token`` as $TANDEM_GRPC_TOKEN (None: unset)."""
    port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    log = work_dir / f"serve-{port}.log"
    command = [sys.executable, "-m", "frontend.entrypoints.cli", "serve", str(model_dir), "--port", str(port),
               "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), *ENGINE_FLAGS, *flags]
    env = {name: value for name, value in os.environ.items() if name not in ("TANDEM_GRPC_TOKEN", "TANDEM_API_KEY")}
    if grpc_token is not None:
        env["TANDEM_GRPC_TOKEN"] = grpc_token
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   env={**env, "TANDEM_CACHE": str(work_dir / "cache")})
    return process, log, port, grpc_port, metrics_port


def wait_until_serving(process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while "Tandem is serving" not in log.read_text(errors="replace"):
        assert process.poll() is None, f"tandem serve exited early:\n{log.read_text(errors='replace')}"
        assert time.monotonic() < deadline, f"tandem serve did not start:\n{log.read_text(errors='replace')}"
        time.sleep(0.2)


def stop(process: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 30) -> Optional[int]:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            return None
    return process.returncode


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory) -> Served:
    model_dir = tiny_checkpoint("llama")
    process, log, port, grpc_port, metrics_port = start_serve(model_dir, tmp_path_factory.mktemp("serve"))
    try:
        wait_until_serving(process, log)
        yield Served(process, log, port, grpc_port, metrics_port, str(model_dir))
    finally:
        stop(process)


def greedy_completion(client: openai.OpenAI, model: str, prompt, max_tokens: int = 12) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


# ---- the API through the openai client --------------------------------------------------------


def test_serve_prints_where_it_serves_and_lists_the_model(served):
    assert f"Tandem is serving {served.model} at http://127.0.0.1:{served.port}/v1" in served.log.read_text()
    assert [m.id for m in served.client().models.list().data] == [served.model]
    assert http_status(served.base_url + "/health") == 200


def test_completions_and_chat_streamed_and_not(served):
    client = served.client()
    completion = client.completions.create(model=served.model, prompt="The capital of France is", max_tokens=10,
                                           temperature=0)
    (choice,) = completion.choices
    assert completion.usage.completion_tokens == 10 and choice.finish_reason == "length" and choice.text
    chunks = list(client.completions.create(model=served.model, prompt="The capital of France is", max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"

    messages = [{"role": "user", "content": "Tell me about Paris."}]
    chat = client.chat.completions.create(model=served.model, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 8
    stream = list(client.chat.completions.create(model=served.model, messages=messages, max_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    assert stream[-1].choices == [] and stream[-1].usage.total_tokens == chat.usage.total_tokens
    assert [c.choices[0].finish_reason for c in stream if c.choices].count("length") == 1


def test_n_gives_indices_and_the_stream_contract_holds(served):
    client = served.client()
    response = client.completions.create(model=served.model, prompt=["Once upon", "def add"], max_tokens=6,
                                         temperature=0, n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text == response.choices[1].text  # greedy: both sequences agree
    chunks = list(client.completions.create(model=served.model, prompt=["Once upon", "def add"], max_tokens=6,
                                            temperature=0, n=2, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == response.usage.total_tokens
    for choice in response.choices:
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine].count("length") == 1 and mine[-1].finish_reason == "length"


def test_stop_string_is_honoured(served):
    client = served.client()
    text = greedy_completion(client, served.model, "Tandem serves", max_tokens=20)
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    response = client.completions.create(model=served.model, prompt="Tandem serves", max_tokens=20, temperature=0,
                                         stop=[stop])
    assert response.choices[0].text == text[:text.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_same_seed_same_text(served):
    client = served.client()

    def sample(seed: int) -> str:
        return client.completions.create(model=served.model, prompt="Once upon a time", max_tokens=16,
                                         temperature=1.0, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_logprobs_shapes(served):
    client = served.client()
    completion = client.completions.create(model=served.model, prompt="Hello", max_tokens=5, logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    # The chosen token and the top 3, keyed by text (tokens that read alike, e.g. lone bytes, share a key).
    assert all(token in top and len(top) <= 4 for token, top in zip(logprobs.tokens, logprobs.top_logprobs))
    chat = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob for entry in content)


def test_batch_prompts_come_back_in_order(served):
    client = served.client()
    prompts = ["The capital of France", "def add(a, b):", "Once upon a time"]
    expected = [greedy_completion(client, served.model, prompt, 8) for prompt in prompts]
    response = client.completions.create(model=served.model, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == expected


def test_errors_reach_the_openai_client_with_their_status(served):
    client = served.client()
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=served.model, prompt="Hi", max_tokens=1000)
    assert "maximum context length is 256 tokens" in str(error.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi")


def test_a_second_frontend_serves_from_the_same_backend(served, tmp_path):
    port = free_port()
    log = tmp_path / "frontend2.log"
    with open(log, "wb") as out:
        frontend = subprocess.Popen(
            [sys.executable, "-m", "frontend.server", "--backend", f"127.0.0.1:{served.grpc_port}",
             "--port", str(port)], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "TANDEM_CACHE": str(tmp_path / "cache"), "TANDEM_GRPC_TOKEN": GRPC_TOKEN})
    try:
        deadline = time.monotonic() + 60
        while http_status(f"http://127.0.0.1:{port}/health") != 200:
            assert frontend.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        prompt = "Tandem serves language models"

        async def both() -> list[str]:
            async def one(p: int) -> str:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{p}", timeout=60) as http:
                    response = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24,
                                                                         "temperature": 0})
                    return response.json()["choices"][0]["text"]

            return list(await asyncio.gather(one(served.port), one(port)))

        first, second = asyncio.run(both())
        assert first == second == greedy_completion(served.client(), served.model, prompt, 24)
    finally:
        assert stop(frontend, signal.SIGTERM) == 0


def aborted_sequences(served: Served) -> float:
    """The backend's count of sequences that ended by abort (its Prometheus endpoint)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{served.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "tandem:request_success_total" and sample.labels.get("finished_reason") == "abort")


def test_cancelled_streams_free_the_backend(served):
    """50 streams, closed by the client mid-generation: the backend aborts them all and ends idle."""
    aborted_before = aborted_sequences(served)

    async def scenario() -> tuple:
        engine = GrpcEngineClient(f"127.0.0.1:{served.grpc_port}", security=ChannelSecurity(auth_token=GRPC_TOKEN))
        started: set[int] = set()

        async def stream(http: httpx.AsyncClient, i: int) -> None:
            async with http.stream("POST", "/v1/completions", json={
                    "prompt": f"Request number {i}", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        started.add(i)

        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=served.base_url, timeout=60, limits=limits) as http:
            tasks = [asyncio.create_task(stream(http, i)) for i in range(50)]
            deadline = time.monotonic() + 30
            while len(started) < 10 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            before = await engine.get_load()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            finished_early = sum(task.done() and not task.cancelled() for task in tasks)
        deadline = time.monotonic() + 15
        after = await engine.get_load()
        while (after.num_requests_running, after.num_requests_waiting, after.kv_cache_usage) != (0, 0, 0.0):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
            after = await engine.get_load()
        await engine.close()
        return len(started), before, after, finished_early

    started, before, after, finished_early = asyncio.run(scenario())
    assert started >= 10 and finished_early == 0
    assert before.num_requests_running + before.num_requests_waiting > 0  # cancelled mid-generation
    assert (after.num_requests_running, after.num_requests_waiting, after.kv_cache_usage) == (0, 0, 0.0)
    assert aborted_sequences(served) - aborted_before == 50  # none ran to max_tokens


# ---- process lifecycle ------------------------------------------------------------------------


def test_sigint_stops_both_children_and_exits_zero(tiny_checkpoint, tmp_path):
    process, log, port, _, _ = start_serve(tiny_checkpoint("llama"), tmp_path)
    try:
        wait_until_serving(process, log)
        children = child_pids(process.pid)
        assert len(children) == 2 and all(is_running(pid) for pid in children)
        started = time.monotonic()
        assert stop(process, signal.SIGINT, timeout=40) == 0, log.read_text()
        assert time.monotonic() - started < 40
        assert not any(is_running(pid) for pid in children)
        assert http_status(f"http://127.0.0.1:{port}/health") is None
    finally:
        stop(process, signal.SIGKILL)


def environ_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").partition("=")[::2] for entry in entries if entry)


@pytest.mark.timeout(STARTUP_TIMEOUT_S + 60)
def test_serve_with_only_an_api_key_closes_its_grpc_port_to_callers_without_the_token(tiny_checkpoint, tmp_path):
    """Acceptance: `tandem serve --api-key K` and no other flag; gRPC without credentials is
    UNAUTHENTICATED. The token is made for the run and reaches both children by the environment."""
    process, log, port, grpc_port, _ = start_serve(tiny_checkpoint("llama"), tmp_path, "--api-key", "K",
                                                   grpc_token=None)
    try:
        wait_until_serving(process, log)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            with pytest.raises(grpc.RpcError) as error:
                stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(engine_pb2.GenerateRequest(
                    request_id="intruder", prompt_token_ids=[1, 2],
                    sampling_params=engine_pb2.SamplingParams(max_tokens=2)), timeout=10))
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Its own frontend holds the token: the API works with the key.
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="K", max_retries=0, timeout=60)
        assert client.completions.create(model=str(tiny_checkpoint("llama")), prompt="Hi", max_tokens=2).choices
        children = child_pids(process.pid)
        tokens = {environ_of(pid).get("TANDEM_GRPC_TOKEN") for pid in children}
        (token,) = tokens
        assert len(children) == 2 and token and len(token) >= 32
        for pid in children:  # never on a command line, where `ps` would show it
            assert token not in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    finally:
        stop(process, signal.SIGINT)


def test_a_dying_backend_stops_the_frontend_and_fails(tmp_path):
    process, log, _, _, _ = start_serve(tmp_path / "no-such-model", tmp_path)
    try:
        assert process.wait(timeout=60) == 1
        output = log.read_text()
        assert "error: the backend exited with code 1" in output
        assert "no-such-model" in output  # the backend said why
    finally:
        stop(process, signal.SIGKILL)


def test_one_scrape_of_the_frontend_gives_http_and_engine_metrics(served):
    greedy_completion(served.client(), served.model, "Metrics, please", 3)
    with urllib.request.urlopen(f"{served.base_url}/metrics", timeout=5) as response:
        families = {family.name: family for family in text_string_to_metric_families(response.read().decode())}
    for name in ("tandem:http_requests", "tandem:num_requests_running", "tandem:kv_cache_usage_perc",
                 "tandem:prefix_cache_queries", "tandem:prefix_cache_hits", "tandem:cache_config_info",
                 "tandem:inter_token_latency_seconds", "tandem:request_params_n",
                 "tandem:request_params_max_tokens", "tandem:request_decode_time_seconds",
                 # and under vLLM's names (frontend/vllm_metrics.py), with the phase and step families
                 "vllm:num_requests_running", "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:iteration_tokens_total"):
        assert name in families, name
    queries = [s.value for s in families["tandem:prefix_cache_queries"].samples if s.name.endswith("_total")]
    assert queries and queries[0] > 0
    (config,) = families["tandem:cache_config_info"].samples
    assert config.labels["enable_prefix_caching"] == "True" and config.value == 1
