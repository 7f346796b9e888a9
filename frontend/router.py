"""Router: one ``EngineClient`` over several backends — prefix affinity, load and health (no torch).

    --backend a:50051,b:50051        fixed backends (a name here is one backend: gRPC connects to it)
    --backend dns:///backend:50051   every address the name resolves to is a backend; re-resolved
                                     every few seconds, so replicas come and go

Each request goes to one backend (``choose``):

1. ``prefix`` (the default): the key is a hash of the prompt's first ``prefix_tokens`` token IDs
   (the first KV-cache blocks; the whole prompt if shorter). Rendezvous hashing (highest score of
   hash(key, address)) makes that key's favourite the same backend in every frontend, with no
   shared state, and losing or adding a backend moves only the keys it wins. Prompts that share
   their first blocks thus land where those blocks are already cached.
2. When the favourite is overloaded — its load (running + waiting sequences, from ``GetLoad``,
   plus what this frontend sent it since) exceeds the least-loaded backend's by ``balance_abs``
   and by the factor ``balance_rel`` — the least-loaded backend takes the request instead.
   ``round-robin`` and ``least-loaded`` are the plain policies (baselines; no affinity).
3. A call that fails UNAVAILABLE or RESOURCE_EXHAUSTED before its first delta never ran: it is
   sent to the next choice, each backend tried at most once.

Health: every ``check_interval`` seconds each backend is asked ``grpc.health.v1`` and ``GetLoad``;
a backend failing two checks in a row (a busy one may miss one), or refusing a Generate as
UNAVAILABLE, is skipped, and taken back as soon as a check finds it SERVING. When no backend
looks healthy, those that served before are still tried rather than failing the request unseen. A backend joining with a different model or
tokenizer than the first one seen is refused (logged), since token IDs would mean other things.
A backend that refuses this frontend's credentials (UNAUTHENTICATED, a failed TLS handshake) is
skipped and logged as an error naming the flag to fix, again every 30 s while it lasts;
``credentials_problem`` tells the frontend's startup when no backend is left to wait for.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import itertools
import logging
import os
import socket
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

from prometheus_client.registry import Collector

from backend.types.errors import InvalidRequestError, TandemError
from backend.types.outputs import EngineLoad, EngineOutput, ModelInfo
from backend.types.sampling_params import SamplingParams
from frontend.backend_targets import Target, address_of, parse_targets  # noqa: F401 -- parse_targets: API
from frontend.grpc_client import (BackendCredentialsError, BackendOverloadedError, BackendUnavailableError,
                                  GrpcEngineClient)
from frontend.router_metrics import RouterCollector, merged_engine_metrics

logger = logging.getLogger(__name__)

POLICIES = ("prefix", "round-robin", "least-loaded")
DEFAULT_PREFIX_TOKENS = 64  # four 16-token KV blocks
DEFAULT_BALANCE_ABS = 8  # sequences
DEFAULT_BALANCE_REL = 1.5
CHECK_INTERVAL_S = 1.0
UNHEALTHY_AFTER_CHECKS = 2  # failed checks in a row that take a backend out (a refused call: at once)
ADMIT_TIMEOUT_S = 10.0
LOAD_TIMEOUT_S = 2.0
METRICS_TIMEOUT_S = 5.0  # a backend's GetMetrics; one that is late is left out of that scrape
RESOLVE_INTERVAL_S = 5.0
CREDENTIALS_LOG_INTERVAL_S = 30.0  # a backend refusing our credentials is reported again this often


def prefix_key(prompt_token_ids: list[int], prefix_tokens: int, salt: Optional[str] = None) -> bytes:
    """The routing key of a prompt: a hash of its first ``prefix_tokens`` token IDs (and the cache
    salt, since differently salted requests never share cached blocks)."""
    digest = hashlib.blake2b(array.array("I", prompt_token_ids[:prefix_tokens]).tobytes(), digest_size=16)
    if salt:
        digest.update(b"\0" + salt.encode())
    return digest.digest()


def rendezvous_score(key: bytes, address: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + address.encode(), digest_size=8).digest(), "big")


@dataclass
class Backend:
    """One backend as the router sees it."""

    address: str
    client: GrpcEngineClient
    healthy: bool = False
    admitted: bool = False  # has served the reference model (so worth a try even when checks miss)
    failed_checks: int = 0  # health checks failed in a row
    refused: Optional[str] = None  # why it is never used (another model or tokenizer)
    credentials_refused: Optional[str] = None  # why it refuses this frontend's token or TLS, while it does
    credentials_logged_at: float = -float("inf")
    polled_load: int = 0  # running + waiting sequences at the last GetLoad
    in_flight: int = 0  # this frontend's requests on it now
    in_flight_at_poll: int = 0
    requests: dict[str, int] = field(default_factory=dict)  # by reason, for metrics
    retired: bool = False  # gone from DNS: no new requests; closed once idle

    @property
    def usable(self) -> bool:
        return self.healthy and self.refused is None and not self.retired

    @property
    def load(self) -> int:
        """The backend's last reported load plus what this frontend has sent it since."""
        return self.polled_load + max(0, self.in_flight - self.in_flight_at_poll)


class NoBackendError(BackendUnavailableError):
    """No backend can take a request now."""


class Router:
    """``EngineClient`` over the backends of ``targets`` (see the module doc).

    ``start()`` (inside the running loop) resolves the targets and starts the
    checks; ``close()`` stops them and closes every channel. ``client_factory``
    makes the client of one address (the place for channel credentials).
    """

    def __init__(self, targets: list[Target], policy: str = "prefix", prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
                 balance_abs: int = DEFAULT_BALANCE_ABS, balance_rel: float = DEFAULT_BALANCE_REL,
                 check_interval: float = CHECK_INTERVAL_S, resolve_interval: float = RESOLVE_INTERVAL_S,
                 client_factory: Callable[[str], GrpcEngineClient] = GrpcEngineClient) -> None:
        if policy not in POLICIES:
            raise InvalidRequestError(f"--routing must be one of {', '.join(POLICIES)}; got {policy!r}.",
                                      param="routing")
        if prefix_tokens < 1:
            raise InvalidRequestError(f"--routing-prefix-tokens must be at least 1; got {prefix_tokens}.",
                                      param="routing_prefix_tokens")
        if not targets:
            raise InvalidRequestError("--backend names no backend.", param="backend")
        self.targets = targets
        self.policy = policy
        self.prefix_tokens = prefix_tokens
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.check_interval = check_interval
        self.resolve_interval = resolve_interval
        self.client_factory = client_factory
        self.backends: dict[str, Backend] = {}
        self._requests: dict[str, Backend] = {}  # in-flight request ID -> its backend (for abort)
        self._reference: Optional[tuple[ModelInfo, str]] = None  # the first backend's model and tokenizer
        self._round_robin = itertools.count()
        self._task: Optional[asyncio.Task] = None
        self._resolved: dict[Target, set[str]] = {}  # the addresses each target stands for
        self._resolved_at = -float("inf")

    # ---- choosing -------------------------------------------------------------------------------

    def choose(self, prompt_token_ids: list[int], salt: Optional[str] = None,
               exclude: frozenset[str] = frozenset()) -> tuple[Backend, str]:
        """The backend for a prompt and why (``prefix``, ``load``, ``round-robin``, ``least-loaded``).

        Raises ``NoBackendError`` when no usable backend is left outside ``exclude``.
        """
        candidates = sorted((b for b in self.backends.values() if b.usable and b.address not in exclude),
                            key=lambda b: b.address)
        if not candidates:
            # None looks healthy: try those that served this model before rather than fail
            # outright (health checks can miss on a busy machine; a dead one refuses at once).
            candidates = sorted((b for b in self.backends.values() if b.admitted and b.refused is None
                                 and not b.retired and b.address not in exclude), key=lambda b: b.address)
        if not candidates:
            known = ", ".join(f"{b.address} ({self._state(b)})" for b in self.backends.values()) or "none found"
            raise NoBackendError(f"No backend can take the request now; backends: {known}.")
        least = min(candidates, key=lambda b: b.load)
        if self.policy == "round-robin":
            return candidates[next(self._round_robin) % len(candidates)], "round-robin"
        if self.policy == "least-loaded":
            return least, "least-loaded"
        key = prefix_key(prompt_token_ids, self.prefix_tokens, salt)
        favourite = max(candidates, key=lambda b: rendezvous_score(key, b.address))
        if favourite.load > least.load + self.balance_abs and favourite.load > least.load * self.balance_rel:
            return least, "load"
        return favourite, "prefix"

    @staticmethod
    def _state(backend: Backend) -> str:
        if backend.refused:
            return "refused"
        if backend.retired:
            return "gone"
        return "healthy" if backend.healthy else "unhealthy"

    # ---- EngineClient ----------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       **options) -> AsyncIterator[EngineOutput]:
        """Stream the request from the chosen backend; ``options`` go to its ``generate``.

        Before the first delta, UNAVAILABLE and RESOURCE_EXHAUSTED send the request to the
        next choice; after it, errors reach the caller (the output has begun).
        """
        tried: set[str] = set()
        last_error: Optional[TandemError] = None
        while True:
            try:
                backend, reason = self.choose(prompt_token_ids, options.get("cache_salt"), frozenset(tried))
            except NoBackendError:
                if last_error is not None:
                    raise last_error from None  # every backend refused: say why the last one did
                raise
            backend.requests[reason] = backend.requests.get(reason, 0) + 1
            backend.in_flight += 1
            self._requests[request_id] = backend
            started = False
            try:
                # Closed here, at once, when this is closed (the caller read to the last delta, or left):
                # not later by the event loop's finalizer, a task and a wake-up of the loop each.
                async with aclosing(backend.client.generate(request_id, prompt_token_ids, params,
                                                            **options)) as outputs:
                    async for output in outputs:
                        started = True
                        yield output
                return
            except (BackendUnavailableError, BackendOverloadedError) as error:
                if started:
                    raise
                if isinstance(error, BackendUnavailableError):
                    self._mark_down(backend, str(error))
                logger.info("Request %s: %s refused it (%s); trying another backend.", request_id,
                            backend.address, error)
                tried.add(backend.address)
                last_error = error
            finally:
                backend.in_flight -= 1
                if self._requests.get(request_id) is backend:
                    del self._requests[request_id]
                if backend.retired and backend.in_flight == 0:
                    await self._close_backend(backend)

    async def embed(self, request_id: str, prompt_token_ids: list[int], pooling, **options) -> list[float]:
        """One prompt's embedding from the chosen backend; UNAVAILABLE and RESOURCE_EXHAUSTED send
        it to the next choice, as ``generate`` does before its first delta."""
        tried: set[str] = set()
        last_error: Optional[TandemError] = None
        while True:
            try:
                backend, reason = self.choose(prompt_token_ids, None, frozenset(tried))
            except NoBackendError:
                if last_error is not None:
                    raise last_error from None
                raise
            backend.requests[reason] = backend.requests.get(reason, 0) + 1
            backend.in_flight += 1
            try:
                return await backend.client.embed(request_id, prompt_token_ids, pooling, **options)
            except (BackendUnavailableError, BackendOverloadedError) as error:
                if isinstance(error, BackendUnavailableError):
                    self._mark_down(backend, str(error))
                tried.add(backend.address)
                last_error = error
            finally:
                backend.in_flight -= 1
                if backend.retired and backend.in_flight == 0:
                    await self._close_backend(backend)

    async def abort(self, request_id: str) -> None:
        backend = self._requests.get(request_id)
        if backend is not None:
            await backend.client.abort(request_id)

    async def model_info(self) -> ModelInfo:
        info, _ = self._require_reference()
        return ModelInfo(**vars(info))

    async def tokenizer_fingerprint(self) -> str:
        return self._require_reference()[1]

    async def fetch_tokenizer(self, dest_dir: str | os.PathLike):
        """The tokenizer files of a usable backend (all have the same fingerprint)."""
        backend, _ = self.choose([])
        return await backend.client.fetch_tokenizer(dest_dir)

    async def get_load(self) -> EngineLoad:
        """The usable backends' loads added up (KV usage: their mean)."""
        loads = await asyncio.gather(*(b.client.get_load() for b in self.backends.values() if b.usable))
        if not loads:
            return EngineLoad(0, 0, 0.0)
        return EngineLoad(sum(load.num_requests_running for load in loads),
                          sum(load.num_requests_waiting for load in loads),
                          sum(load.kv_cache_usage for load in loads) / len(loads))

    async def health(self) -> bool:
        """True while some backend can take requests (as of the last check, at most
        ``check_interval`` seconds old)."""
        return any(backend.usable for backend in self.backends.values())

    def _require_reference(self) -> tuple[ModelInfo, str]:
        if self._reference is None:
            raise NoBackendError("No backend has answered yet.")
        return self._reference

    # ---- keeping the backend list and health current ------------------------------------------

    async def start(self) -> None:
        """Resolve the targets, check every backend once, then keep checking in the background."""
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._keep_current())

    async def _keep_current(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 -- the checks must outlive any one failure
                logger.exception("Router refresh failed; retrying.")

    async def refresh(self) -> None:
        """One round: re-resolve ``dns:///`` targets when due, then check every backend."""
        if time.monotonic() - self._resolved_at >= self.resolve_interval:
            await self._resolve()
            self._resolved_at = time.monotonic()
        await asyncio.gather(*(self._check(b) for b in list(self.backends.values()) if not b.retired))

    async def _resolve(self) -> None:
        loop = asyncio.get_running_loop()
        for target in self.targets:
            if not target.resolve:
                self._resolved[target] = {target.address}
                continue
            try:
                infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
            except OSError as error:  # keep what it had: a DNS hiccup must not drop every backend
                logger.warning("Could not resolve %s: %s", target.host, error)
                continue
            self._resolved[target] = {address_of(info[4][0], info[4][1]) for info in infos}
        addresses = set().union(*self._resolved.values())
        for address in sorted(addresses):
            backend = self.backends.get(address)
            if backend is None:
                logger.info("Backend %s found.", address)
                self.backends[address] = Backend(address, self.client_factory(address))
            elif backend.retired:  # back in DNS before its last request ended
                backend.retired = False
        for address in set(self.backends) - addresses:
            backend = self.backends[address]
            if not backend.retired:
                logger.info("Backend %s is gone from DNS.", address)
                backend.retired = True
                if backend.in_flight == 0:
                    await self._close_backend(backend)

    async def _check(self, backend: Backend) -> None:
        try:
            healthy = await backend.client.health()
            if healthy and not backend.healthy:  # new, or back (perhaps restarted with another model)
                backend.refused = None
                await asyncio.wait_for(self._admit(backend), ADMIT_TIMEOUT_S)
            backend.credentials_refused = None
        except BackendCredentialsError as error:  # an operator's mistake: never only a debug line
            healthy = False
            self._credentials_refused(backend, str(error))
        except (TandemError, asyncio.TimeoutError) as error:
            healthy = False
            logger.debug("Backend %s check failed: %s", backend.address, error)
        if not healthy:
            backend.failed_checks += 1
            # One missed check is no verdict: a backend busy computing may answer late.
            if backend.healthy and backend.failed_checks >= UNHEALTHY_AFTER_CHECKS:
                self._mark_down(backend, f"{backend.failed_checks} health checks failed in a row")
            return
        backend.failed_checks = 0
        if not backend.healthy:
            logger.info("Backend %s is serving.", backend.address)
            backend.healthy = True
            backend.admitted = backend.refused is None
        try:
            load = await asyncio.wait_for(backend.client.get_load(), LOAD_TIMEOUT_S)
        except (TandemError, asyncio.TimeoutError):
            return  # keep the last figure: a late load report says nothing about health
        backend.polled_load = load.num_requests_running + load.num_requests_waiting
        backend.in_flight_at_poll = backend.in_flight

    async def _admit(self, backend: Backend) -> None:
        """Compare a backend's model and tokenizer with the first backend's; refuse it if they differ."""
        info = await backend.client.model_info()
        fingerprint = await backend.client.tokenizer_fingerprint()
        if self._reference is None:
            self._reference = (info, fingerprint)
        reference, reference_fingerprint = self._reference
        # From now on the client checks every reconnection itself (a quick restart can come back
        # with another tokenizer between two of these checks).
        backend.client.expect_tokenizer(reference_fingerprint)
        if (info.model_name, info.max_model_len, fingerprint) != (
                reference.model_name, reference.max_model_len, reference_fingerprint):
            backend.refused = (f"it serves {info.model_name} (max_model_len {info.max_model_len}, tokenizer "
                               f"{fingerprint[:16]}), not {reference.model_name} (max_model_len "
                               f"{reference.max_model_len}, tokenizer {reference_fingerprint[:16]})")
            logger.error("Refusing backend %s: %s.", backend.address, backend.refused)

    def _credentials_refused(self, backend: Backend, why: str) -> None:
        """Take the backend out at once and say why, now and every ``CREDENTIALS_LOG_INTERVAL_S``."""
        now = time.monotonic()
        if why != backend.credentials_refused or now - backend.credentials_logged_at >= CREDENTIALS_LOG_INTERVAL_S:
            logger.error("Backend %s: %s", backend.address, why)
            backend.credentials_logged_at = now
        backend.credentials_refused = why
        backend.failed_checks = UNHEALTHY_AFTER_CHECKS  # no second try: it will refuse again
        backend.healthy = False

    def credentials_problem(self) -> Optional[str]:
        """Why waiting for a backend is pointless: every backend known refuses this frontend's
        credentials (and none is usable). None while some backend serves or may yet."""
        backends = [backend for backend in self.backends.values() if not backend.retired]
        if not backends or any(backend.usable or not backend.credentials_refused for backend in backends):
            return None
        return "; ".join(f"{backend.address}: {backend.credentials_refused}" for backend in backends)

    def _mark_down(self, backend: Backend, why: str) -> None:
        if backend.healthy:
            logger.warning("Backend %s is unavailable (%s); skipping it until it serves again.",
                           backend.address, why)
        backend.healthy = False

    async def _close_backend(self, backend: Backend) -> None:
        if self.backends.get(backend.address) is backend:
            del self.backends[backend.address]
        await backend.client.close()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for backend in list(self.backends.values()):
            await backend.client.close()
        self.backends.clear()

    # ---- metrics (frontend.router_metrics) ------------------------------------------------------

    def collector(self) -> Collector:
        """A Prometheus collector of the router's state, read at scrape time."""
        return RouterCollector(self)

    async def metrics_text(self) -> str:
        """The usable backends' engine metrics (``GetMetrics``) as one Prometheus text exposition,
        every sample labelled with its ``backend`` address (``merged_engine_metrics``)."""
        return await merged_engine_metrics([b for b in self.backends.values() if b.usable], METRICS_TIMEOUT_S)
