"""Chat templates sent by clients, rendered in a small pool of worker processes with bounds that hold.

A template is code: Jinja's sandbox stops it from reaching Python's internals,
but bounds neither its time nor its memory (nested loops spin for minutes, a
string multiplication takes gigabytes), and a thread running it can be neither
cancelled nor capped. So a request's template renders in a worker process
(``frontend.template_worker``):

- time: the frontend waits ``timeout_s`` for the answer, then kills the worker
  and starts another (the worker also caps its own CPU time, should the frontend
  be gone);
- memory: the worker caps its address space (``RLIMIT_AS``); a render that runs
  out ends in ``MemoryError`` there, and the worker is replaced;
- output: a rendering over ``max_output_bytes`` is refused in the worker, so it
  never crosses to the frontend.

Any bound exceeded is a 400 naming ``chat_template`` (and the flag that sets
it). A worker that overran a bound, or that kept memory after a render
(``template_worker.RETIRE_GROWTH_BYTES``), is killed and a fresh one started in
its place (in the background), so the memory a bomb took goes back to the
system. At most ``MAX_RENDERS_PER_WORKER`` renders per worker may be in
progress or waiting; more are a 429 at once.
Each worker is an interpreter of its own (``python -c``), sharing nothing with
this process but a socket; the event loop only awaits a thread that waits on
the worker's answer.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import subprocess
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Optional

from backend.types.child_process import FD, start_child
from backend.types.errors import InvalidRequestError, OverloadedError
from frontend import template_worker as W

logger = logging.getLogger(__name__)

# Seconds a worker may take to start (it imports transformers' template code first).
WORKER_START_TIMEOUT_S = 60.0
# Renders in progress or waiting for a worker, per worker; more are refused at once (429).
MAX_RENDERS_PER_WORKER = 4
_PARAM = "chat_template"
# The directory holding the ``frontend`` package: a worker imports it from there, wherever it runs.
_PACKAGE_ROOT = str(Path(W.__file__).resolve().parents[1])
_WORKER_MAIN = "import sys; from frontend.template_worker import main; sys.exit(main(sys.argv[1:]))"


class _Worker:
    """One worker process and the frontend's end of its socket."""

    def __init__(self, process: subprocess.Popen, conn: Connection) -> None:
        self.process = process
        self.conn = conn

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            logger.warning("Chat template worker %d did not exit after SIGKILL", self.process.pid)
        self.conn.close()


class TemplateSandbox:
    """Renders ``ChatRenderJob``s in ``num_workers`` worker processes, each bounded as above.

    ``start()`` begins starting the workers in the background (``render`` also
    starts them); ``close()`` kills them. ``render`` may be awaited from any
    event loop. A render is refused with ``OverloadedError`` (429) when
    ``MAX_RENDERS_PER_WORKER`` per worker are already in progress or waiting, or
    when it waits longer than ``max_wait_s`` (a render's bound plus a worker's
    start) for a free worker.
    """

    def __init__(self, num_workers: int, timeout_s: float, max_output_bytes: int, max_memory_bytes: int) -> None:
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.max_output_bytes = max_output_bytes
        self.max_memory_bytes = max_memory_bytes
        # How long a render waits for a free worker: one render's bound plus a worker's start.
        self.max_wait_s = timeout_s + WORKER_START_TIMEOUT_S
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._num_renders = 0  # in progress or waiting for a worker
        # A thread per render admitted (it waits for a worker, then on the worker's answer), so none
        # waits in an executor's queue, unbounded; and one per worker for (re)starting workers.
        self._render_threads = ThreadPoolExecutor(max_workers=MAX_RENDERS_PER_WORKER * num_workers,
                                                  thread_name_prefix="tandem-template")
        self._start_threads = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="tandem-template-start")
        # A sandbox dropped without close() (its app went away) still stops its workers.
        self._finalizer = weakref.finalize(self, _stop, self._workers, (self._render_threads, self._start_threads))

    def start(self) -> None:
        """Start the workers in the background (once)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        for _ in range(self.num_workers):
            self._start_threads.submit(self._start_worker)

    async def render(self, job: W.ChatRenderJob) -> str:
        """The text ``job`` renders to; ``InvalidRequestError`` (param chat_template) when the template
        raises or exceeds a bound, ``OverloadedError`` when no worker frees up in time."""
        self.start()
        with self._lock:
            if self._num_renders >= MAX_RENDERS_PER_WORKER * self.num_workers:
                raise OverloadedError(
                    f"{self._num_renders} chat templates are rendering or waiting for one of the "
                    f"{self.num_workers} workers (the server's --chat-template-workers); retry later.")
            self._num_renders += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._render_threads, self._render_blocking, job)
        finally:
            with self._lock:
                self._num_renders -= 1

    def close(self) -> None:
        """Kill the workers (a render in progress gets a 400; a worker still starting is killed once it
        is up); later renders fail. Does not wait."""
        with self._lock:
            self._closed = True
        self._finalizer()

    # ---- on the pool's threads ----

    def _render_blocking(self, job: W.ChatRenderJob) -> str:
        worker = self._take_idle_worker()
        keep = False
        try:
            worker.conn.send((job, self.timeout_s))
            if not worker.conn.poll(self.timeout_s):
                raise InvalidRequestError(
                    f"The chat template took longer than {self.timeout_s} s to render (the server's "
                    "--chat-template-timeout-s); it was stopped.", param=_PARAM)
            status, payload, retiring = worker.conn.recv()
        except (EOFError, OSError):  # killed by its CPU cap or by the kernel
            raise InvalidRequestError(
                "The chat template's renderer was stopped: the template exceeded its CPU or memory bound.",
                param=_PARAM) from None
        else:
            keep = not retiring and status != W.OUT_OF_MEMORY
            return self._result(status, payload)
        finally:
            if keep:
                self._idle.put(worker)
            else:
                self._retire(worker)

    def _take_idle_worker(self) -> _Worker:
        deadline = time.monotonic() + self.max_wait_s
        while True:
            try:
                worker = self._idle.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise OverloadedError(
                    f"All {self.num_workers} chat template workers stayed busy (the server's "
                    "--chat-template-workers); retry later.") from None
            if worker.alive():
                return worker
            self._retire(worker)  # died while idle (the kernel's OOM killer): replace it, take another

    def _result(self, status: str, payload) -> str:
        if status == W.OK:
            return payload
        if status == W.TEMPLATE_ERROR:
            message = f"Could not render the chat template: {payload}"
        elif status == W.OUTPUT_TOO_LARGE:
            message = (f"The chat template rendered {payload} bytes, more than the server's limit of "
                       f"{self.max_output_bytes} (--max-chat-template-output-bytes).")
        elif status == W.OUT_OF_MEMORY:
            message = (f"The chat template needed more memory than the server allows a template "
                       f"({self.max_memory_bytes} bytes, --max-chat-template-memory-bytes).")
        elif status == W.INVALID_OUTPUT:
            message = (f"The chat template rendered text that is not valid Unicode (a lone UTF-16 surrogate at "
                       f"character {payload}).")
        else:
            message = f"The chat template's renderer answered {status!r}."
        raise InvalidRequestError(message, param=_PARAM)

    def _retire(self, worker: _Worker) -> None:
        """Kill a worker that overran a bound and start a fresh one in its place (in the background)."""
        with self._lock:
            self._workers.discard(worker)
            closed = self._closed
        worker.kill()
        if not closed:
            try:
                self._start_threads.submit(self._start_worker)
            except RuntimeError:  # closed meanwhile
                pass

    def _start_worker(self) -> None:
        try:
            worker = self._spawn()
        except Exception:  # noqa: BLE001 -- logged; renders wait for the workers that did start
            logger.exception("Could not start a chat template worker")
            return
        with self._lock:
            if self._closed:
                worker.kill()
                return
            self._workers.add(worker)
        self._idle.put(worker)

    def _spawn(self) -> _Worker:
        """A new worker process (its own interpreter: nothing of this process is inherited but a
        socket), once it says it is ready."""
        worker = _Worker(*start_child(
            ["-c", _WORKER_MAIN, "--fd", FD, "--max-memory-bytes", str(self.max_memory_bytes),
             "--max-output-bytes", str(self.max_output_bytes)], source_root=_PACKAGE_ROOT))
        if not worker.conn.poll(WORKER_START_TIMEOUT_S):
            worker.kill()
            raise RuntimeError(f"the worker did not start within {WORKER_START_TIMEOUT_S:.0f} s")
        status, _pid = worker.conn.recv()
        if status != W.READY:
            worker.kill()
            raise RuntimeError(f"the worker answered {status!r} at start")
        return worker


def _stop(workers: set[_Worker], pools: tuple[ThreadPoolExecutor, ...]) -> None:
    while workers:
        try:
            workers.pop().kill()
        except KeyError:  # emptied meanwhile
            break
    for pool in pools:
        pool.shutdown(wait=False, cancel_futures=True)


def sandbox_from_limits(limits) -> Optional[TemplateSandbox]:
    """The sandbox ``limits`` ask for: None (request templates refused) unless
    ``trust_request_chat_template``."""
    if not limits.trust_request_chat_template:
        return None
    return TemplateSandbox(limits.chat_template_workers, limits.chat_template_timeout_s,
                           limits.max_chat_template_output_bytes, limits.max_chat_template_memory_bytes)
