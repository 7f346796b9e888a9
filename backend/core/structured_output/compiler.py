"""Compiling structured-output grammars: cached, bounded in time and in parallelism, stoppable.

xgrammar cannot be interrupted, and a short spec can keep it busy for long: a JSON Schema of
objects nested 300 deep spends seconds being turned into EBNF (about cubic in the depth), and a
large repetition count spends seconds precomputing token masks over a large vocabulary. A
thread can be neither stopped nor timed out, so every new spec is compiled first in a worker
process (``backend.grammar_worker``), which is killed when it overruns ``timeout_s``.

A compile's life:

1. A spec compiled before (equal ``cache_key``) is answered at once on the caller's thread,
   never queued behind other compiles; equal specs asked for together share one compile. A spec
   that failed (invalid, or too slow) is remembered as well, so sending a slow one again costs
   nothing.
2. Otherwise a thread of the pool (``tandem-grammar-*``) takes an idle worker (workers start on
   demand, at most ``num_workers``; with two or more, one slow spec never holds up another),
   sends it the spec and waits at most ``timeout_s``. Past that the worker is killed and
   replaced, and the request gets ``InvalidRequestError`` (gRPC INVALID_ARGUMENT, HTTP 400)
   naming ``structured_outputs`` and the timeout. The clock starts when a worker takes the
   spec: a worker's own start (about 2-5 s: xgrammar imports torch) is not the spec's doing.
3. The worker answers with the grammar's EBNF, which it has just compiled within the bound; this
   process compiles that EBNF again into the ``CompiledGrammar`` the engine's matchers use. Why
   not send the compiled grammar: serializing it costs more than compiling it (a 200-property
   schema, 49k vocabulary: 0.3 s to compile, 10 s and 83 MB to serialize, 6 s to load). The
   repeat is the step the worker just finished in time, so it is bounded too, and the
   schema-to-EBNF conversion, where deep schemas spend their time, is never repeated.

Nothing here runs on the engine thread: ``compile_async`` awaits the pool, and ``compile`` (for
direct ``LLMEngine.add_request`` callers) blocks its caller on the same pool, with the same bound.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from backend.core.structured_output import compile_worker as W
from backend.types.child_process import FD, start_child
from backend.types.errors import EngineDeadError, InvalidRequestError, OverloadedError, RequestFailedError
from backend.types.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept (LRU), by their in-memory size.
GRAMMAR_CACHE_BYTES = 256 * 1024 * 1024
# Specs that failed to compile, remembered (LRU) so a repeat is refused at once.
MAX_REMEMBERED_FAILURES = 1024
# Seconds a worker may take to start (it imports xgrammar, hence torch).
WORKER_START_TIMEOUT_S = 60.0
_PARAM = "structured_outputs"
_SOURCE_ROOT = str(Path(__file__).resolve().parents[3])  # holds backend/ (for the worker's PYTHONPATH)


class _Timeout(Exception):
    pass


class _WorkerDied(Exception):
    pass


class _WorkerProcess:
    """One ``backend.grammar_worker`` process and its socket."""

    def __init__(self, tokenizer_info_path: str, json_max_whitespace: int) -> None:
        self.process, self.conn = start_child(
            ["-m", "backend.core.structured_output.compile_worker", FD, str(os.getpid()), tokenizer_info_path,
             str(json_max_whitespace)],
            source_root=_SOURCE_ROOT)

    def wait_ready(self, timeout_s: float) -> None:
        """Return once the worker is set up; RuntimeError (the worker killed) if it is not in time."""
        try:
            if not self.conn.poll(timeout_s):
                raise RuntimeError(f"it did not start within {timeout_s:g} s")
            status, payload = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise RuntimeError(f"it {self.describe_exit()} while starting") from None
        except RuntimeError:
            self.kill()
            raise
        if status != W.READY:
            self.kill()
            raise RuntimeError(f"it failed to start:\n{payload}")

    def compile(self, spec: StructuredOutputsParams, timeout_s: float) -> tuple[str, str]:
        """The worker's answer, ``(status, payload)``; ``_Timeout`` or ``_WorkerDied`` otherwise."""
        try:
            self.conn.send(spec)
            if not self.conn.poll(timeout_s):
                raise _Timeout()
            return self.conn.recv()
        except (EOFError, OSError):
            raise _WorkerDied(self.describe_exit()) from None

    def alive(self) -> bool:
        return self.process.poll() is None

    def describe_exit(self) -> str:
        try:
            code = self.process.wait(1.0)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()


class _StartFailed:
    """Put in the idle queue in place of a worker that could not start: its taker reports it."""


_CLOSED = object()  # put in the idle queue at shutdown: wakes every thread waiting for a worker


@dataclass
class _InFlight:
    """A compile under way and how many callers wait for it; ``abandoned``: none do any more."""

    future: Optional[Future] = None
    waiters: int = 0
    abandoned: bool = False


def _cache_key(spec: StructuredOutputsParams) -> str:
    """A short key for equal specs (a spec may be 64 KiB; the caches keep only this)."""
    return hashlib.sha256(repr(spec.cache_key()).encode("utf-8", "surrogatepass")).hexdigest()


def _stop_workers(workers: set, state: dict) -> None:
    """Kill every worker and remove the vocabulary file (shutdown, or interpreter exit)."""
    for worker in list(workers):
        worker.kill()
    workers.clear()
    if state.get("dir"):
        shutil.rmtree(state.pop("dir"), ignore_errors=True)


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` into ``xgrammar.CompiledGrammar`` for one tokenizer.

    Thread-safe. ``timeout_s`` bounds each compile, ``num_workers`` how many run at once;
    ``json_max_whitespace`` bounds the whitespace between JSON tokens of JSON grammars (0: none). The
    tokenizer's vocabulary is read on the first compile (about a second for 49k tokens), not at
    engine start; workers start when compiles need them.
    """

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int],
                 timeout_s: float, num_workers: int, json_max_whitespace: int = 0) -> None:
        if not 0 < timeout_s < float("inf"):
            raise InvalidRequestError(f"grammar_compile_timeout_s must be positive and finite; got {timeout_s}.",
                                      param="grammar_compile_timeout_s")
        if num_workers < 1:
            raise InvalidRequestError(f"grammar_compile_workers must be at least 1; got {num_workers}.",
                                      param="grammar_compile_workers")
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the model's (logits' width), which may exceed the tokenizer's
        self.stop_token_ids = list(stop_token_ids)
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.json_max_whitespace = json_max_whitespace  # the same for every spec: not in the cache key
        self.num_worker_compiles = 0  # specs sent to a worker (each a cache miss)
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # key -> CompiledGrammar, LRU
        self._compiled_bytes = 0
        self._failed: OrderedDict[str, str] = OrderedDict()  # key -> the error's message, LRU
        self._in_flight: dict[str, _InFlight] = {}
        # Threads wait on workers (and compile the EBNF a worker sent); more threads than workers so
        # that a thread compiling an EBNF never keeps a worker idle.
        self._num_threads = 4 * num_workers
        self._threads = ThreadPoolExecutor(max_workers=self._num_threads, thread_name_prefix="tandem-grammar")
        self._idle: queue.Queue = queue.Queue()  # ready workers (or _StartFailed, _CLOSED)
        self._workers: set[_WorkerProcess] = set()
        self._starting = 0
        self._closed = False
        self._setup_lock = threading.Lock()
        self._xgrammar_compiler = None
        self._state: dict[str, str] = {}  # "dir": the vocabulary file's directory
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers, self._state)

    # ---- the two ways in -----------------------------------------------------------------

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar, blocking the caller. ``InvalidRequestError`` (param
        ``structured_outputs``) if the spec does not compile or overruns ``timeout_s``;
        ``OverloadedError`` if no worker frees up in time."""
        key, hit, flight = self._begin(spec)
        return hit if flight is None else flight.future.result()

    async def compile_async(self, spec: StructuredOutputsParams) -> Any:
        """``compile`` for the event loop, which keeps running meanwhile. Cancelling it (the client
        went away) drops the compile if it has not started and nobody else waits for it."""
        key, hit, flight = self._begin(spec)
        if flight is None:
            return hit
        try:
            return await asyncio.shield(asyncio.wrap_future(flight.future))
        except asyncio.CancelledError:
            with self._lock:
                flight.waiters -= 1
                if flight.waiters == 0:  # a worker it has not reached yet goes to other specs
                    flight.abandoned = True
                    flight.future.cancel()
                    if self._in_flight.get(key) is flight:
                        del self._in_flight[key]
            raise

    def start(self, wait: bool = False) -> None:
        """Read the vocabulary and start every worker now rather than on demand; ``wait``: until
        they are ready (so a first compile's time is its own)."""
        self._setup()
        with self._lock:
            missing = self.num_workers - len(self._workers) - self._starting
            self._starting += max(missing, 0)
        starters = [threading.Thread(target=self._start_worker, name="tandem-grammar-start", daemon=True)
                    for _ in range(max(missing, 0))]
        for thread in starters:
            thread.start()
        if wait:
            for thread in starters:
                thread.join()

    def shutdown(self) -> None:
        """Kill the workers; compiles in progress or queued end with ``EngineDeadError``."""
        with self._lock:
            self._closed = True
        for _ in range(self._num_threads):
            self._idle.put(_CLOSED)
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._finalizer()

    # ---- bookkeeping ---------------------------------------------------------------------

    def _begin(self, spec: StructuredOutputsParams) -> tuple[str, Any, Optional[_InFlight]]:
        """(key, the cached grammar, None), or (key, None, the compile to wait for). Raises the
        remembered error of a spec that failed before."""
        key = _cache_key(spec)
        with self._lock:
            if self._closed:
                raise EngineDeadError("The engine is shut down: grammars are no longer compiled.")
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return key, compiled, None
            message = self._failed.get(key)
            if message is not None:
                self._failed.move_to_end(key)
                raise InvalidRequestError(message, param=_PARAM)
            flight = self._in_flight.get(key)
            if flight is None:
                flight = self._in_flight[key] = _InFlight()
                flight.future = self._threads.submit(self._compile_new, spec, key, flight, time.monotonic())
            flight.waiters += 1
            return key, None, flight

    def _compile_new(self, spec: StructuredOutputsParams, key: str, flight: _InFlight, submitted: float) -> Any:
        """On a pool thread: compile, then remember the grammar (or the spec's error) under ``key``."""
        try:
            compiled = self._compile_bounded(spec, flight, submitted)
        except InvalidRequestError as error:
            with self._lock:
                self._end_flight(key, flight)
                self._failed[key] = error.message
                if len(self._failed) > MAX_REMEMBERED_FAILURES:
                    self._failed.popitem(last=False)
            raise
        except BaseException:
            with self._lock:
                self._end_flight(key, flight)
            raise
        with self._lock:
            self._end_flight(key, flight)
            self._compiled[key] = compiled
            self._compiled_bytes += compiled.memory_size_bytes
            while self._compiled_bytes > GRAMMAR_CACHE_BYTES and len(self._compiled) > 1:
                self._compiled_bytes -= self._compiled.popitem(last=False)[1].memory_size_bytes
        return compiled

    def _end_flight(self, key: str, flight: _InFlight) -> None:
        if self._in_flight.get(key) is flight:  # (an abandoned one may have a successor already)
            del self._in_flight[key]

    # ---- one compile, on a pool thread --------------------------------------------------

    def _compile_bounded(self, spec: StructuredOutputsParams, flight: _InFlight, submitted: float) -> Any:
        compiler = self._setup()
        worker = self._take_worker(submitted + self.timeout_s + WORKER_START_TIMEOUT_S)
        if flight.abandoned:  # its callers went away while it waited for a worker
            self._idle.put(worker)
            raise CancelledError()
        keep = False
        try:
            with self._lock:
                self.num_worker_compiles += 1
            status, payload = worker.compile(spec, self.timeout_s)
            keep = True
        except _Timeout:
            raise InvalidRequestError(
                f"Invalid structured_outputs.{spec.kind}: its grammar took longer than {self.timeout_s:g} s "
                "to compile (the server's --grammar-compile-timeout-s) and was stopped; simplify it "
                "(less nesting, smaller repetition counts).", param=_PARAM) from None
        except _WorkerDied as died:
            if self._closed:
                raise EngineDeadError("The engine shut down while the grammar compiled.") from None
            raise InvalidRequestError(f"Invalid structured_outputs.{spec.kind}: the grammar compiler {died} "
                                      "while compiling it.", param=_PARAM) from None
        finally:
            if keep:
                self._idle.put(worker)
            else:
                self._retire(worker)
        if status != W.OK:
            raise InvalidRequestError(f"Invalid structured_outputs.{spec.kind}: {payload}", param=_PARAM)
        try:
            return compiler.compile_grammar(payload)  # the worker compiled this very EBNF in time
        except (RuntimeError, ValueError, TypeError) as error:
            raise InvalidRequestError(f"Invalid structured_outputs.{spec.kind}: {W.xgrammar_message(error)}",
                                      param=_PARAM) from None

    def _setup(self):
        """This process's xgrammar compiler, and the vocabulary file workers read (made once)."""
        with self._setup_lock:
            if self._xgrammar_compiler is None:
                import xgrammar
                from transformers import PreTrainedTokenizerFast

                tokenizer = PreTrainedTokenizerFast.from_pretrained(self.tokenizer_path, local_files_only=True)
                info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None)
                directory = tempfile.mkdtemp(prefix="tandem-grammar-")
                self._state["dir"] = directory
                with open(os.path.join(directory, "tokenizer_info.json"), "w", encoding="utf-8") as f:
                    f.write(info.serialize_json())
                self._xgrammar_compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._xgrammar_compiler

    def _take_worker(self, deadline: float) -> _WorkerProcess:
        while True:
            with self._lock:
                if self._closed:
                    raise EngineDeadError("The engine is shut down: grammars are no longer compiled.")
                grow = self._idle.empty() and len(self._workers) + self._starting < self.num_workers
                if grow:
                    self._starting += 1
            if grow:
                threading.Thread(target=self._start_worker, name="tandem-grammar-start", daemon=True).start()
            try:
                worker = self._idle.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise OverloadedError(
                    f"All {self.num_workers} grammar compilers stayed busy (the server's "
                    "--grammar-compile-workers); retry later.") from None
            if worker is _CLOSED:
                self._idle.put(_CLOSED)  # for the next waiter
                raise EngineDeadError("The engine is shut down: grammars are no longer compiled.")
            if isinstance(worker, _StartFailed):  # the details are in the server's log
                raise RequestFailedError("A grammar compiler process could not start; see the server's log.")
            if worker.alive():
                return worker
            self._retire(worker)  # died while idle (the kernel's OOM killer, say): replaced

    def _start_worker(self) -> None:
        """On a thread of its own (``_starting`` counts it already): start one worker, queue it when ready."""
        try:
            worker = _WorkerProcess(os.path.join(self._state["dir"], "tokenizer_info.json"), self.json_max_whitespace)
            worker.wait_ready(WORKER_START_TIMEOUT_S)
        except Exception:  # noqa: BLE001 -- the compile that takes its place reports it
            logger.exception("A grammar compiler process could not start")
            with self._lock:
                self._starting -= 1
            self._idle.put(_StartFailed())
            return
        with self._lock:
            self._starting -= 1
            closed = self._closed
            if not closed:
                self._workers.add(worker)
        if closed:
            worker.kill()
        else:
            self._idle.put(worker)

    def _retire(self, worker: _WorkerProcess) -> None:
        """Kill a worker (it overran its bound, or died) and start its replacement at once."""
        worker.kill()
        with self._lock:
            self._workers.discard(worker)
            replace = not self._closed
            if replace:
                self._starting += 1
        if replace:
            threading.Thread(target=self._start_worker, name="tandem-grammar-start", daemon=True).start()
