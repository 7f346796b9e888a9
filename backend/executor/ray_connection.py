"""This process's Ray connection: who starts it, which thread holds it, and when it ends.

Ray binds the GCS and raylet that ``ray.init()`` starts to the *thread* that called it (Linux's
parent-death signal follows the thread, not the process): when that thread ends, they are killed,
and the driver aborts a minute later ("Failed to connect to GCS"). An engine's own thread is
therefore the wrong owner: it ends when the engine shuts down, before Ray can. So when Tandem
starts Ray, a dedicated thread calls ``ray.init()``, waits, and calls ``ray.shutdown()`` when the
last engine using that connection lets go; the thread lives exactly as long as the connection.

    connection already there (the user's ray.init)  ->  used as it is, never shut down by Tandem
    none                                            ->  Tandem connects (RAY_ADDRESS, a local
                                                        ``ray start``, else a new local cluster)
                                                        and disconnects after its last engine;
                                                        a cluster Tandem did not start stays up

Engines may come and go in any order and from any thread; a later engine starts a fresh connection
if the previous one has ended.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Optional

logger = logging.getLogger(__name__)

# ray.shutdown() waits for the processes it started (SIGTERM, then SIGKILL); this bounds the wait
# for the owner thread as a whole, so an engine's shutdown never hangs on Ray.
SHUTDOWN_TIMEOUT_S = 30.0

_lock = threading.Lock()  # serialises starting and ending the connection
_owner: Optional["_RayOwner"] = None  # the connection Tandem started, while it is up


class _RayOwner:
    """A thread that calls ``ray.init()``, then ``ray.shutdown()`` when told to; nothing else."""

    def __init__(self, ray: Any) -> None:
        self.ray = ray
        self.users = 0
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        # A daemon: at interpreter exit Ray's own atexit hook disconnects, from the main thread.
        self._thread = threading.Thread(target=self._run, name="tandem-ray-owner", daemon=True)

    def start(self) -> None:
        """Connect; raises what ``ray.init()`` raised."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("Ray did not shut down within %.0f s; its processes may linger", timeout)

    def _run(self) -> None:
        ray = self.ray
        try:
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
        except BaseException as error:  # handed to start(), on the engine's thread
            self._error = error
            self._shutdown()  # whatever ray.init started before it failed
            return
        finally:
            self._ready.set()
        self._stop.wait()
        self._shutdown()

    def _shutdown(self) -> None:
        try:
            # Returns once the raylet, GCS and the rest that ray.init started have exited
            # (connected to a cluster Tandem did not start, it only disconnects).
            self.ray.shutdown(wait_for_processes=True)
        except Exception:
            logger.exception("ray.shutdown() failed")


class RayConnection:
    """One engine's hold on the Ray connection; ``release()`` once when the engine is done."""

    def __init__(self, owner: Optional[_RayOwner]) -> None:
        self._owner = owner
        self._released = False

    @property
    def started_by_tandem(self) -> bool:
        return self._owner is not None

    def release(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Let go; the last engine to let go of a connection Tandem started ends it (and waits)."""
        global _owner
        if self._released:
            return
        self._released = True
        owner = self._owner
        if owner is None:
            return
        with _lock:
            owner.users -= 1
            if owner.users > 0:
                return
            if _owner is owner:
                _owner = None
            owner.stop(timeout)  # under the lock: a new connection waits until this one is gone


def connect_ray(ray: Any) -> RayConnection:
    """Hold this process's Ray connection, starting one (on a thread of its own) if there is none."""
    global _owner
    with _lock:
        if _owner is not None and not ray.is_initialized():
            # Someone called ray.shutdown() behind Tandem's back: that connection is over.
            stale, _owner = _owner, None
            stale.stop(SHUTDOWN_TIMEOUT_S)
        if _owner is None:
            if ray.is_initialized():
                return RayConnection(None)  # the user's connection: theirs to end
            owner = _RayOwner(ray)
            owner.start()
            _owner = owner
        _owner.users += 1
        return RayConnection(_owner)
