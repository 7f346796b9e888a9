"""Request chat templates (frontend/template_sandbox.py, frontend/template_worker.py, frontend/serving/prompts.py).

Refused unless the operator allows them (vLLM's --trust-request-chat-template); when allowed, they
render in worker processes whose time, memory and output bounds hold: a template over a bound gets
a 400 naming chat_template and the flag, its worker is killed and replaced, and the pool serves on.
The latency and memory acceptance test is tests/test_template_bomb_latency.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_VOCAB, build_tokenizer
from fastapi.testclient import TestClient
from helpers import wait_for
from fake_engine import FakeEngine

from backend.types.errors import InvalidRequestError, OverloadedError
from backend.types.limits import FRONTEND_LIMITS, Limits
from backend.types.outputs import ModelInfo
from frontend import server
from frontend.app import create_app
from frontend.entrypoints import cli
from frontend.serving.base import ServingContext
from frontend.template_sandbox import TemplateSandbox
from frontend.template_worker import ChatRenderJob, render_job
from frontend.tokenizer import load_tokenizer, prepare_chat

REPO_ROOT = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "user", "content": "ab"}]
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
STRING_MULTIPLICATION = "{{ messages[0]['content'] * 300000000 }}"  # 600 MB at render time
ECHO = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(directory)
    return load_tokenizer(str(directory))


def job(template: str, messages=MESSAGES) -> ChatRenderJob:
    return ChatRenderJob(template=template, conversation=list(messages), template_kwargs={"bos_token": "<s>"})


def pid_exists(pid: int) -> bool:
    """True while the process runs (a zombie, killed but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def template_workers() -> set[int]:
    """The pids of this process's chat template workers."""
    pids = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:  # the thread ended since the listing
            continue
        for child in children:
            try:
                if b"frontend.template_worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                    pids.add(int(child))
            except FileNotFoundError:
                pass
    return {pid for pid in pids if pid_exists(pid)}


def worker_pids(sandbox: TemplateSandbox) -> set[int]:
    return {worker.process.pid for worker in sandbox._workers}


def wait_for_workers(sandbox: TemplateSandbox, count: int, timeout: float = 60) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(pids := worker_pids(sandbox)) == count and sandbox._idle.qsize() == count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"{count} idle workers did not come up within {timeout} s")


@pytest.fixture
def sandbox():
    pool = TemplateSandbox(num_workers=1, timeout_s=2, max_output_bytes=4096, max_memory_bytes=256 * 2**20)
    pool.start()
    wait_for_workers(pool, 1)
    yield pool
    pool.close()


def render(pool: TemplateSandbox, template: str, messages=MESSAGES) -> str:
    return asyncio.run(asyncio.wait_for(pool.render(job(template, messages)), 120))


# ---- the sandbox -------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_worker_renders_what_this_process_renders(sandbox):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 😀"}]
    assert render(sandbox, ECHO, messages) == render_job(job(ECHO, messages)) == "<s>[system] be brief[user] héllo 😀"


@pytest.mark.timeout(120)
def test_a_template_that_spins_is_stopped_at_the_timeout_and_its_worker_replaced(sandbox):
    (before,) = worker_pids(sandbox)
    started = time.monotonic()
    with pytest.raises(InvalidRequestError) as error:
        render(sandbox, NESTED_LOOPS)
    elapsed = time.monotonic() - started
    assert error.value.param == "chat_template" and "--chat-template-timeout-s" in str(error.value)
    assert 2 <= elapsed < 2 + 10, elapsed
    assert not pid_exists(before)  # killed, not left spinning
    (after,) = wait_for_workers(sandbox, 1)
    assert after != before
    assert render(sandbox, "{{ messages[0]['content'] }}") == "ab"


@pytest.mark.timeout(120)
def test_a_template_that_takes_too_much_memory_ends_in_its_worker(sandbox):
    (before,) = worker_pids(sandbox)
    with pytest.raises(InvalidRequestError) as error:
        render(sandbox, STRING_MULTIPLICATION)
    assert error.value.param == "chat_template" and "--max-chat-template-memory-bytes" in str(error.value)
    assert not pid_exists(before)
    wait_for_workers(sandbox, 1)
    assert render(sandbox, "{{ messages[0]['content'] }}") == "ab"


@pytest.mark.timeout(120)
def test_an_output_over_the_limit_never_reaches_the_frontend(sandbox):
    with pytest.raises(InvalidRequestError) as error:
        render(sandbox, "{% for i in range(1000) %}{{ messages[0]['content'] }}xyz{% endfor %}")  # 5,000 bytes
    assert error.value.param == "chat_template" and "--max-chat-template-output-bytes" in str(error.value)
    assert "5000 bytes" in str(error.value)
    wait_for_workers(sandbox, 1)
    assert len(render(sandbox, "{% for i in range(800) %}{{ messages[0]['content'] }}xyz{% endfor %}")) == 4000


@pytest.mark.timeout(180)
def test_a_worker_that_kept_memory_after_a_render_is_replaced():
    """Jinja folds the constant below into the compiled template (80 MB), which transformers caches:
    the render succeeds, and the worker that now holds it retires."""
    pool = TemplateSandbox(num_workers=1, timeout_s=60, max_output_bytes=4096, max_memory_bytes=512 * 2**20)
    try:
        pool.start()
        (before,) = wait_for_workers(pool, 1)
        assert render(pool, "{% set s = 'ab' * 40000000 %}{{ s | length }}") == "80000000"
        (after,) = wait_for_workers(pool, 1)
        assert after != before and not pid_exists(before)
        assert render(pool, "{{ messages[0]['content'] }}") == "ab"
        assert worker_pids(pool) == {after}  # a small render keeps its worker
    finally:
        pool.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("template, words", [
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% for %}", "Expected an expression"),
    ("{{ raise_exception('no system messages') }}", "no system messages"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),  # Jinja's sandbox still applies
    ("{{ '\\ud800' }}", "not valid Unicode"),
])
def test_a_template_error_is_a_400_and_the_worker_serves_on(sandbox, template, words):
    (before,) = worker_pids(sandbox)
    with pytest.raises(InvalidRequestError) as error:
        render(sandbox, template)
    assert error.value.param == "chat_template" and words in str(error.value), str(error.value)
    assert worker_pids(sandbox) == {before}
    assert render(sandbox, "{{ messages[0]['content'] }}") == "ab"


@pytest.mark.timeout(120)
def test_no_free_worker_in_time_is_a_429(sandbox):
    sandbox.max_wait_s = 0.5

    async def both():
        return await asyncio.gather(sandbox.render(job(NESTED_LOOPS)), sandbox.render(job("x")),
                                    return_exceptions=True)

    spin, waited = asyncio.run(asyncio.wait_for(both(), 60))
    assert isinstance(spin, InvalidRequestError)
    assert isinstance(waited, OverloadedError) and "--chat-template-workers" in str(waited)


@pytest.mark.timeout(120)
def test_renders_beyond_four_per_worker_are_refused_at_once(sandbox):
    async def flood():
        spin = asyncio.ensure_future(sandbox.render(job(NESTED_LOOPS)))
        await asyncio.sleep(0.3)
        waiting = [asyncio.ensure_future(sandbox.render(job("{{ messages[0]['content'] }}"))) for _ in range(3)]
        await asyncio.sleep(0.3)
        started = time.monotonic()
        with pytest.raises(OverloadedError, match="--chat-template-workers"):
            await sandbox.render(job("{{ 2 }}"))
        refused_in = time.monotonic() - started
        return refused_in, await asyncio.gather(spin, *waiting, return_exceptions=True)

    refused_in, (spin, *waited) = asyncio.run(asyncio.wait_for(flood(), 100))
    assert refused_in < 1.0
    assert isinstance(spin, InvalidRequestError) and waited == ["ab"] * 3


@pytest.mark.timeout(120)
def test_close_leaves_no_worker_behind():
    pool = TemplateSandbox(num_workers=2, timeout_s=2, max_output_bytes=4096, max_memory_bytes=256 * 2**20)
    pool.start()
    pids = wait_for_workers(pool, 2)
    pool.close()
    assert not any(pid_exists(pid) for pid in pids)


ORPHAN = """
import asyncio, os, sys, time
from frontend.serving.base import OpenAIServing
from frontend.template_sandbox import TemplateSandbox
from frontend.template_worker import ChatRenderJob
pool = TemplateSandbox(num_workers=1, timeout_s=3, max_output_bytes=4096, max_memory_bytes=256 * 2**20)
pool.start()
while not pool._idle.qsize():
    time.sleep(0.05)
(worker,) = pool._workers
print(worker.process.pid, flush=True)
job = ChatRenderJob({spin!r}, [{{"role": "user", "content": "ab"}}])
pool._render_threads.submit(pool._render_blocking, job)
time.sleep(1)
os._exit(0)  # gone without killing its worker, mid-render
"""


@pytest.mark.timeout(180)
def test_a_worker_whose_frontend_died_mid_render_stops_at_its_cpu_cap():
    result = subprocess.run([sys.executable, "-c", ORPHAN.format(spin=NESTED_LOOPS)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 150  # about 5 CPU seconds at a low priority, on a busy machine
    while time.monotonic() < deadline and pid_exists(pid):
        time.sleep(0.5)
    assert not pid_exists(pid)


# ---- over HTTP ---------------------------------------------------------------------------------------


def serving_of(app) -> ServingContext:
    """The app's serving context, which its endpoints share (``create_app`` keeps it in ``app.state``)."""
    return app.state.serving


def client_for(tokenizer, limits: Limits) -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine(tokenizer)
    app = create_app(engine, tokenizer, ModelInfo("m", 128, TINY_VOCAB, [engine.eos]), limits=limits)
    return TestClient(app, raise_server_exceptions=False), engine


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "chat_template": ECHO}),
    ("/tokenize", {"messages": MESSAGES, "chat_template": ECHO}),
    ("/tokenize", {"prompt": "ab", "chat_template": ECHO}),
])
def test_request_templates_are_refused_by_default(tokenizer, route, body):
    client, engine = client_for(tokenizer, Limits())
    with client:
        response = client.post(route, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
        assert not engine.requests
        without = {key: value for key, value in body.items() if key != "chat_template"}
        assert client.post(route, json=without).status_code == 200  # the model's own template


@pytest.mark.timeout(120)
def test_an_allowed_request_template_is_the_one_rendered(tokenizer):
    before = template_workers()
    client, engine = client_for(tokenizer, Limits(trust_request_chat_template=True, chat_template_timeout_s=5))
    with client:
        rendered = render_job(prepare_chat(tokenizer, MESSAGES, True, ECHO))
        assert rendered == "<|im_start|>[user] ab"
        expected = tokenizer.encode(rendered, add_special_tokens=False)
        response = client.post("/tokenize", json={"messages": MESSAGES, "chat_template": ECHO})
        assert response.status_code == 200, response.text
        assert response.json()["tokens"] == expected
        response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                              "chat_template": ECHO})
        assert response.status_code == 200, response.text
        assert engine.requests[-1][1] == expected
        bomb = client.post("/tokenize", json={"messages": MESSAGES, "chat_template": NESTED_LOOPS})
        assert bomb.status_code == 400 and bomb.json()["error"]["param"] == "chat_template"
        assert client.get("/health").status_code == 200
        assert len(template_workers() - before) >= 1
    serving_of(client.app).close()
    assert wait_for(lambda: not template_workers() - before, 60)  # a replacement still starting ends too


def test_the_switch_and_bounds_are_flags_of_frontend_and_serve():
    args = server.build_parser().parse_args(
        ["--backend", "127.0.0.1:1", "--trust-request-chat-template", "--chat-template-timeout-s", "7",
         "--chat-template-workers", "3", "--max-chat-template-output-bytes", "1000",
         "--max-chat-template-memory-bytes", "100000000"])
    limits = Limits.from_cli_args(args)
    assert (limits.trust_request_chat_template, limits.chat_template_timeout_s, limits.chat_template_workers,
            limits.max_chat_template_output_bytes, limits.max_chat_template_memory_bytes) == (
        True, 7, 3, 1000, 100_000_000)
    assert Limits.from_cli_args(server.build_parser().parse_args(["--backend", "x"])) \
        .trust_request_chat_template is False
    serve_args = cli.build_parser().parse_args(["serve", "--trust-request-chat-template"])
    assert "--trust-request-chat-template" in cli.changed_flags(serve_args, Limits(), FRONTEND_LIMITS)
    with pytest.raises(InvalidRequestError):
        Limits(chat_template_timeout_s=0)
