"""/health, /load, /metrics and /version: what the server says about itself (open without the API key).

/health asks the engine client (``GrpcEngineClient`` and ``Router`` have
``health()``) and carries this process's ``$TANDEM_INSTANCE_ID``, when set, in
``X-Tandem-Instance`` (``frontend.environment``). /metrics serves the frontend's
own registry (HTTP metrics, the router's collector), then the engines' metrics, then those of
them vLLM also has under vLLM's names (``frontend.vllm_metrics``).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import Response

from backend.types.errors import TandemError
from frontend import protocol as P
from frontend.environment import INSTANCE_ENV, INSTANCE_HEADER
from frontend.serving.base import ServingContext
from frontend.serving.errors import error_body, error_json_response
from frontend.vllm_metrics import vllm_named

logger = logging.getLogger(__name__)


def tandem_version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class ServingStatus:
    """The server's state for probes and operators. ``registry``: the frontend's own metrics."""

    def __init__(self, context: ServingContext, registry: CollectorRegistry) -> None:
        self.context = context
        self.registry = registry
        self.instance_headers = {INSTANCE_HEADER: os.environ[INSTANCE_ENV]} if os.environ.get(INSTANCE_ENV) else {}

    async def health(self) -> Response:
        try:
            healthy = await self.context.engine_client.health()
        except Exception:  # noqa: BLE001 -- any failure to answer means unhealthy
            healthy = False
        if healthy:
            return Response(status_code=200, headers=self.instance_headers)
        return error_json_response(503, error_body(503, "The backend is unavailable or not serving."))

    def load(self) -> P.LoadResponse:
        return P.LoadResponse(server_load=self.context.num_in_flight)

    async def metrics(self) -> Response:
        """The frontend's HTTP and router metrics, then the engines' (``Router.metrics_text``:
        each backend's GetMetrics, labelled by backend), also under vLLM's names. A client without
        it serves only ours."""
        text = generate_latest(self.registry)
        fetch = getattr(self.context.engine_client, "metrics_text", None)
        if fetch is not None:
            try:
                engine_text = await fetch()
                text += engine_text.encode() + vllm_named(engine_text).encode()
            except TandemError as error:  # the backend is down: /health says so; keep serving ours
                logger.warning("Could not fetch the backend's metrics: %s", error)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @staticmethod
    def version() -> P.VersionResponse:
        return P.VersionResponse(version=tandem_version())
