"""ChannelSecurity: how a frontend reaches a backend (its --backend-* token and TLS flags; torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import grpc

from backend.types.errors import InvalidRequestError
from backend.types.wire import AUTH_METADATA_KEY


@dataclass(frozen=True)
class ChannelSecurity:
    """How a frontend reaches a backend: its token and TLS settings (the frontend's --backend-* flags).

    ``ssl_ca_certs`` turns TLS on (the CA that signed the backend's certificate);
    ``ssl_certfile``/``ssl_keyfile`` add a client certificate (mTLS);
    ``ssl_server_name`` overrides the name checked in the backend's certificate
    (for an address that is not in it, e.g. an IP).
    """

    auth_token: Optional[str] = None
    ssl_ca_certs: Optional[str] = None
    ssl_certfile: Optional[str] = None
    ssl_keyfile: Optional[str] = None
    ssl_server_name: Optional[str] = None

    def __post_init__(self) -> None:
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise InvalidRequestError("--backend-ssl-certfile and --backend-ssl-keyfile go together.",
                                      param="backend_ssl_certfile")
        if (self.ssl_certfile or self.ssl_server_name) and not self.ssl_ca_certs:
            raise InvalidRequestError("A client certificate or server name needs --backend-ssl-ca-certs (TLS).",
                                      param="backend_ssl_ca_certs")

    @property
    def metadata(self) -> tuple:
        """Metadata every call carries."""
        return ((AUTH_METADATA_KEY, f"Bearer {self.auth_token}"),) if self.auth_token else ()

    def channel(self, address: str, options: list) -> grpc.aio.Channel:
        if not self.ssl_ca_certs:
            return grpc.aio.insecure_channel(address, options=options)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(self.ssl_ca_certs),
            private_key=_read(self.ssl_keyfile) if self.ssl_keyfile else None,
            certificate_chain=_read(self.ssl_certfile) if self.ssl_certfile else None)
        if self.ssl_server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.ssl_server_name)]
        return grpc.aio.secure_channel(address, credentials, options=options)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
