"""Small helpers shared by the tests that run servers as processes (import as ``helpers``)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from typing import Optional


def free_port() -> int:
    """A port the OS just gave out on 127.0.0.1 (free unless someone takes it meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str) -> Optional[int]:
    """The status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None
