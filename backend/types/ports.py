"""Ports: claimed exclusively, and a port in use fails fast with one line naming it and its flag.

Torch-free (stdlib only): the frontend and ``tandem serve`` use it too.
"""

from __future__ import annotations

import errno
import socket

from backend.types.errors import TandemError


class PortInUseError(TandemError):
    """A port a server needs is taken (or cannot be bound); the message names the flag to change."""


def check_port_free(host: str, port: int, flag: str) -> None:
    """Raise ``PortInUseError`` unless ``host:port`` can be bound right now (port 0 always can).

    The probe binds as our servers do — SO_REUSEADDR (a closed socket's TIME_WAIT is no conflict)
    but never SO_REUSEPORT, so a server already listening there, gRPC's included, is found.
    """
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise port_error(host, port, flag, error) from None


def port_error(host: str, port: int, flag: str, error: OSError | None = None) -> PortInUseError:
    """The one-line error for a port that could not be bound."""
    if error is None or error.errno == errno.EADDRINUSE:
        return PortInUseError(f"Port {port} on {host} is already in use; choose another with {flag}.")
    return PortInUseError(f"Cannot bind {host}:{port} ({error.strerror}); choose another with {flag}.")
