"""The backend's gRPC server: EngineService over an in-process engine, plus health, reflection, metrics.

EngineService itself is ``backend.server.servicer``; errors become status codes in one place,
``backend.server.status_codes.map_errors``; the command line is ``backend.server.main``.

Security (``backend.server.auth``): loopback by default; beyond it, a token
(checked by one interceptor, UNAUTHENTICATED otherwise) or mutual TLS, unless
``--insecure``. Health stays open; metrics bind apart (``--metrics-host``,
loopback by default). Abort stops only the caller's own requests.

Admission control: a Generate call whose sequences would take the ones in
flight past ``max_num_seqs + --max-num-queued-requests`` is refused at once
with RESOURCE_EXHAUSTED. Every bound is a ``Limits`` field (backend/types/limits.py).

On SIGTERM/SIGINT the server drains: health turns NOT_SERVING, new Generate
calls get UNAVAILABLE, running streams get ``--shutdown-timeout`` seconds to
finish and are then cancelled; the process exits 0. If the engine dies,
health turns NOT_SERVING at once, the server drains the same way and the
process exits 1, so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.server import grpc_logs
from backend.server.auth import ServerSecurity
from backend.server.metrics import EngineMetrics
from backend.server.reflection import enable_reflection
from backend.server.servicer import SERVICE_NAME, EngineServicer, engine_service_handler
from backend.types.config import EngineConfig
from backend.types.limits import Limits
from backend.types.ports import check_port_free, port_error
from backend.types.startup_heap import tune_gc_for_serving
from backend.types.startup_log import log_phase, seconds_since_process_start

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTION_AGE_S = 300.0
ENGINE_HEALTH_POLL_S = 0.5


class BackendServer:
    """A gRPC server around an ``AsyncLLMEngine``: EngineService, health, reflection and metrics.

    Does not own the engine: ``stop()`` leaves it running (``serve`` shuts it down). Health
    tells the truth: NOT_SERVING from the moment the engine dies (``engine_died`` is then set).
    """

    def __init__(self, engine: AsyncLLMEngine, host: str = "127.0.0.1", port: int = 50051,
                 metrics_port: Optional[int] = None, limits: Optional[Limits] = None,
                 max_connection_age: float = DEFAULT_MAX_CONNECTION_AGE_S,
                 security: Optional[ServerSecurity] = None, metrics_host: str = "127.0.0.1") -> None:
        self.engine = engine
        self.host = host
        self.port = port  # the bound port once started (port 0 picks a free one)
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.limits = limits or Limits()
        self.max_connection_age = max_connection_age
        self.security = security or ServerSecurity()
        self.metrics: Optional[EngineMetrics] = None
        self.servicer: Optional[EngineServicer] = None
        self.health = health.aio.HealthServicer()
        self.engine_died = asyncio.Event()
        self._server: Optional[grpc.aio.Server] = None
        self._watcher: Optional[asyncio.Task] = None

    async def start(self) -> None:
        self.security.check_bind(self.host)
        info = await self.engine.model_info()
        self.metrics = EngineMetrics(self.engine.engine, info.model_name)
        self.servicer = EngineServicer(self.engine, info.tokenizer_path, self.metrics, self.limits,
                                       self.engine.engine.config.max_num_seqs)
        message_bytes = self.limits.max_grpc_message_bytes
        # gRPC core cancels (CANCELLED, not RESOURCE_EXHAUSTED) calls that arrive faster than the
        # event loop accepts them once 1,000 (3,000 hard) wait: a burst of thousands of streams
        # lost calls that way. Room for a burst of several times what admission lets in, so the
        # excess reaches admission control and gets its proper answer.
        pending = 4 * self.servicer.max_sequences_in_flight
        options = [("grpc.max_send_message_length", message_bytes),
                   ("grpc.max_receive_message_length", message_bytes),
                   ("grpc.server.max_pending_requests", pending),
                   ("grpc.server.max_pending_requests_hard_limit", pending),
                   # The port is ours alone: gRPC's default SO_REUSEPORT would let a second
                   # server bind it silently and share the traffic.
                   ("grpc.so_reuseport", 0)]
        if self.max_connection_age > 0:
            # Clients reconnect after this long (running streams finish first: the grace is
            # unlimited), so a load balancer or DNS in front sends new connections to new replicas.
            options.append(("grpc.max_connection_age_ms", int(self.max_connection_age * 1000)))
        interceptors = self.security.interceptors(
            on_reject=lambda method: self.metrics.observe_rejected(method, "unauthenticated"))
        grpc_logs.install()
        server = grpc.aio.server(interceptors=interceptors, options=options)
        server.add_generic_rpc_handlers((engine_service_handler(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection((SERVICE_NAME, health.SERVICE_NAME), server)  # v1 and v1alpha
        try:
            self.port = self.security.add_port(server, f"{self.host}:{self.port}")
        except RuntimeError:  # gRPC says only "Failed to bind"
            raise port_error(self.host, self.port, "--port") from None
        await server.start()
        self._server = server
        for service in ("", SERVICE_NAME):  # "" is the whole server
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.start_http_server(self.metrics_host, self.metrics_port)
            except OSError as error:
                await self._server.stop(grace=None)
                raise port_error(self.metrics_host, self.metrics_port, "--metrics-port", error,
                                 "--metrics-host") from None
        self._watcher = asyncio.get_running_loop().create_task(self._watch_engine())

    async def _watch_engine(self) -> None:
        """Health tells the truth: NOT_SERVING as soon as the engine is dead (a step failed, or a
        worker died: then only ``health()`` may know, hence the poll)."""
        while await self.engine.health():
            try:
                await asyncio.wait_for(self.engine.dead.wait(), ENGINE_HEALTH_POLL_S)
            except asyncio.TimeoutError:
                pass
        logger.error("The engine died (%s): health is NOT_SERVING.", self.engine.dead_error)
        self.metrics.observe_engine_error()
        await self.health.enter_graceful_shutdown()
        self.engine_died.set()

    async def stop(self, timeout: float) -> None:
        """Drain, then stop: NOT_SERVING, refuse new Generate calls, give running streams
        ``timeout`` seconds, cancel what is left (which aborts it in the engine)."""
        await self.health.enter_graceful_shutdown()  # every service NOT_SERVING from now on
        if self._watcher is not None:
            self._watcher.cancel()
        if not await self.servicer.drain(timeout):
            logger.warning("Streams still running after %.1f s; cancelling them.", timeout)
        await self._server.stop(grace=None)
        self.metrics.stop_http_server()


async def serve(config: EngineConfig, host: str, port: int, metrics_port: Optional[int],
                shutdown_timeout: float, limits: Optional[Limits] = None,
                max_connection_age: float = DEFAULT_MAX_CONNECTION_AGE_S, security: Optional[ServerSecurity] = None,
                metrics_host: str = "127.0.0.1") -> int:
    """Check the bind and the ports, load the engine, serve until SIGTERM/SIGINT (exit code 0) or
    the engine's death (exit code 1), then drain and stop."""
    security = security or ServerSecurity()
    check_port_free(host, port, "--port")  # before the model loads, which takes a while
    security.check_bind(host)
    if metrics_port is not None:
        check_port_free(metrics_host, metrics_port, "--metrics-port", "--metrics-host")
    engine = AsyncLLMEngine(config, limits)
    try:
        server = BackendServer(engine, host, port, metrics_port, limits, max_connection_age, security, metrics_host)
        await server.start()
        tune_gc_for_serving()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"Backend serving {config.served_model_name} on {host}:{server.port} "
              f"(metrics on port {server.metrics_port})", flush=True)
        log_phase(logger, "ready", f"the backend serves gRPC on {host}:{server.port}",
                  seconds_since_process_start())
        stopped, died = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(server.engine_died.wait())
        await asyncio.wait((stopped, died), return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        died.cancel()
        if server.engine_died.is_set():
            print(f"error: the engine stopped after an error: {engine.dead_error}; exiting so that a "
                  "supervisor restarts the backend.", file=sys.stderr, flush=True)
        else:
            logger.info("Shutting down: draining for up to %.1f s.", shutdown_timeout)
        await server.stop(shutdown_timeout)
        return 1 if server.engine_died.is_set() else 0
    finally:
        engine.shutdown()
