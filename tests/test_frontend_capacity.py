"""bench/frontend_capacity.py at its smallest, and the stand-in backend it drives (tests/stand_in_backend.py).

The bench starts the stand-in and a real frontend process and reports a row per workload and
concurrency; every figure must be real (tokens counted from each response's usage, CPU read from
/proc). No speed is asserted. The stand-in is checked through the frontend's own gRPC client:
it must answer every call that client makes, and stream exactly what it promises.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_tokenizer

from backend.types.sampling_params import SamplingParams
from frontend.grpc_client import GrpcEngineClient
from frontend.tokenizer import tokenizer_fingerprint

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from stand_in_backend import StandInServicer, start_server  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(directory)
    return directory


@pytest.mark.timeout(60)
def test_the_stand_in_answers_every_call_of_the_frontends_client(tokenizer_dir, tmp_path):
    async def scenario():
        servicer = StandInServicer(str(tokenizer_dir))
        server, port = await start_server(servicer)
        client = GrpcEngineClient(f"127.0.0.1:{port}")
        try:
            assert await client.health()
            assert await client.tokenizer_fingerprint() == tokenizer_fingerprint(str(tokenizer_dir))
            fetched = await client.fetch_tokenizer(tmp_path / "fetched")
            assert tokenizer_fingerprint(str(fetched)) == tokenizer_fingerprint(str(tokenizer_dir))
            info = await client.model_info()
            assert info.vocab_size > 0 and info.eos_token_ids
            assert (await client.get_load()).num_requests_running == 0

            params = SamplingParams(n=2, max_tokens=5, logprobs=2, prompt_logprobs=1)
            outputs = [o async for o in client.generate("r1", [1, 2, 3], params)]
            for index in range(2):
                mine = [o for o in outputs if o.index == index]
                assert [len(o.new_token_ids) for o in mine] == [1] * 5
                assert [o.finish_reason for o in mine][-1].value == "length"
                assert all(o.finish_reason is None for o in mine[:-1])
                assert all(len(o.new_logprobs) == 1 and len(o.new_logprobs[0]) == 3 for o in mine)
                assert mine[0].prompt_logprobs is not None and len(mine[0].prompt_logprobs) == 3
                assert mine[1].prompt_logprobs is None

            # Abort ends a running stream with ABORT; closing the stream cancels the call.
            stream = client.generate("r2", [1, 2], SamplingParams(max_tokens=10_000))
            first = await anext(stream)
            assert first.finish_reason is None and (await client.get_load()).num_requests_running == 1
            await client.abort("r2")
            rest = [o async for o in stream]
            assert rest[-1].finish_reason.value == "abort" and len(rest) < 10_000
            assert (await client.get_load()).num_requests_running == 0
            await client.abort("never-ran")  # unknown IDs are ignored, and not remembered
            assert servicer.aborted == set()
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(scenario())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("multiplexed", [True, False])
def test_the_stand_in_groups_tokens_as_the_backends_stream_interval(tokenizer_dir, multiplexed):
    async def scenario():
        servicer = StandInServicer(str(tokenizer_dir), stream_interval=3)
        server, port = await start_server(servicer)
        client = GrpcEngineClient(f"127.0.0.1:{port}", multiplexed=multiplexed)
        try:
            plain = StandInServicer(str(tokenizer_dir))
            params = SamplingParams(max_tokens=8, logprobs=1)
            outputs = [o async for o in client.generate("r", [1, 2, 3], params)]
            assert [len(o.new_token_ids) for o in outputs] == [1, 3, 3, 1]
            assert [len(o.new_logprobs) for o in outputs] == [1, 3, 3, 1]
            assert [t for o in outputs for t in o.new_token_ids] == plain.script[:8]
            assert [o.finish_reason for o in outputs][-1].value == "length"
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(scenario())


@pytest.mark.timeout(180)
def test_the_bench_reports_every_workload_with_real_figures(tokenizer_dir, tmp_path):
    # /proc counts CPU time in 10 ms ticks: each run needs well over that of frontend work (128
    # short chats here, ~0.5 ms each), or a row can read 0.
    out = tmp_path / "capacity.json"
    workloads = ["completions-stream-logprobs", "chat-stream", "chat", "chat-short"]
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "frontend_capacity.py"), "--tokenizer", str(tokenizer_dir),
         "--concurrency", "2,4", "--max-tokens", "8", "--tokens-per-run", "2048", "--workloads", ",".join(workloads),
         "--rpcs", "GenerateStream,Generate", "--parts", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(row["rpc"], row["workload"], row["concurrency"]): row for row in report["rows"]}
    assert set(rows) == {(rpc, w, c) for rpc in ("GenerateStream", "Generate") for w in workloads for c in (2, 4)}
    for (_, workload, concurrency), row in rows.items():
        per_request = 1 if workload == "chat-short" else 8
        assert row["requests"] >= concurrency
        assert row["tokens"] == row["requests"] * per_request, row  # from each response's usage
        assert row["frontend_us_per_token"] > 0 and row["tokens_per_s"] > 0, row
        streamed = "stream" in workload
        assert (row["itl_p50_ms"] is not None) == streamed, row
        if streamed:
            assert 0 <= row["itl_p50_ms"] <= row["itl_p99_ms"], row
    assert report["conditions"]["max_tokens"] == 8
    # --parts: the app alone for each streamed workload, and the gRPC client alone, at each concurrency.
    parts = {(part["part"], part["workload"], part["concurrency"]): part for part in report["parts"]}
    assert set(parts) == ({("app", w, c) for w in workloads if "stream" in w for c in (2, 4)}
                          | {("grpc", rpc, c) for rpc in ("Generate", "GenerateStream") for c in (2, 4)})
    assert all(part["us_per_token"] > 0 for part in parts.values())


def test_the_fleet_bench_proxies_as_compose_does():
    """bench/frontend_fleet.py's nginx takes compose's proxy settings, all but where to proxy."""
    sys.path.insert(0, str(REPO / "bench"))
    from frontend_fleet import compose_proxy_settings

    settings = compose_proxy_settings()
    assert "proxy_buffering off;" in settings and "proxy_http_version 1.1;" in settings
    assert not any(line.startswith(("proxy_pass", "set ")) for line in settings)


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed (apt-get install nginx)")
def test_the_fleet_bench_runs_every_layout(tokenizer_dir, tmp_path):
    out = tmp_path / "fleet.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "frontend_fleet.py"), "--tokenizer", str(tokenizer_dir),
         "--frontends", "2", "--concurrency", "4", "--max-tokens", "8", "--tokens-per-run", "1024",
         "--repeats", "1", "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["layout"] for row in rows] == ["direct", "lb-1", "lb-2"]
    for row in rows:
        assert row["tokens"] == row["requests"] * 8 and row["frontend_us_per_token"] > 0, row
        assert ("balancer_us_per_token" in row) == (row["layout"] != "direct"), row


@pytest.mark.timeout(120)
def test_the_floor_bench_streams_every_event_and_reports_real_figures(tmp_path):
    """bench/frontend_floor.py: the bare app streams max_tokens events per request (counted by the
    clients from each response's usage) and its CPU per token is read from /proc (enough tokens
    for a few of its clock ticks)."""
    out = tmp_path / "floor.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "frontend_floor.py"), "--concurrency", "2,4", "--max-tokens", "64",
         "--tokens-per-run", "8192", "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["concurrency"] for row in rows] == [2, 4]
    for row in rows:
        assert row["requests"] == 128 and row["tokens"] == 128 * 64, row
        assert row["us_per_token"] > 0 and row["tokens_per_s"] > 0, row
