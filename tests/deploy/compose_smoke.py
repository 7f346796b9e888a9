"""The compose stack's checks (run by compose_smoke.sh, which builds the images first).

    python tests/deploy/compose_smoke.py --compose "docker compose -f compose.cpu.yaml -f X -p P" --port N

Brings up 2 backends, 2 frontends and the load balancer, and asserts: every service healthy;
a completion and a streamed chat through the load balancer succeed; both frontends and both
backends served requests (their own /metrics, read inside each container); a long-prefix prompt
sent 10 times lands on one backend, with prefix-cache hits there, while distinct prompts spread;
stopping a frontend loses no later request; stopping a backend, requests succeed on the other
within 10 s; `down` leaves nothing.

Then, after `down -v`, the stack as the README starts it (no model named, engine defaults, 1 backend,
1 frontend): the backend serves the default model converted into its image (its log says nothing was
fetched or converted, with a fresh cache volume) and answers a chat through the load balancer; its
engine process is killed (`kill -9` inside the container), compose restarts the container (its
restart count goes up), and the chat through the load balancer succeeds again, with no operator
action. Every wait is bounded; `down` runs whatever happens. Only 127.0.0.1 (the published port)
and `docker exec` are used: no container address is dialled.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable

UP_TIMEOUT_S = 900  # compose waits for the backends' health before starting the frontends
HEALTHY_TIMEOUT_S = 300
BACKEND_FAILOVER_S = 10
SCALE = 2
RESTART_TIMEOUT_S = 300  # the killed backend: restarted, the model loaded again, healthy
PREBUILT_MODEL_DIR = "/opt/tandem/models/SmolLM2-135M-Instruct"  # the Dockerfile's conversion
# The backend's engine process, found and killed from inside its container: under Docker's init
# (compose's `init: true`) it is PID 1's child. PID 1 itself cannot be sent SIGKILL from inside.
KILL_ENGINE = """
import os, signal
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\\0")
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:  # gone meanwhile (a health check, this scan's own children)
        continue
    if ppid == 1 and b"backend" in argv and any(a.endswith(b"tandem") for a in argv):
        print(pid, b" ".join(argv).decode())
        os.kill(int(pid), signal.SIGKILL)
        break
else:
    raise SystemExit("no engine process (tandem backend, a child of PID 1) found")
"""


def log(message: str) -> None:
    print(f"[smoke {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Stack:
    def __init__(self, compose: str, project: str, port: int) -> None:
        self.compose = shlex.split(compose)
        self.project = project
        self.base_url = f"http://127.0.0.1:{port}"

    def run_compose(self, *args: str, timeout: float, env: dict[str, str] | None = None) -> None:
        subprocess.run([*self.compose, *args], check=True, timeout=timeout,
                       env=None if env is None else {**os.environ, **env})

    def inspect(self, container: str, template: str) -> str:
        return subprocess.run(["docker", "inspect", "-f", template, container], check=True, capture_output=True,
                              text=True, timeout=60).stdout.strip()

    def logs(self, container: str) -> str:
        result = subprocess.run(["docker", "logs", container], capture_output=True, text=True, timeout=60)
        return result.stdout + result.stderr

    def containers(self, service: str, running_only: bool = True) -> list[str]:
        """Container names of ``service``, in replica order."""
        command = ["docker", "ps", "--format", "{{.Names}}", "--filter", f"label=com.docker.compose.project={self.project}",
                   "--filter", f"label=com.docker.compose.service={service}"]
        if not running_only:
            command.insert(2, "-a")
        return sorted(subprocess.run(command, check=True, capture_output=True, text=True).stdout.split())

    def health(self, container: str) -> str:
        result = subprocess.run(["docker", "inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}{{else}}"
                                 "{{.State.Status}}{{end}}", container], capture_output=True, text=True)
        return result.stdout.strip() or "gone"

    def metrics(self, container: str, port: int) -> dict[tuple[str, tuple], float]:
        """A container's own Prometheus metrics, fetched inside it from 127.0.0.1."""
        code = (f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics', "
                "timeout=10).read().decode())")
        text = subprocess.run(["docker", "exec", container, "python", "-c", code], check=True, capture_output=True,
                              text=True, timeout=60).stdout
        samples = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, value = line.rsplit(" ", 1)
            name, _, labels = name_labels.partition("{")
            pairs = tuple(sorted(tuple(p.split("=", 1)) for p in labels.rstrip("}").split(",") if "=" in p))
            samples[(name, tuple((k, v.strip('"')) for k, v in pairs))] = float(value)
        return samples


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(value for (n, ls), value in samples.items()
               if n == name and all(dict(ls).get(k) == v for k, v in labels.items()))


def post(stack: Stack, path: str, body: dict, timeout: float = 60) -> str:
    request = urllib.request.Request(stack.base_url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode()


def complete(stack: Stack, prompt: str, max_tokens: int = 4) -> dict:
    answer = json.loads(post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0}))
    assert answer["usage"]["completion_tokens"] == max_tokens, answer
    return answer


def wait_until(what: str, timeout: float, check: Callable[[], bool], every: float = 2.0) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
    return time.monotonic() - start


def scenario(stack: Stack) -> None:
    log(f"up: {SCALE} backends, {SCALE} frontends, the load balancer")
    stack.run_compose("up", "-d", "--scale", f"frontend={SCALE}", "--scale", f"backend={SCALE}", timeout=UP_TIMEOUT_S)
    services = {"backend": SCALE, "frontend": SCALE, "lb": 1}

    def all_healthy() -> bool:
        states = {s: [stack.health(c) for c in stack.containers(s)] for s in services}
        return all(len(states[s]) == n and set(states[s]) == {"healthy"} for s, n in services.items())

    took = wait_until("every service to be healthy", HEALTHY_TIMEOUT_S, all_healthy)
    backends, frontends = stack.containers("backend"), stack.containers("frontend")
    log(f"healthy ({took:.0f} s after up): {', '.join(backends + frontends + stack.containers('lb'))}")

    level = os.environ.get("TANDEM_SMOKE_PREBUILT_LEVEL")
    if level:  # the image's prebuilt CPU kernels, loaded: nothing compiled at start (no compiler there)
        for container in backends:
            logs = subprocess.run(["docker", "logs", container], capture_output=True, text=True, timeout=60)
            assert f"CPU kernels: loaded the prebuilt {level} build" in logs.stdout + logs.stderr, container
        log(f"every backend loaded the image's prebuilt {level} CPU kernels")

    # A completion and a streamed chat through the load balancer.
    complete(stack, "The capital of France is")
    stream = post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}],
                                                  "max_tokens": 6, "stream": True})
    events = [line[6:] for line in stream.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3, stream
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    log(f"completion and streamed chat ({len(events) - 1} chunks) through the load balancer: ok")

    # Distinct prompts spread over both backends and both frontends.
    for i in range(24):
        complete(stack, f"Request {i}: once upon a time, number {i * 7919 % 1000}")
    per_backend = {b: total(stack.metrics(b, 8001), "tandem:request_success_total") for b in backends}
    per_frontend = {f: total(stack.metrics(f, 8000), "tandem:http_requests_total", route="/v1/completions")
                    for f in frontends}
    log(f"requests served, by backend: {per_backend}; by frontend: {per_frontend}")
    assert all(v > 0 for v in per_backend.values()), "a backend served no request"
    assert all(v > 0 for v in per_frontend.values()), "a frontend served no request"

    # The same long-prefix prompt, 10 times: one backend, and its prefix cache hits.
    before = {b: stack.metrics(b, 8001) for b in backends}
    long_prompt = "Tandem serves language models with a paged KV cache and continuous batching. " * 8
    for i in range(10):
        complete(stack, long_prompt + f"Question {i}?")
    after = {b: stack.metrics(b, 8001) for b in backends}
    served = {b: total(after[b], "tandem:request_success_total") - total(before[b], "tandem:request_success_total")
              for b in backends}
    hits = {b: total(after[b], "tandem:prefix_cache_hits_total") - total(before[b], "tandem:prefix_cache_hits_total")
            for b in backends}
    queries = {b: total(after[b], "tandem:prefix_cache_queries_total")
               - total(before[b], "tandem:prefix_cache_queries_total") for b in backends}
    log(f"long-prefix prompt x10: requests by backend {served}, prefix-cache hit tokens {hits} of {queries}")
    owner = max(served, key=served.get)
    assert served[owner] == 10 and sum(served.values()) == 10, "the long-prefix prompt went to several backends"

    # A conversation continued by previous_response_id, 8 turns through the load balancer: the
    # turns land on both frontends, and each finds the response before it (kept by the backends).
    before = {f: total(stack.metrics(f, 8000), "tandem:http_requests_total", route="/v1/responses") for f in frontends}
    previous = None
    for turn in range(8):
        body = {"input": f"Turn {turn}.", "max_output_tokens": 3, "temperature": 0}
        if previous is not None:
            body["previous_response_id"] = previous
        answer = json.loads(post(stack, "/v1/responses", body))
        assert answer["previous_response_id"] == previous and answer["status"] in ("completed", "incomplete"), answer
        previous = answer["id"]
    turns = {f: total(stack.metrics(f, 8000), "tandem:http_requests_total", route="/v1/responses") - before[f]
             for f in frontends}
    log(f"a Responses conversation of 8 turns by previous_response_id, turns by frontend: {turns}")
    assert all(v > 0 for v in turns.values()), "one frontend served every turn: nothing crossed frontends"
    assert hits[owner] >= 9 * 64, "its backend found no prefix in its cache"

    # Stop a frontend: no later request is lost.
    log(f"stopping frontend {frontends[0]}")
    subprocess.run(["docker", "stop", frontends[0]], check=True, capture_output=True, timeout=120)
    for i in range(10):
        complete(stack, f"After the frontend stopped, request {i}")
    log("10 requests after the frontend stopped: all ok")

    # Stop a backend while requests keep coming: they succeed on the other within 10 s.
    results: list[tuple[float, bool]] = []
    stopping = threading.Thread(target=subprocess.run, args=(["docker", "stop", backends[0]],),
                                kwargs={"capture_output": True, "timeout": 120})
    start = time.monotonic()
    log(f"stopping backend {backends[0]} under traffic")
    stopping.start()
    while time.monotonic() - start < BACKEND_FAILOVER_S + 10:
        sent = time.monotonic() - start
        try:
            complete(stack, f"During the backend stop, request {len(results)}", max_tokens=2)
            results.append((sent, True))
        except (urllib.error.URLError, AssertionError, OSError) as error:
            log(f"  request at +{sent:.1f} s failed: {error}")
            results.append((sent, False))
        time.sleep(0.2)
    stopping.join(120)
    failed = [t for t, ok in results if not ok]
    log(f"during and after the backend stop: {len(results)} requests, {len(failed)} failed "
        f"(at {', '.join(f'+{t:.1f} s' for t in failed) or '-'})")
    assert all(ok for t, ok in results if t >= BACKEND_FAILOVER_S), "requests failed 10 s after the backend stopped"
    remaining = stack.containers("backend")
    assert remaining == backends[1:], remaining
    assert total(stack.metrics(remaining[0], 8001), "tandem:request_success_total") > per_backend[remaining[0]]


def chat(stack: Stack, content: str) -> str:
    """A chat completion through the load balancer; its answer's text (asserted not empty)."""
    answer = json.loads(post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                             "max_tokens": 12, "temperature": 0}, timeout=120))
    text = answer["choices"][0]["message"]["content"]
    assert text.strip() and answer["usage"]["completion_tokens"] > 0, answer
    return text


def ready_lines(logs: str) -> list[str]:
    """The ``[start-up] ready: ...`` lines of a container's log (one per start), without the prefix."""
    return [line.split("[start-up] ", 1)[1] for line in logs.splitlines() if "[start-up] ready:" in line]


def default_model_scenario(stack: Stack) -> None:
    """The README's stack (default model, engine defaults), then its backend's engine killed."""
    log("up as the README types it: no model named, engine defaults, 1 backend, 1 frontend")
    defaults = {"TANDEM_MODEL": "", "TANDEM_BACKEND_ARGS": ""}
    stack.run_compose("up", "-d", timeout=UP_TIMEOUT_S, env=defaults)
    services = ("backend", "frontend", "lb")

    def all_healthy() -> bool:
        states = [stack.health(c) for s in services for c in stack.containers(s)]
        return len(states) == len(services) and set(states) == {"healthy"}

    took = wait_until("every service to be healthy", HEALTHY_TIMEOUT_S, all_healthy)
    [backend] = stack.containers("backend")
    log(f"healthy ({took:.0f} s after up)")

    # The model the image carries: found there (the cache volume is new and empty), not converted.
    logs = stack.logs(backend)
    assert f"[start-up] model: the default model in {PREBUILT_MODEL_DIR}" in logs, logs[-3000:]
    assert "nothing fetched or converted" in logs, logs[-3000:]
    for said in ("Fetching the default model", "Converting"):
        assert said not in logs, f"the backend said {said!r}: {logs[-3000:]}"
    model_line = next(line for line in logs.splitlines() if "[start-up] model:" in line)
    log(f"the backend used the image's default model, nothing fetched or converted: {model_line.strip()}; "
        f"{ready_lines(logs)}")
    log(f"chat through the load balancer: {chat(stack, 'What is the capital of France?')!r}")

    # kill -9 of the engine inside the container: the container exits, compose restarts it.
    restarts = int(stack.inspect(backend, "{{.RestartCount}}"))
    killed = subprocess.run(["docker", "exec", backend, "python", "-c", KILL_ENGINE], check=True,
                            capture_output=True, text=True, timeout=60).stdout.strip()
    log(f"killed the engine (kill -9) in {backend}: PID {killed}")
    killed_at = time.monotonic()

    def restarted_and_healthy() -> bool:
        return int(stack.inspect(backend, "{{.RestartCount}}")) > restarts and all_healthy()

    wait_until(f"{backend} to restart and every service to be healthy again", RESTART_TIMEOUT_S,
               restarted_and_healthy)
    log(f"{backend} restarted by compose (restart count {restarts} -> "
        f"{stack.inspect(backend, '{{.RestartCount}}')}), every service healthy {time.monotonic() - killed_at:.0f} s "
        f"after the kill; the backend's starts: {ready_lines(stack.logs(backend))}")
    log(f"chat through the load balancer after the restart: {chat(stack, 'Name a colour.')!r}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compose", required=True, help="the compose command, with its -f and -p options")
    parser.add_argument("--project", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    stack = Stack(args.compose, args.project, args.port)
    failure = None
    try:
        scenario(stack)
        log("down -v (the tiny model's stack)")
        stack.run_compose("down", "-v", "--remove-orphans", "-t", "40", timeout=300)
        default_model_scenario(stack)
    except Exception as error:  # noqa: BLE001 -- report, then still take the stack down
        failure = error
        log(f"FAILED: {error!r}")
        for service in ("backend", "frontend", "lb"):
            for container in stack.containers(service, running_only=False):
                logs = subprocess.run(["docker", "logs", "--tail", "30", container], capture_output=True, text=True)
                print(f"---- {container} ({stack.health(container)}) ----\n{logs.stdout}{logs.stderr}", flush=True)
    finally:
        log("down")
        stack.run_compose("down", "-v", "--remove-orphans", "-t", "40", timeout=300)
    left = [c for s in ("backend", "frontend", "lb") for c in stack.containers(s, running_only=False)]
    if left:
        log(f"FAILED: containers left after down: {left}")
        return 1
    log("down left no container")
    if failure is not None:
        return 1
    log("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
