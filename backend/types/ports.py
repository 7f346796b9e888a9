"""Ports: claimed exclusively, and a port in use fails fast with one line naming it and its flag.

A port flag's value is checked when the command line is read (``port_number``: 1-65535;
``port_number_or_zero``: also 0, any free port), and an address that cannot be bound is blamed on
what is wrong: the port (in use, privileged) or the host (unknown name, not this machine's).

Torch-free (stdlib only): the frontend and ``tandem serve`` use it too.
"""

from __future__ import annotations

import argparse
import errno
import socket

from backend.types.errors import TandemError

MAX_PORT = 65535


class PortInUseError(TandemError):
    """A port a server needs is taken (or cannot be bound); the message names the flag to change."""


class HostError(TandemError):
    """A host a server should bind is unknown or not an address of this machine; the message
    names the host's flag."""


def port_number(text: str) -> int:
    """argparse ``type=`` for a TCP port a server binds: 1-65535."""
    return _port(text, minimum=1)


def port_number_or_zero(text: str) -> int:
    """argparse ``type=`` for a TCP port where 0 means any free one: 0-65535."""
    return _port(text, minimum=0)


def _port(text: str, minimum: int) -> int:
    try:
        port = int(text)
    except ValueError:
        port = None
    if port is None or not minimum <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number ({minimum}-{MAX_PORT})")
    return port


def check_port_free(host: str, port: int, flag: str, host_flag: str = "--host") -> None:
    """Raise ``PortInUseError`` unless ``host:port`` can be bound right now, or ``HostError`` when
    ``host`` is the problem (port 0, any free port, checks the host alone).

    The probe binds as our servers do — SO_REUSEADDR (a closed socket's TIME_WAIT is no conflict)
    but never SO_REUSEPORT, so a server already listening there, gRPC's included, is found.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except (OSError, OverflowError) as error:  # OverflowError: a port beyond 65535
            raise port_error(host, port, flag, error, host_flag) from None


def port_error(host: str, port: int, flag: str, error: OSError | OverflowError | None = None,
               host_flag: str = "--host") -> TandemError:
    """The one-line error for an address that could not be bound, naming the flag to change."""
    if isinstance(error, socket.gaierror):
        return HostError(f"Cannot serve on {host_flag} {host}: {error.strerror or error}; give an address "
                         "(or name) of this machine, e.g. 127.0.0.1 or 0.0.0.0.")
    if isinstance(error, OSError) and error.errno == errno.EADDRNOTAVAIL:
        return HostError(f"Cannot serve on {host_flag} {host}: it is not an address of this machine; "
                         "give one that is, e.g. 127.0.0.1 or 0.0.0.0.")
    if isinstance(error, OverflowError) or not 0 <= port <= MAX_PORT:
        return PortInUseError(f"{flag} {port} is not a port number (1-{MAX_PORT}).")
    if error is None or error.errno == errno.EADDRINUSE:
        return PortInUseError(f"Port {port} on {host} is already in use; choose another with {flag}.")
    return PortInUseError(f"Cannot bind {host}:{port} ({error.strerror}); choose another with {flag}.")
