"""The worker process of the ``mp`` executor: ``python -m backend.executor.mp_worker FD PARENT_PID``.

It talks to the engine over one socket (a ``multiprocessing`` Connection on FD): the first
message sets it up, then each message is ``(method, args)``. Every call but ``execute_model`` is
answered ``("ok", result)``; ``execute_model`` is answered only by the output rank, the others
reply only to report an error. On an error it answers ``("error", traceback)`` and exits.

It never outlives the engine: SIGINT is left to the engine (which shuts the workers down), a
closed socket ends it, and a watchdog thread exits when the engine process is gone, even while
the main thread waits inside a collective.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from backend.types.child_process import exit_when_orphaned

def serve(conn: Connection) -> int:
    from backend.distributed import get_parallel_state
    from backend.types.startup_heap import tune_gc_for_serving
    from backend.executor.step_delta import StepDecoder
    from backend.worker.worker import Worker

    config, rank, local_rank, init_method, num_threads = conn.recv()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s worker {rank}: %(name)s: %(message)s")
    try:
        worker = Worker(config, rank, local_rank, init_method, num_threads)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return 1
    tune_gc_for_serving()
    conn.send(("ok", os.getpid()))
    is_output_rank = get_parallel_state().is_output_rank
    decoder = StepDecoder()
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the engine closed the socket (or died)
            return 0
        if method == "shutdown":
            worker.shutdown()
            return 0
        try:
            if method == "execute_model":
                output = worker.execute_model(decoder.decode(*args))
                if is_output_rank:
                    conn.send(("ok", output))
            else:
                conn.send(("ok", getattr(worker, method)(*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
            return 1


def main() -> int:
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    exit_when_orphaned(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        return serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
