"""The stateless OpenAI-compatible HTTP frontend of Tandem backends (no torch).

    python -m frontend.server --backend HOST:PORT[,HOST:PORT...|dns:///NAME:PORT]
        [--routing prefix|round-robin|least-loaded] [--host 127.0.0.1] [--port 8000]
        [--tokenizer DIR] [--api-key KEY] [--served-model-name NAME]

(``tandem frontend ...`` is the same.) This module is the server's start-up:
connect to the backends, check the tokenizer, serve the app with uvicorn until
SIGINT/SIGTERM. Requests reach the backends through
``frontend.router.Router`` (one backend or many). On startup the frontend loads
the tokenizer from ``--tokenizer`` or fetches the backend's (cached by
fingerprint), and refuses to start when its fingerprint differs from the
backend's: the two sides would disagree on what token IDs mean. The app itself
(routes, middleware, error mapping) is ``frontend.app``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import uvicorn

from backend.types.config import EngineConfig
from backend.types.errors import TandemError
from backend.types.limits import FRONTEND_LIMITS, Limits
from backend.types.command_line import CommandLineParser
from backend.types.ports import check_port_free, port_error, port_number
from backend.types.startup_heap import tune_gc_for_serving
from backend.types.wire import TOKEN_ENV  # read when --backend-auth-token is not given
from frontend.app import create_app
from frontend.backend_response_store import BackendResponseStore
from frontend.environment import API_KEY_ENV
from frontend.router import DEFAULT_PREFIX_TOKENS, POLICIES, Router, parse_targets
from frontend.tokenizer import load_tokenizer, tokenizer_fingerprint
from frontend.tool_calls import PARSERS as TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)


class StartupError(TandemError):
    """The frontend cannot start (backend unreachable, tokenizer mismatch, ...)."""


async def wait_for_backend(client, address: str, timeout: float) -> None:
    """Poll the backend's health until it serves; ``timeout`` <= 0 waits as long as it takes.

    Raises ``StartupError`` at once when every backend refuses this frontend's token or TLS
    settings (``Router.credentials_problem``): that will not pass by waiting, and the message
    names the flag that fixes it.
    """
    deadline = time.monotonic() + timeout
    announced = False
    credentials_problem = getattr(client, "credentials_problem", lambda: None)
    while not await client.health():
        problem = credentials_problem()
        if problem is not None:
            raise StartupError(f"Cannot use the backend at {address}. {problem}")
        if timeout > 0 and time.monotonic() > deadline:
            raise StartupError(f"The backend at {address} did not become healthy within {timeout:.0f} s.")
        if not announced:
            logger.info("Waiting for the backend at %s ...", address)
            announced = True
        await asyncio.sleep(0.5)


async def fetch_backend_tokenizer(client, fingerprint: str, cache_dir: Path) -> Path:
    """The backend's tokenizer files in ``cache_dir/tokenizers/<fingerprint>``, fetched unless there.

    Fetched into a staging directory and renamed into place, so a concurrent
    frontend never reads half-written files.
    """
    target = cache_dir / "tokenizers" / fingerprint
    if target.is_dir():
        try:
            if tokenizer_fingerprint(str(target)) == fingerprint:
                return target
        except TandemError:
            pass
        shutil.rmtree(target, ignore_errors=True)  # damaged: fetch again
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=target.parent))
    try:
        await client.fetch_tokenizer(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():  # not a lost race with another frontend
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


async def run(backend: str, host: str = "127.0.0.1", port: int = 8000, tokenizer: Optional[str] = None,
              api_key: Optional[str] = None, served_model_name: Optional[str] = None,
              backend_timeout: float = 600.0, shutdown_timeout: float = 30.0, log_level: str = "info",
              routing: str = "prefix", routing_prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
              limits: Optional[Limits] = None, security=None, tool_call_parser: str = "auto",
              enable_prompt_tokens_details: bool = False) -> None:
    """Connect to the backends of ``backend`` (``frontend.router.parse_targets``), check the
    tokenizer, serve HTTP until SIGINT/SIGTERM. Raises ``StartupError`` (or another
    ``TandemError``, e.g. ``PortInUseError`` before anything else) when it cannot start.
    ``security`` (a ``ChannelSecurity``) reaches every backend connection the router opens."""
    from frontend.grpc_client import GrpcEngineClient

    check_port_free(host, port, "--port")
    router = Router(parse_targets(backend), routing, routing_prefix_tokens,
                    client_factory=lambda address: GrpcEngineClient(address, limits, security))
    try:
        await router.start()
        await wait_for_backend(router, backend, backend_timeout)
        model_info = await router.model_info()
        backend_fingerprint = await router.tokenizer_fingerprint()
        if tokenizer:
            tokenizer_dir = Path(tokenizer)
        else:
            tokenizer_dir = await fetch_backend_tokenizer(router, backend_fingerprint, EngineConfig().cache_dir)
        local_fingerprint = tokenizer_fingerprint(str(tokenizer_dir))
        if local_fingerprint != backend_fingerprint:
            raise StartupError(
                f"The tokenizer in {tokenizer_dir} (fingerprint {local_fingerprint[:16]}) is not the backend's "
                f"(fingerprint {backend_fingerprint[:16]}): token IDs would mean different things on the two "
                "sides. Point --tokenizer at the backend's tokenizer files, or leave it out to fetch them "
                "from the backend.")
        if served_model_name:
            model_info.model_name = served_model_name
        app = create_app(router, load_tokenizer(str(tokenizer_dir)), model_info, api_key, [router.collector()],
                         limits, tool_call_parser, response_store=BackendResponseStore(router),
                         enable_prompt_tokens_details=enable_prompt_tokens_details)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=uvicorn_log_config(),
                                timeout_graceful_shutdown=shutdown_timeout, lifespan="off",
                                http=app.state.http_protocol)
        logger.info("Serving %s at http://%s:%d/v1 from the backends at %s (routing: %s).", model_info.model_name,
                    host, port, backend, routing)
        server = uvicorn.Server(config)
        tune_gc_for_serving()
        await server.serve()
        if not server.started:
            raise port_error(host, port, "--port")
    finally:
        await router.close()


def uvicorn_log_config() -> dict:
    """uvicorn's logging, with a timestamp on every line (like the rest of Tandem's logs)."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["fmt"] = "%(asctime)s " + formatter["fmt"]
    return config


def build_parser(prog: str = "python -m frontend.server") -> argparse.ArgumentParser:
    parser = CommandLineParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True,
                        help="the backends' gRPC addresses: HOST:PORT, comma-separated for several, or "
                             "dns:///NAME:PORT for every address NAME resolves to (re-resolved as replicas change)")
    parser.add_argument("--routing", default="prefix", choices=POLICIES,
                        help="how a request picks its backend: prefix = the backend most likely to hold its "
                             "prompt's first KV blocks, unless overloaded (default); round-robin; least-loaded")
    parser.add_argument("--routing-prefix-tokens", type=int, default=DEFAULT_PREFIX_TOKENS,
                        help="prompt tokens hashed for prefix routing (default: %(default)s, four 16-token blocks)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve HTTP on")
    parser.add_argument("--port", type=port_number, default=8000, help="HTTP port")
    parser.add_argument("--tokenizer", default=None,
                        help="local tokenizer directory (default: fetch the backend's and cache it)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1, /tokenize, /detokenize "
                             f"(default: ${API_KEY_ENV})")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: the backend's)")
    parser.add_argument("--backend-timeout", type=float, default=600.0,
                        help="seconds to wait at startup for the backend to be healthy (0: no limit)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds open requests get to finish after SIGTERM")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                        help="the least severe log lines shown")
    Limits.add_cli_args(parser, FRONTEND_LIMITS)
    security = parser.add_argument_group("the backend connection's security (see `tandem backend --help`)")
    security.add_argument("--backend-auth-token", default=os.environ.get(TOKEN_ENV),
                          help=f"the backend's --auth-token (default: ${TOKEN_ENV})")
    security.add_argument("--backend-ssl-ca-certs", default=None,
                          help="use TLS, trusting backend certificates this CA signed (PEM)")
    security.add_argument("--backend-ssl-certfile", default=None, help="client certificate for mutual TLS (PEM)")
    security.add_argument("--backend-ssl-keyfile", default=None, help="the client certificate's private key (PEM)")
    security.add_argument("--backend-ssl-server-name", default=None,
                          help="the name to check in the backend's certificate (default: the --backend host)")
    parser.add_argument("--tool-call-parser", default="auto", choices=("auto", *TOOL_CALL_PARSERS),
                        help="format of tool calls in the model's replies (default: auto, from the chat template)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="report the prompt tokens the prefix cache served in chat and completions usage "
                             "(prompt_tokens_details.cached_tokens; left out without this flag)")
    return parser


def _exit_cleanly(signum: int, frame) -> None:
    raise SystemExit(0)


def main(argv: Optional[list[str]] = None, prog: str = "python -m frontend.server") -> int:
    """Run the frontend; 0 after SIGINT/SIGTERM, 1 (with the reason on stderr) if it cannot start."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # A stop request is a normal end: while uvicorn serves it drains first, then re-raises
    # the signal, which lands here; before that (waiting for the backend) it ends at once.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    try:
        from frontend.grpc_client import ChannelSecurity

        security = ChannelSecurity(args.backend_auth_token, args.backend_ssl_ca_certs, args.backend_ssl_certfile,
                                   args.backend_ssl_keyfile, args.backend_ssl_server_name)
        asyncio.run(run(args.backend, args.host, args.port, args.tokenizer, args.api_key, args.served_model_name,
                        args.backend_timeout, args.shutdown_timeout, args.log_level, args.routing,
                        args.routing_prefix_tokens, Limits.from_cli_args(args), security, args.tool_call_parser,
                        args.enable_prompt_tokens_details))
    except TandemError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
