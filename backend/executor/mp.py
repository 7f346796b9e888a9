"""The ``mp`` executor: one worker process per device on this machine.

Each worker is ``python -m backend.executor.mp_worker`` (a fresh interpreter: nothing of the
engine's threads or state is inherited, and no ``__main__`` guard is needed in user scripts),
joined to the engine by a socket pair. Per step the engine pickles one ``StepMessage`` (a delta,
see step_delta.py) and writes the same bytes to every worker; the output rank answers with the
sampled tokens. Ranks meet for torch.distributed through a file store in a private temp dir.

One reader thread receives everything the workers send. A worker's death closes its socket, so
the reader notices it at once, whether a step is running or not: the executor then fails (the
engine's listeners hear of it), kills the other workers, and every call raises WorkerDiedError.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import weakref
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from backend.distributed import output_rank
from backend.executor.base import Executor
from backend.executor.step_delta import StepEncoder
from backend.messages.runner_output import ModelRunnerOutput
from backend.messages.scheduler_output import SchedulerOutput
from backend.models.resolve import config_for_workers
from backend.types.child_process import FD, start_child
from backend.types.config import EngineConfig
from backend.types.errors import WorkerDiedError
from backend.worker.worker import cpu_share

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # a worker gets this long to exit after "shutdown" before it is killed
_SOURCE_ROOT = str(Path(__file__).resolve().parents[2])  # holds backend/ (for PYTHONPATH)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is unresponsive"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class WorkerProcesses:
    """The worker processes and their sockets; ``stop`` ends them all (idempotent, any thread)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.store_dir = tempfile.mkdtemp(prefix="tandem-dist-")
        self.stopping = False
        self._lock = threading.Lock()

    def start(self, env: dict[str, str]) -> None:
        proc, conn = start_child(["-m", "backend.executor.mp_worker", FD, str(os.getpid())], env)
        self.procs.append(proc)
        self.conns.append(conn)

    def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        self.stopping = True
        with self._lock:
            for conn in self.conns:
                if grace_s > 0:
                    try:
                        conn.send(("shutdown", ()))
                    except OSError:
                        pass
            for proc in self.procs:
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    pass
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                grace_s = 0.0  # one grace period for all
            for conn in self.conns:
                conn.close()
            self.conns = []
            shutil.rmtree(self.store_dir, ignore_errors=True)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.world_size = config.world_size
        self.output_rank = output_rank(config.tensor_parallel_size, config.pipeline_parallel_size)
        self.encoder = StepEncoder()
        self.last_message_bytes = 0  # size of the last step's message (what every worker receives)
        self._replies: queue.Queue = queue.Queue()
        self._workers = WorkerProcesses()
        # Also on interpreter exit (an LLM never shut down, Ctrl-C): no worker outlives us.
        self._finalizer = weakref.finalize(self, self._workers.stop, 0.0)
        try:
            self._start_workers()
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_SOURCE_ROOT, env.get("PYTHONPATH")) if p)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: ranks talk over loopback
        init_method = None
        if self.world_size > 1:
            init_method = "file://" + os.path.join(self._workers.store_dir, "store")
        for rank in range(self.world_size):
            self._workers.start(env)
        self._pids = [proc.pid for proc in self._workers.procs]
        threading.Thread(target=self._read_replies, name="tandem-mp-reader", daemon=True).start()
        worker_config = config_for_workers(self.config)
        for rank, conn in enumerate(self._workers.conns):
            setup = (worker_config, rank, rank, init_method, cpu_share(self.world_size))
            self._send(conn, rank, pickle.dumps(setup))
        self._gather(range(self.world_size))  # each worker is set up (and joined the world)
        logger.info("mp executor: %d worker processes (pids %s)", self.world_size, self._pids)

    # ---- talking to the workers -----------------------------------------------------------

    def _read_replies(self) -> None:
        """The reader thread: every reply goes to ``_replies``; a closed socket is a death."""
        conns = dict(zip(self._workers.conns, range(self.world_size)))
        while conns and not self._workers.stopping:
            try:
                ready = wait(list(conns), timeout=1.0)
            except (OSError, ValueError):  # closed under us by stop()
                return
            for conn in ready:
                rank = conns[conn]
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    del conns[conn]
                    if not self._workers.stopping:
                        self._report_death(rank)
                    continue
                if kind == "error":
                    self._replies.put((rank, kind, self._fail(f"Worker rank {rank} failed:\n{value}")))
                    self._stop_workers_soon()
                else:
                    self._replies.put((rank, kind, value))

    def _report_death(self, rank: int) -> WorkerDiedError:
        proc = self._workers.procs[rank]
        try:
            code = proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            code = None
        error = self._fail(f"Worker rank {rank} (pid {proc.pid}) {describe_exit(code)}; the engine "
                           "cannot continue.")
        self._replies.put((rank, "error", error))
        self._stop_workers_soon()
        return error

    def _stop_workers_soon(self) -> None:
        # The other workers would wait forever on a collective with the dead one.
        threading.Thread(target=self._workers.stop, args=(0.0,), daemon=True).start()

    def _send(self, conn: Connection, rank: int, payload: bytes) -> None:
        try:
            conn.send_bytes(payload)
        except OSError:  # its socket is closed: it died
            raise self._report_death(rank) from None

    def _broadcast(self, method: str, *args: Any) -> None:
        self._check_alive()
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        self.last_message_bytes = len(payload)
        for rank, conn in enumerate(self._workers.conns):
            self._send(conn, rank, payload)

    def _gather(self, ranks) -> list[Any]:
        """The replies of ``ranks``, in that order; raises the executor's failure instead."""
        wanted, got = set(ranks), {}
        while wanted - got.keys():
            rank, kind, value = self._replies.get()
            if kind == "error":
                raise value
            got[rank] = value
        return [got[rank] for rank in ranks]

    # ---- the executor interface -------------------------------------------------------------

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self._broadcast(method, *args)
        return self._gather(range(self.world_size))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._broadcast("execute_model", self.encoder.encode(sched))
        return self._gather([self.output_rank])[0]

    @property
    def worker_pids(self) -> list[int]:
        return list(self._pids)

    def shutdown(self) -> None:
        self._finalizer.detach()
        self._workers.stop(0.0 if self.failure is not None else SHUTDOWN_GRACE_S)
