"""Who may call the engine: token auth, TLS/mTLS credentials and the bind policy (server side).

Default-deny: the backend binds loopback unless told otherwise, and refuses a
non-loopback address that neither a token nor mutual TLS protects, unless
``--insecure`` says so. With ``--auth-token`` every call but health must carry
``authorization: Bearer <token>`` (one interceptor checks it, in constant
time; UNAUTHENTICATED otherwise). ``--ssl-certfile``/``--ssl-keyfile`` serve
TLS; ``--ssl-ca-certs`` also requires a client certificate signed by that CA
(mTLS). The frontend's matching options are ``frontend.grpc_client.ChannelSecurity``.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Callable, Optional

import grpc
from grpc_health.v1 import health

from backend.types.errors import InvalidRequestError
from backend.types.wire import AUTH_METADATA_KEY, TOKEN_ENV

_OPEN_PREFIXES = (f"/{health.SERVICE_NAME}/",)  # health stays open, so load balancers can probe


@dataclass(frozen=True)
class ServerSecurity:
    """The backend's transport and authentication settings (its --auth-token/--ssl-*/--insecure flags)."""

    auth_token: Optional[str] = None
    ssl_certfile: Optional[str] = None
    ssl_keyfile: Optional[str] = None
    ssl_ca_certs: Optional[str] = None  # set: clients must present a certificate this CA signed (mTLS)
    insecure: bool = False

    def __post_init__(self) -> None:
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise InvalidRequestError("--ssl-certfile and --ssl-keyfile go together.", param="ssl_certfile")
        if self.ssl_ca_certs and not self.ssl_certfile:
            raise InvalidRequestError("--ssl-ca-certs (mTLS) needs --ssl-certfile and --ssl-keyfile.",
                                      param="ssl_ca_certs")
        if self.auth_token is not None and not self.auth_token:
            raise InvalidRequestError("--auth-token must not be empty.", param="auth_token")

    @property
    def mutual_tls(self) -> bool:
        return bool(self.ssl_ca_certs)

    def check_bind(self, host: str) -> None:
        """Refuse to expose an unauthenticated engine beyond this machine."""
        if is_loopback(host) or self.auth_token or self.mutual_tls or self.insecure:
            return
        raise InvalidRequestError(
            f"Refusing to serve the engine on {host!r} without authentication: anyone who reaches the port could "
            f"generate or pull the tokenizer. Give --auth-token (or ${TOKEN_ENV}), or --ssl-ca-certs with "
            "--ssl-certfile/--ssl-keyfile (mutual TLS), or --insecure to allow it anyway.", param="host")

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind ``address`` with TLS when configured; returns the port."""
        if not self.ssl_certfile:
            return server.add_insecure_port(address)
        credentials = grpc.ssl_server_credentials(
            [(_read(self.ssl_keyfile), _read(self.ssl_certfile))],
            root_certificates=_read(self.ssl_ca_certs) if self.ssl_ca_certs else None,
            require_client_auth=self.mutual_tls)
        return server.add_secure_port(address, credentials)

    def interceptors(self, on_reject: Callable[[str], None] = lambda method: None) -> list:
        return [TokenAuthInterceptor(self.auth_token, on_reject)] if self.auth_token else []


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name, or 0.0.0.0 / :: (every interface)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call but health without ``authorization: Bearer <token>``.

    The comparison is constant-time (``hmac.compare_digest``), so timing does
    not tell how much of a guess was right. A refused call's request is never
    decoded.
    """

    def __init__(self, token: str, on_reject: Callable[[str], None]) -> None:
        self._expected = f"Bearer {token}".encode()
        self._on_reject = on_reject

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_OPEN_PREFIXES):
            return handler
        given = next((value for key, value in handler_call_details.invocation_metadata or ()
                      if key == AUTH_METADATA_KEY), None)
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._expected):
            return handler
        self._on_reject(method.rsplit("/", 1)[-1])
        return _denying_handler(handler)


async def _deny(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "Missing or wrong token: send metadata 'authorization: Bearer <token>'.")


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that refuses the call."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny)
    return grpc.unary_unary_rpc_method_handler(_deny)
