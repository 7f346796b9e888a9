"""The engine contract is default-deny: token auth (one interceptor, constant-time compare), TLS and
mutual TLS, a loopback default bind, Abort scoped to its caller, health left open. A frontend whose
token or TLS settings the backend refuses says so at once, naming the flag, and does not start.

One backend per security setting, each on a tiny random Llama in process, on loopback. The
certificates (a CA, a server certificate for 127.0.0.1/localhost, a client certificate) are made
with the ``cryptography`` package for this module.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import LoopThread, free_port

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.server.auth import ServerSecurity, is_loopback
from backend.server.grpc_server import BackendServer
from backend.server.main import main as backend_main
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.sampling_params import SamplingParams
from frontend.server import StartupError, wait_for_backend
from frontend.grpc_client import (BackendCredentialsError, BackendError, ChannelSecurity, GrpcEngineClient,
                                  error_from_status)
from frontend.router import Router, parse_targets
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

TOKEN = "s3cret-token"
REPO_ROOT = Path(__file__).resolve().parents[1]


# ---- certificates ---------------------------------------------------------------------------------


def make_certificates(directory: Path) -> dict[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    files: dict[str, str] = {}

    def write(name: str, data: bytes) -> str:
        path = directory / name
        path.write_bytes(data)
        files[name] = str(path)
        return str(path)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def certificate(subject: str, key, issuer_name, issuer_key, ca: bool, sans=None):
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem-test-ca")])
    ca = certificate("tandem-test-ca", ca_key, ca_name, ca_key, ca=True)
    write("ca.pem", ca.public_bytes(serialization.Encoding.PEM))
    for name, sans in (("server", [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = certificate(f"tandem-test-{name}", key, ca_name, ca_key, ca=False, sans=sans)
        write(f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
        write(f"{name}.key", key_pem(key))
    return files


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=64,
                                         block_size=4, max_model_len=64, max_num_seqs=4))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def loop():
    loop = LoopThread()
    yield loop
    loop.close()


class Served:
    def __init__(self, loop: LoopThread, engine: AsyncLLMEngine, security: ServerSecurity) -> None:
        self.loop = loop
        self.server = BackendServer(engine, "127.0.0.1", 0, security=security)

    def __enter__(self) -> str:
        self.loop.run(self.server.start())
        return f"127.0.0.1:{self.server.port}"

    def __exit__(self, *exc) -> None:
        self.loop.run(self.server.stop(0))


def generate_once(channel: grpc.Channel, metadata=(), request_id: str = "r") -> list:
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    return list(stub.Generate(engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3],
                                                         sampling_params=engine_pb2.SamplingParams(max_tokens=2)),
                              timeout=20, metadata=metadata))


def health_of(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


# ---- token auth -----------------------------------------------------------------------------------


def test_every_call_but_health_needs_the_token(loop, engine):
    with Served(loop, engine, ServerSecurity(auth_token=TOKEN)) as address, grpc.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),),
                         (("authorization", f"Bearer {TOKEN}x"),)):
            with pytest.raises(grpc.RpcError) as error:
                generate_once(channel, metadata)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for call, request in ((stub.GetModelInfo, engine_pb2.GetModelInfoRequest()),
                                  (stub.Abort, engine_pb2.AbortRequest(request_ids=["x"])),
                                  (stub.GetLoad, engine_pb2.GetLoadRequest())):
                with pytest.raises(grpc.RpcError) as error:
                    call(request, timeout=10, metadata=metadata)
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as error:
                list(stub.GetTokenizer(engine_pb2.GetTokenizerRequest(), timeout=10, metadata=metadata))
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert health_of(channel) == health_pb2.HealthCheckResponse.SERVING  # health stays open
        good = (("authorization", f"Bearer {TOKEN}"),)
        assert generate_once(channel, good)[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10, metadata=good).vocab_size == 384


def test_grpc_engine_client_sends_the_token(loop, engine):
    async def run(security: ChannelSecurity, address: str):
        client = GrpcEngineClient(address, security=security)
        try:
            outputs = [o async for o in client.generate("c", [1, 2], SamplingParams(max_tokens=2))]
            return outputs[-1].finish_reason, await client.health()
        finally:
            await client.close()

    with Served(loop, engine, ServerSecurity(auth_token=TOKEN)) as address:
        finish, healthy = asyncio.run(run(ChannelSecurity(auth_token=TOKEN), address))
        assert finish is not None and healthy
        with pytest.raises(BackendError, match="UNAUTHENTICATED"):
            asyncio.run(run(ChannelSecurity(), address))


# ---- TLS and mutual TLS ---------------------------------------------------------------------------


def tls_channel(address: str, certs: dict, client_cert: bool) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(certs["ca.pem"]).read_bytes(),
        private_key=Path(certs["client.key"]).read_bytes() if client_cert else None,
        certificate_chain=Path(certs["client.pem"]).read_bytes() if client_cert else None)
    return grpc.secure_channel(address, credentials)


def test_tls_refuses_plaintext_and_serves_a_client_with_the_ca(loop, engine, certs):
    security = ServerSecurity(ssl_certfile=certs["server.pem"], ssl_keyfile=certs["server.key"])
    with Served(loop, engine, security) as address:
        with grpc.insecure_channel(address) as plaintext:
            with pytest.raises(grpc.RpcError) as error:
                health_of(plaintext)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        with tls_channel(address, certs, client_cert=False) as channel:
            assert generate_once(channel)[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH


def test_mutual_tls_refuses_a_client_without_a_certificate(loop, engine, certs):
    security = ServerSecurity(ssl_certfile=certs["server.pem"], ssl_keyfile=certs["server.key"],
                              ssl_ca_certs=certs["ca.pem"])
    with Served(loop, engine, security) as address:
        with tls_channel(address, certs, client_cert=False) as channel:
            with pytest.raises(grpc.RpcError) as error:
                health_of(channel)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        with tls_channel(address, certs, client_cert=True) as channel:
            assert generate_once(channel)[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH

        async def through_client() -> bool:  # the frontend's options: CA, client certificate and key
            client = GrpcEngineClient(address, security=ChannelSecurity(
                ssl_ca_certs=certs["ca.pem"], ssl_certfile=certs["client.pem"], ssl_keyfile=certs["client.key"]))
            try:
                return await client.health()
            finally:
                await client.close()

        assert asyncio.run(through_client())


# ---- Abort is scoped to the caller ----------------------------------------------------------------


def test_abort_only_stops_the_callers_own_requests(loop, engine):
    with Served(loop, engine, ServerSecurity()) as address, grpc.insecure_channel(address) as mine, \
            grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as theirs:
        stub = engine_pb2_grpc.EngineServiceStub(mine)
        call = stub.Generate(engine_pb2.GenerateRequest(
            request_id="victim", prompt_token_ids=[1, 2, 3],
            sampling_params=engine_pb2.SamplingParams(max_tokens=40, ignore_eos=True)), timeout=60)
        first = next(call)
        # Another connection aborts it by ID: ignored, as an unknown ID would be.
        engine_pb2_grpc.EngineServiceStub(theirs).Abort(engine_pb2.AbortRequest(request_ids=["victim"]), timeout=10)
        rest = list(call)
        assert sum(len(r.new_token_ids) for r in [first, *rest]) == 40
        assert rest[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        # Its own caller can abort it.
        call = stub.Generate(engine_pb2.GenerateRequest(
            request_id="mine", prompt_token_ids=[1, 2, 3],
            sampling_params=engine_pb2.SamplingParams(max_tokens=40, ignore_eos=True)), timeout=60)
        next(call)
        stub.Abort(engine_pb2.AbortRequest(request_ids=["mine"]), timeout=10)
        assert list(call)[-1].finish_reason == engine_pb2.FINISH_REASON_ABORT


# ---- the bind policy ------------------------------------------------------------------------------


def test_loopback_detection():
    assert all(map(is_loopback, ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "10.0.0.5", "example.com", "")))


def test_a_non_loopback_bind_needs_a_token_mtls_or_insecure(certs):
    with pytest.raises(InvalidRequestError, match="--auth-token.*--ssl-ca-certs.*--insecure"):
        ServerSecurity().check_bind("0.0.0.0")
    with pytest.raises(InvalidRequestError):  # TLS alone encrypts but authenticates nobody
        ServerSecurity(ssl_certfile=certs["server.pem"], ssl_keyfile=certs["server.key"]).check_bind("0.0.0.0")
    ServerSecurity().check_bind("127.0.0.1")
    ServerSecurity(auth_token=TOKEN).check_bind("0.0.0.0")
    ServerSecurity(ssl_certfile=certs["server.pem"], ssl_keyfile=certs["server.key"],
                   ssl_ca_certs=certs["ca.pem"]).check_bind("0.0.0.0")
    ServerSecurity(insecure=True).check_bind("0.0.0.0")


def test_tandem_backend_refuses_an_open_bind_before_loading_the_model(capsys, monkeypatch):
    monkeypatch.delenv("TANDEM_GRPC_TOKEN", raising=False)
    assert backend_main(["/nonexistent-model", "--host", "0.0.0.0", "--port", "0"]) == 1
    assert "Refusing to serve the engine on '0.0.0.0'" in capsys.readouterr().err


def test_settings_that_do_not_go_together_are_refused(certs):
    with pytest.raises(InvalidRequestError):
        ServerSecurity(ssl_certfile=certs["server.pem"])
    with pytest.raises(InvalidRequestError):
        ServerSecurity(ssl_ca_certs=certs["ca.pem"])
    with pytest.raises(InvalidRequestError):
        ServerSecurity(auth_token="")
    with pytest.raises(InvalidRequestError):
        ChannelSecurity(ssl_certfile=certs["client.pem"], ssl_keyfile=certs["client.key"])


# ---- a frontend that cannot authenticate to its backend says so ---------------------------------


def test_credential_failures_become_one_typed_error_naming_the_flag():
    refused = error_from_status(grpc.aio.AioRpcError(grpc.StatusCode.UNAUTHENTICATED, grpc.aio.Metadata(),
                                                     grpc.aio.Metadata(), details="Missing or wrong token"))
    assert isinstance(refused, BackendCredentialsError) and isinstance(refused, BackendError)
    assert "UNAUTHENTICATED" in str(refused) and "--backend-auth-token" in str(refused)
    handshake = error_from_status(grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
        details="failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls handshake failed"))
    assert isinstance(handshake, BackendCredentialsError) and "--backend-ssl-ca-certs" in str(handshake)


async def start_frontend_router(address: str, security: ChannelSecurity, timeout: float) -> Router:
    """What the frontend does at startup (``frontend.server.run``): a router, then the wait."""
    router = Router(parse_targets(address), client_factory=lambda a: GrpcEngineClient(a, security=security))
    try:
        await router.start()
        await wait_for_backend(router, address, timeout)
    finally:
        await router.close()


@pytest.mark.timeout(60)
def test_a_missing_token_or_a_failed_tls_handshake_stops_the_startup_at_once(loop, engine, certs):
    with Served(loop, engine, ServerSecurity(auth_token=TOKEN)) as address:
        started = time.monotonic()
        with pytest.raises(StartupError, match=r"UNAUTHENTICATED.*--backend-auth-token"):
            asyncio.run(start_frontend_router(address, ChannelSecurity(), timeout=120))
        assert time.monotonic() - started < 30  # not the 120 s --backend-timeout
        asyncio.run(start_frontend_router(address, ChannelSecurity(auth_token=TOKEN), timeout=30))  # the fix
    with Served(loop, engine, ServerSecurity()) as address:  # TLS asked of a backend without it
        with pytest.raises(StartupError, match=r"TLS.*handshake.*--backend-ssl-ca-certs"):
            asyncio.run(start_frontend_router(address, ChannelSecurity(ssl_ca_certs=certs["ca.pem"]), timeout=120))


@pytest.mark.timeout(60)
def test_a_backend_that_drops_every_connection_gets_a_warning_naming_the_tls_flags(loop, engine, certs, caplog):
    """Plaintext to a TLS backend, or no client certificate for a mutual-TLS one, looks like a
    connection dropped at once (it could pass, so the frontend keeps waiting), and says so."""
    tls = ServerSecurity(ssl_certfile=certs["server.pem"], ssl_keyfile=certs["server.key"])
    mutual = ServerSecurity(ssl_certfile=certs["server.pem"], ssl_keyfile=certs["server.key"],
                            ssl_ca_certs=certs["ca.pem"])
    for security, client_security, flag in (
            (tls, ChannelSecurity(), "--backend-ssl-ca-certs"),
            (mutual, ChannelSecurity(ssl_ca_certs=certs["ca.pem"]), "--backend-ssl-certfile")):
        caplog.clear()
        with Served(loop, engine, security) as address, caplog.at_level(logging.WARNING, "frontend.grpc_client"):
            with pytest.raises(StartupError, match="did not become healthy"):
                asyncio.run(start_frontend_router(address, client_security, timeout=2))
        warnings = [r.getMessage() for r in caplog.records if "closes each connection" in r.getMessage()]
        assert warnings and flag in warnings[0], caplog.text


@pytest.mark.timeout(120)
def test_a_frontend_with_a_wrong_backend_token_says_so_within_10_s_and_exits(loop, engine, tmp_path):
    """Acceptance: a frontend process started with a wrong backend token prints a line naming
    UNAUTHENTICATED and the token flag, then exits 1, within 10 s of a baseline: the same process
    failing at once after its imports (its port taken)."""
    def frontend(address: str, port: int) -> tuple[int, str, float]:
        env = {name: value for name, value in os.environ.items() if name != "TANDEM_API_KEY"}
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "frontend.server", "--backend", address, "--port",
                                 str(port), "--backend-timeout", "600"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=90, env={**env, "TANDEM_GRPC_TOKEN": "wrong-token"})
        return result.returncode, result.stdout + result.stderr, time.monotonic() - started

    with Served(loop, engine, ServerSecurity(auth_token=TOKEN)) as address, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, output, baseline_s = frontend(address, taken.getsockname()[1])
        assert code == 1 and "--port" in output, output
        code, output, wrong_token_s = frontend(address, free_port())
    assert code == 1, output
    lines = [line for line in output.splitlines() if "UNAUTHENTICATED" in line and "--backend-auth-token" in line]
    assert lines, output
    assert wrong_token_s < baseline_s + 10, (baseline_s, wrong_token_s)
