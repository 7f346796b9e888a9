"""The frontend's ``--backend`` flag: the backends it names, one by one or through DNS."""

from __future__ import annotations

from dataclasses import dataclass

from backend.types.errors import InvalidRequestError

DNS_SCHEME = "dns:///"


@dataclass(frozen=True)
class Target:
    """One ``--backend`` entry: ``host:port`` (one backend) or ``dns:///host:port`` (each address)."""

    host: str
    port: int
    resolve: bool

    @property
    def address(self) -> str:
        return address_of(self.host, self.port)


def parse_targets(spec: str) -> list[Target]:
    """``a:50051,dns:///b:50051`` -> targets; raises ``InvalidRequestError`` naming ``--backend``."""
    targets = []
    for entry in (part.strip() for part in spec.split(",")):
        resolve = entry.startswith(DNS_SCHEME)
        host, _, port = entry[len(DNS_SCHEME) if resolve else 0:].rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidRequestError(
                f"--backend entry {entry!r} is not HOST:PORT or dns:///NAME:PORT.", param="backend")
        targets.append(Target(host.strip("[]"), int(port), resolve))
    if len(set(targets)) != len(targets):
        raise InvalidRequestError(f"--backend {spec!r} names a backend twice.", param="backend")
    return targets


def address_of(host: str, port: int) -> str:
    """host:port, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
