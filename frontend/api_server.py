"""The stateless OpenAI-compatible HTTP frontend of Tandem backends (no torch).

    python -m frontend.api_server --backend HOST:PORT[,HOST:PORT...|dns:///NAME:PORT]
        [--routing prefix|round-robin|least-loaded] [--host 127.0.0.1] [--port 8000]
        [--tokenizer DIR] [--api-key KEY] [--served-model-name NAME]

Routes: /v1/completions, /v1/chat/completions, /v1/models, /tokenize,
/detokenize, ... (behind ``--api-key`` when set), and /health, /load, /metrics,
/version, /docs, /openapi.json (always open: ``OPEN_ROUTES``). The request
logic is in ``frontend.serving``; this module assembles the app: routes, the
one mapping of errors to OpenAI error JSON, and the edge's middleware
(``frontend.middleware``: metrics, request IDs, the API key before any body is
read, the body's size and time bounds, then admission) with the bound on the
wait for a request's head (``frontend.http_protocol``). Every bound is a
setting of ``backend.types.limits``.

Requests reach the backends through ``frontend.router.Router`` (one backend or
many). On startup the frontend loads the tokenizer from ``--tokenizer`` or fetches
the backend's (cached by fingerprint), and refuses to start when its
fingerprint differs from the backend's: the two sides would disagree on what
token IDs mean.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.metadata
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from transformers import PreTrainedTokenizerFast

from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError, TandemError
from backend.types.limits import FRONTEND_LIMITS, Limits
from backend.types.outputs import ModelInfo
from backend.types.ports import check_port_free, port_error
from backend.types.wire import TOKEN_ENV  # read when --backend-auth-token is not given
from frontend import protocol as P
from frontend.cli import INSTANCE_ENV, INSTANCE_HEADER
from frontend.engine_client import EngineClient
from frontend.http_protocol import head_deadline_protocol
from frontend.middleware import (AdmissionMiddleware, AuthenticationMiddleware, BodyReaderMiddleware, HttpMetrics,
                                 MetricsMiddleware, RequestIdMiddleware)
from frontend.router import DEFAULT_PREFIX_TOKENS, POLICIES, Router, parse_targets
from frontend.serving import (HTTP_STATUS_CLIENT_CLOSED_REQUEST, ClientDisconnectedError, OpenAIServing, error_body,
                              error_json_response, error_of_exception)
from frontend.tokenizer import load_tokenizer, tokenizer_fingerprint
from frontend.tool_calls import PARSERS as TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

API_KEY_ENV = "TANDEM_API_KEY"  # read when --api-key is not given (keeps the key out of `ps`)


def tandem_version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---- error handlers (every error leaves as OpenAI error JSON) -----------------------------------


def _validation_message(errors: list[dict]) -> tuple[str, Optional[str]]:
    """Pydantic errors as one message (``field: problem; ...``) and the first field's name."""
    parts, param = [], None
    for error in errors:
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        if param is None and location:
            param = location[0]
        parts.append(f"{'.'.join(location) or 'body'}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "Invalid request.", param


def _install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    async def on_validation_error(request: Request, error: Exception) -> JSONResponse:
        message, param = _validation_message(error.errors())
        return error_json_response(400, error_body(400, message, param))

    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_json_response(error.status_code, error_body(error.status_code, str(error.detail)))

    async def on_client_gone(request: Request, error: ClientDisconnectedError) -> Response:
        return Response(status_code=HTTP_STATUS_CLIENT_CLOSED_REQUEST)

    async def on_error(request: Request, error: Exception) -> JSONResponse:
        status, body = error_of_exception(error)
        return error_json_response(status, body, retry_after_s)

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnectedError, on_client_gone)
    app.add_exception_handler(TandemError, on_error)
    app.add_exception_handler(Exception, on_error)  # anything unexpected: a 500, still OpenAI-shaped


# ---- the app -----------------------------------------------------------------------------------


# The routes that queue work on the engine: admission control counts these.
GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations"})
# The routes open without the API key (probes, metrics, the schema); none takes a body. Every
# other path, unknown ones included, needs the key when one is set.
OPEN_ROUTES = frozenset({"/health", "/load", "/metrics", "/version", "/docs", "/docs/oauth2-redirect",
                         "/openapi.json"})


def create_app(engine_client: EngineClient, tokenizer: PreTrainedTokenizerFast, model_info: ModelInfo,
               api_key: Optional[str] = None, collectors: Sequence[Collector] = (),
               limits: Optional[Limits] = None, tool_call_parser: str = "auto") -> FastAPI:
    """The HTTP app over an engine client. ``model_info.model_name`` is the served name.

    ``/health`` asks ``engine_client.health()`` (``GrpcEngineClient`` and ``Router`` have it) and
    carries this process's ``$TANDEM_INSTANCE_ID`` (when set) in ``X-Tandem-Instance``, so
    ``tandem serve`` knows the answer came from its own frontend. ``collectors`` (e.g. the
    router's) are served on ``/metrics`` with the HTTP metrics.
    """
    limits = limits or Limits()
    serving = OpenAIServing(engine_client, tokenizer, model_info, limits, tool_call_parser)
    metrics = HttpMetrics()
    for collector in collectors:
        metrics.registry.register(collector)
    instance_headers = {INSTANCE_HEADER: os.environ[INSTANCE_ENV]} if os.environ.get(INSTANCE_ENV) else {}
    # /openapi.json and /docs describe exactly the request models the routes parse.
    app = FastAPI(title="Tandem", version=tandem_version(), docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")

    @app.post("/v1/completions")
    async def completions(request: P.CompletionRequest, raw_request: Request) -> Response:
        return await serving.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: P.ChatCompletionRequest, raw_request: Request) -> Response:
        return await serving.create_chat_completion(request, raw_request)

    @app.post("/invocations", response_model=None)
    async def invocations(raw_request: Request) -> Response:
        """SageMaker's route: a chat body (``messages``) or a completions body (``prompt``)."""
        try:
            body = await raw_request.json()
        except ValueError:
            raise InvalidRequestError("The body must be a JSON object.", param="body") from None
        if isinstance(body, dict) and "messages" in body:
            return await serving.create_chat_completion(P.ChatCompletionRequest.model_validate(body), raw_request)
        if isinstance(body, dict) and "prompt" in body:
            return await serving.create_completion(P.CompletionRequest.model_validate(body), raw_request)
        raise InvalidRequestError("/invocations takes a chat completion body (with messages) or a completion "
                                  "body (with prompt).", param="messages")

    @app.get("/v1/models")
    async def models() -> P.ModelList:
        return serving.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> P.ModelCard:
        return serving.model_card(model_id)

    # Serialized by pydantic in one call: FastAPI's own encoding of a long token list takes
    # seconds on the event loop.
    @app.post("/tokenize", response_model=P.TokenizeResponse)
    async def tokenize(request: P.TokenizeRequest) -> Response:
        return Response((await serving.tokenize(request)).model_dump_json(), media_type="application/json")

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> P.TokenizerInfoResponse:
        return serving.tokenizer_info()

    @app.get("/load")
    async def load() -> P.LoadResponse:
        return P.LoadResponse(server_load=serving.num_in_flight)

    @app.post("/detokenize")
    async def detokenize(request: P.DetokenizeRequest) -> P.DetokenizeResponse:
        return await serving.detokenize(request)

    @app.get("/health")
    async def health() -> Response:
        try:
            healthy = await engine_client.health()
        except Exception:  # noqa: BLE001 -- any failure to answer means unhealthy
            healthy = False
        if healthy:
            return Response(status_code=200, headers=instance_headers)
        return error_json_response(503, error_body(503, "The backend is unavailable or not serving."))

    @app.get("/metrics")
    async def metrics_route() -> Response:
        """The frontend's HTTP and router metrics, then the engines' (``Router.metrics_text``:
        each backend's GetMetrics, labelled by backend). A client without it serves only ours."""
        text = generate_latest(metrics.registry)
        fetch = getattr(engine_client, "metrics_text", None)
        if fetch is not None:
            try:
                text += (await fetch()).encode()
            except TandemError as error:  # the backend is down: /health says so; keep serving ours
                logger.warning("Could not fetch the backend's metrics: %s", error)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> P.VersionResponse:
        return P.VersionResponse(version=tandem_version())

    _install_error_handlers(app, limits.retry_after_s)
    # Added innermost first: a request meets them in the opposite order (frontend.middleware).
    app.add_middleware(AdmissionMiddleware, paths=GENERATION_ROUTES, limit=limits.max_concurrent_requests,
                       retry_after_s=limits.retry_after_s, metrics=metrics)
    app.add_middleware(BodyReaderMiddleware, max_bytes=limits.max_request_body_bytes,
                       timeout_s=limits.http_body_timeout_s, max_concurrent=limits.max_concurrent_body_reads,
                       retry_after_s=limits.retry_after_s, skip_paths=OPEN_ROUTES, metrics=metrics)
    app.add_middleware(AuthenticationMiddleware, api_key=api_key, open_paths=OPEN_ROUTES,
                       max_unauthenticated=limits.max_unauthenticated_requests, retry_after_s=limits.retry_after_s,
                       metrics=metrics)
    app.add_middleware(RequestIdMiddleware)
    # Added last, so outermost: it sees every response, 401s and 404s included.
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=frozenset(route.path for route in app.routes))
    # The bound on the wait for a request's head lives below ASGI: serve the app with
    # ``uvicorn.Config(app, http=app.state.http_protocol)``.
    app.state.http_protocol = head_deadline_protocol(
        limits.http_header_timeout_s, limits.max_pending_connections,
        on_close=lambda limit: metrics.rejected.labels(limit).inc())
    return app


# ---- startup -----------------------------------------------------------------------------------


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
              limits: Optional[Limits] = None, security=None, tool_call_parser: str = "auto") -> None:
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
                         limits, tool_call_parser)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=uvicorn_log_config(),
                                timeout_graceful_shutdown=shutdown_timeout, lifespan="off",
                                http=app.state.http_protocol)
        logger.info("Serving %s at http://%s:%d/v1 from the backends at %s (routing: %s).", model_info.model_name,
                    host, port, backend, routing)
        server = uvicorn.Server(config)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m frontend.api_server", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True,
                        help="the backends' gRPC addresses: HOST:PORT, comma-separated for several, or "
                             "dns:///NAME:PORT for every address NAME resolves to (re-resolved as replicas change)")
    parser.add_argument("--routing", default="prefix", choices=POLICIES,
                        help="how a request picks its backend: prefix = the backend most likely to hold its "
                             "prompt's first KV blocks, unless overloaded (default); round-robin; least-loaded")
    parser.add_argument("--routing-prefix-tokens", type=int, default=DEFAULT_PREFIX_TOKENS,
                        help="prompt tokens hashed for prefix routing (default: %(default)s, four 16-token blocks)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve HTTP on")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument("--tokenizer", default=None,
                        help="local tokenizer directory (default: fetch the backend's and cache it)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize "
                             f"(default: ${API_KEY_ENV})")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: the backend's)")
    parser.add_argument("--backend-timeout", type=float, default=600.0,
                        help="seconds to wait at startup for the backend to be healthy (0: no limit)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds open requests get to finish after SIGTERM")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
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
    return parser


def _exit_cleanly(signum: int, frame) -> None:
    raise SystemExit(0)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the frontend; 0 after SIGINT/SIGTERM, 1 (with the reason on stderr) if it cannot start."""
    args = build_parser().parse_args(argv)
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
                        args.routing_prefix_tokens, Limits.from_cli_args(args), security, args.tool_call_parser))
    except TandemError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
