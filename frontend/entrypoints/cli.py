"""The ``tandem`` command: serve, backend, frontend, generate.

    tandem serve [MODEL] [--host H] [--port 8000] [--grpc-port 50051] [--metrics-port 8001]
                 [--api-key KEY] [engine flags]
    tandem backend [MODEL] ...        the gRPC backend alone (python -m backend.server)
    tandem frontend --backend H:P ... the HTTP frontend alone (python -m frontend.server)
    tandem generate [MODEL] --prompt TEXT [--max-tokens N] [--temperature T] [engine flags]
    tandem healthcheck grpc HOST:PORT | http URL   exit 0 when healthy (container health checks)

``serve`` always runs the backend and the frontend as two processes joined by
gRPC on loopback, so the split is exercised even on one machine; the two share
a token (``--auth-token``, else a random one), so no other local user reaches
the backend's port. Engine flags are ``EngineConfig``'s, the same names as
``LLM(...)``'s keyword arguments.

This module does not import torch; only ``generate`` (and ``backend``) pull it in, inside the
functions that run them, so ``tandem frontend`` and ``tandem serve`` work on a frontend-only install.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Optional

from backend.types.command_line import CommandLineParser
from backend.types.config import EngineConfig
from backend.types.errors import TandemError
from backend.types.limits import BACKEND_LIMITS, FRONTEND_LIMITS, Limits
from backend.types.ports import check_port_free, port_number
from backend.types.sampling_params import SamplingParams
from backend.types.startup_log import seconds_since_process_start
from backend.types.wire import TOKEN_ENV
from frontend.environment import API_KEY_ENV, INSTANCE_ENV, INSTANCE_HEADER
from frontend.tool_calls import PARSERS as TOOL_CALL_PARSERS

POLL_INTERVAL_S = 0.2
HEALTHCHECK_TIMEOUT_S = 5.0
KILL_GRACE_S = 10.0  # after --shutdown-timeout, before SIGKILL


# ---- tandem serve ------------------------------------------------------------------------------


def changed_flags(args: argparse.Namespace, defaults: object, names) -> list[str]:
    """The flags among ``names`` whose value in ``args`` differs from ``defaults``', as arguments."""
    argv = []
    for name in names:
        value = getattr(args, name)
        if value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):  # the JSON-valued flags (speculative_config)
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The model and the engine flags in ``args`` that differ from the defaults."""
    names = [name for name in EngineConfig.field_names() if name != "model"]
    return ([args.model] if args.model else []) + changed_flags(args, EngineConfig(), names)


def frontend_options(args: argparse.Namespace) -> list[str]:
    """The frontend's own flags in ``args`` (``tandem serve``'s), as its command line."""
    return ["--tool-call-parser", args.tool_call_parser,
            *(["--enable-prompt-tokens-details"] if args.enable_prompt_tokens_details else []),
            *changed_flags(args, Limits(), FRONTEND_LIMITS)]


def _set_parent_death_signal() -> None:
    """In the child, before exec: get SIGTERM if the parent dies (Linux), so none is orphaned."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Child:
    """One child process of ``tandem serve``."""

    def __init__(self, name: str, argv: list[str], env: Optional[dict] = None) -> None:
        self.name = name
        # A session of its own: a terminal's Ctrl-C reaches only the parent, which stops
        # the children in order (frontend first, so no request meets a stopped backend).
        self.process = subprocess.Popen(argv, env=env, start_new_session=True,
                                        preexec_fn=_set_parent_death_signal if sys.platform == "linux" else None)

    def exit_code(self) -> Optional[int]:
        return self.process.poll()

    def stop(self, timeout: float) -> None:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"tandem: the {self.name} did not stop within {timeout:.0f} s; killing it.", file=sys.stderr)
            self.process.kill()
            self.process.wait()


def _local_address(host: str) -> str:
    """Where this machine reaches a server bound to ``host``."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(host, host)


def _http_get(url: str, api_key: Optional[str], header: Optional[str] = None) -> Optional[bytes | str]:
    """The body of a 200 answer (or its ``header``'s value), None for anything else (not up yet, 503, ...)."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            if response.status != 200:
                return None
            return response.headers.get(header) if header else response.read()
    except (urllib.error.URLError, OSError):
        return None


def serve(args: argparse.Namespace) -> int:
    """Start the backend and the frontend, report when both serve, stop both on SIGINT/SIGTERM."""
    try:
        EngineConfig.from_cli_args(args)  # bad flags fail here, before any process starts
        Limits.from_cli_args(args)
    except TandemError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:  # every address serve opens, before the model loads
        check_port_free(args.host, args.port, "--port")
        check_port_free("127.0.0.1", args.grpc_port, "--grpc-port")
        check_port_free("127.0.0.1", args.metrics_port, "--metrics-port")
    except TandemError as error:  # a port in use, or a --host that is not this machine's
        print(f"error: {error}", file=sys.stderr)
        return 1
    stop_requested: list[int] = []  # the signals received
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop_requested.append(signum))

    backend_argv = [sys.executable, "-m", "backend.server", *engine_argv(args), "--host", "127.0.0.1",
                    "--port", str(args.grpc_port), "--metrics-port", str(args.metrics_port),
                    "--shutdown-timeout", str(args.shutdown_timeout),
                    *changed_flags(args, Limits(), BACKEND_LIMITS)]
    frontend_argv = [sys.executable, "-m", "frontend.server", "--backend", f"127.0.0.1:{args.grpc_port}",
                     "--host", args.host, "--port", str(args.port), "--shutdown-timeout", str(args.shutdown_timeout),
                     "--backend-timeout", "0",  # we watch the backend process ourselves
                     *frontend_options(args)]
    # The frontend echoes this on /health: "serving" is announced only when our own frontend
    # answers, never another server that happens to hold the port.
    instance_id = secrets.token_hex(8)
    frontend_env = {**os.environ, INSTANCE_ENV: instance_id}
    if args.api_key:
        frontend_env[API_KEY_ENV] = args.api_key  # not on the command line, where `ps` shows it
    # One trust domain: the backend's port takes only calls carrying this token, so another local
    # user cannot reach the engine past the API key and the limits. Both ends read it from the
    # environment (not the command line, where `ps` shows it).
    backend_env = dict(os.environ)
    backend_env[TOKEN_ENV] = frontend_env[TOKEN_ENV] = args.auth_token or secrets.token_urlsafe(32)
    # Both start at once: the frontend loads its libraries while the backend loads the model.
    backend = _Child("backend", backend_argv, backend_env)
    frontend = _Child("frontend", frontend_argv, frontend_env)
    children = (frontend, backend)  # the order they stop in
    base_url = f"http://{_local_address(args.host)}:{args.port}"
    ready = False
    failed: Optional[_Child] = None
    try:
        while not stop_requested:
            failed = next((child for child in children if child.exit_code() is not None), None)
            if failed is not None:
                break
            if not ready and _http_get(base_url + "/health", None, INSTANCE_HEADER) == instance_id:
                models = _http_get(base_url + "/v1/models", args.api_key)
                name = json.loads(models)["data"][0]["id"] if models else args.model
                print(f"Tandem is serving {name} at http://{args.host}:{args.port}/v1 "
                      f"(ready {seconds_since_process_start():.1f} s after start)", flush=True)
                ready = True
            time.sleep(POLL_INTERVAL_S)
    finally:
        for child in children:
            child.stop(args.shutdown_timeout + KILL_GRACE_S)
    if failed is not None:
        print(f"error: the {failed.name} exited with code {failed.exit_code()}; stopped the rest.",
              file=sys.stderr)
        return 1
    return 0


# ---- tandem healthcheck -------------------------------------------------------------------------


def healthcheck(args: argparse.Namespace) -> int:
    """0 when the server answers healthy (a container health check: no probe binary needed)."""
    if args.kind == "http":
        healthy = _http_get(args.target, None) is not None
    else:
        import asyncio

        from frontend.grpc_client import GrpcEngineClient

        async def check() -> bool:
            client = GrpcEngineClient(args.target)
            try:
                return await asyncio.wait_for(client.health(), HEALTHCHECK_TIMEOUT_S)
            except asyncio.TimeoutError:
                return False
            except TandemError as error:  # e.g. a TLS backend (health itself needs no token)
                print(f"error: {error}", file=sys.stderr)
                return False
            finally:
                await client.close()

        healthy = asyncio.run(check())
    if not healthy:
        print(f"unhealthy: {args.target}", file=sys.stderr)
    return 0 if healthy else 1


# ---- tandem generate ---------------------------------------------------------------------------


def generate(args: argparse.Namespace) -> int:
    from frontend.entrypoints.llm import LLM  # torch comes in here

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        config = EngineConfig.from_cli_args(args)
        llm = LLM(**{name: getattr(config, name) for name in EngineConfig.field_names()})
    except TandemError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    try:
        (output,) = llm.generate(args.prompt, params, use_tqdm=False)
    except TandemError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        llm.shutdown()
    print(output.outputs[0].text)
    return 0


# ---- the command line --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(prog="tandem", description="Tandem: an LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve_parser = commands.add_parser("serve", help="serve MODEL over an OpenAI-compatible HTTP API "
                                                     "(a backend and a frontend process)")
    EngineConfig.add_cli_args(serve_parser)
    serve_parser.add_argument("--host", default="127.0.0.1", help="address of the HTTP API")
    serve_parser.add_argument("--port", type=port_number, default=8000, help="port of the HTTP API")
    serve_parser.add_argument("--grpc-port", type=port_number, default=50051,
                              help="loopback port between the frontend and the backend")
    serve_parser.add_argument("--metrics-port", type=port_number, default=8001,
                              help="the backend's Prometheus port (engine metrics; HTTP metrics are at /metrics)")
    serve_parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                              help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    serve_parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                              help="seconds running requests get to finish on SIGINT/SIGTERM")
    serve_parser.add_argument("--auth-token", default=os.environ.get(TOKEN_ENV),
                              help="the token the backend requires on its loopback gRPC port, so other local "
                                   "users cannot use it (default: $TANDEM_GRPC_TOKEN, else a random one made "
                                   "for this run)")
    Limits.add_cli_args(serve_parser, tuple(dict.fromkeys(FRONTEND_LIMITS + BACKEND_LIMITS)))
    serve_parser.add_argument("--tool-call-parser", default="auto", choices=("auto", *TOOL_CALL_PARSERS),
                              help="format of tool calls in the model's replies (default: auto, from the "
                                   "chat template)")
    serve_parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                              help="report the prompt tokens the prefix cache served in chat and completions "
                                   "usage (prompt_tokens_details.cached_tokens; left out without this flag)")
    serve_parser.set_defaults(handler=serve)

    commands.add_parser("backend", add_help=False, help="the gRPC backend alone (see `tandem backend --help`)")
    commands.add_parser("frontend", add_help=False, help="the HTTP frontend alone (see `tandem frontend --help`)")

    check_parser = commands.add_parser("healthcheck", help="exit 0 if a backend (grpc.health.v1) or a "
                                                           "frontend (/health) answers healthy")
    check_parser.add_argument("kind", choices=("grpc", "http"))
    check_parser.add_argument("target", help="grpc: HOST:PORT; http: the /health URL")
    check_parser.set_defaults(handler=healthcheck)

    generate_parser = commands.add_parser("generate", help="generate text offline for one prompt")
    EngineConfig.add_cli_args(generate_parser)
    generate_parser.add_argument("--prompt", required=True, help="the text to continue")
    sampling_defaults = SamplingParams()
    generate_parser.add_argument("--max-tokens", type=int, default=sampling_defaults.max_tokens,
                                 help="tokens to generate at most")
    generate_parser.add_argument("--temperature", type=float, default=sampling_defaults.temperature,
                                 help="sampling temperature (0: greedy)")
    generate_parser.set_defaults(handler=generate)
    return parser


BACKEND_COMMANDS = ("serve", "backend", "generate")  # the ones that run an engine


def backend_installed() -> bool:
    """True when the engine's dependencies (``tandem[backend]``: torch, ...) are installed."""
    return importlib.util.find_spec("torch") is not None


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in BACKEND_COMMANDS and not backend_installed():
        print(f"error: `tandem {argv[0]}` runs an engine, which needs torch: this is a frontend-only "
              "install. Install the backend with `pip install 'tandem[backend]'` (torch first, see "
              "the README), or run `tandem frontend --backend HOST:PORT` against a backend elsewhere.",
              file=sys.stderr)
        return 2
    # backend and frontend keep their own parsers: hand them the rest untouched.
    if argv[:1] == ["backend"]:
        from backend.server.main import main as backend_main

        return backend_main(argv[1:], prog="tandem backend")
    if argv[:1] == ["frontend"]:
        from frontend.server import main as frontend_main

        return frontend_main(argv[1:], prog="tandem frontend")
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
