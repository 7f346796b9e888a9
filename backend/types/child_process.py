"""Worker processes: a fresh Python interpreter that talks to its parent over one end of a socket
pair (a ``multiprocessing`` ``Connection``), started by ``start_child``, and that exits when its
parent does (``exit_when_orphaned``). Used by the mp executor's workers, the grammar compiler's
workers and the frontend's chat-template workers. Pure Python, no torch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Optional

FD = "{fd}"  # in ``args``: replaced by the child's socket's file descriptor number


def start_child(args: list[str], env: Optional[dict[str, str]] = None,
                source_root: Optional[str] = None) -> tuple[subprocess.Popen, Connection]:
    """Run ``python *args`` (``FD`` in them names the child's end of the socket, which it
    inherits, and nothing else); ``source_root`` goes first on its PYTHONPATH. Returns the process
    and the parent's end of the socket."""
    parent_sock, child_sock = socket.socketpair()
    env = dict(os.environ if env is None else env)
    if source_root is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    try:
        process = subprocess.Popen([sys.executable, *(str(child_sock.fileno()) if a == FD else a for a in args)],
                                   pass_fds=[child_sock.fileno()], env=env, stdin=subprocess.DEVNULL)
    except BaseException:
        parent_sock.close()
        raise
    finally:
        child_sock.close()
    return process, Connection(parent_sock.detach())


def exit_when_orphaned(parent_pid: int, poll_s: float = 0.5) -> None:
    """In a child: exit at once when the parent process is gone (it reparents us), even while the
    main thread is busy (a compile, a step): a thread polls, then ``os._exit(1)``."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
