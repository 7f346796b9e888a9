"""Rendering a chat template: the one function, and the worker process that runs it for requests.

``render_job`` turns a ``ChatRenderJob`` (everything a template sees, already
checked by ``frontend.tokenizer.prepare_chat``) into the prompt text with
transformers' own Jinja environment, the one ``apply_chat_template`` uses, so a
template renders the same wherever it runs.

The model's own template is rendered in the frontend process. A template sent
in a request is code from a stranger: ``serve_renders`` runs it in a worker
process started by ``frontend.template_sandbox``, which

- caps its address space (``RLIMIT_AS``): a string-multiplication bomb ends
  in ``MemoryError`` here, and the worker exits so a fresh one replaces it;
- caps its CPU time per render (``RLIMIT_CPU``): a backstop that holds even if
  the frontend is gone (the frontend kills a worker that overruns its wall-time
  bound first);
- refuses an output over ``max_output_bytes``, so it never reaches the frontend;
- runs at a lower priority than the frontend, so a template that spins takes
  CPU from nobody else.

The worker imports only the standard library, transformers' chat-template
utilities and this package's ``__init__`` (no tokenizer, no web framework).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Optional

# How much nicer than the frontend a worker runs (a higher niceness is a smaller CPU share).
WORKER_NICENESS = 10
# Characters of an error's text sent back to the client (an error may quote the whole rendering).
MAX_ERROR_CHARS = 500
# A worker whose resident memory grew by more than this since it started (a template compiled with a
# huge constant stays in transformers' compile cache; a heap may stay fragmented) retires after its
# answer, and a fresh one takes its place: what one template took never stays taken.
RETIRE_GROWTH_BYTES = 64 * 1024 * 1024

# What a worker answers: (status, payload, retiring), retiring True when it exits after this answer.
OK = "ok"  # payload: the rendered text
TEMPLATE_ERROR = "template_error"  # payload: the template's error, as text
OUTPUT_TOO_LARGE = "output_too_large"  # payload: the output's size in bytes
INVALID_OUTPUT = "invalid_output"  # payload: the index of the first character UTF-8 cannot encode
OUT_OF_MEMORY = "out_of_memory"  # payload: None (always retiring)
READY = "ready"  # sent once at start, as (READY, pid)


@dataclass
class ChatRenderJob:
    """Everything one rendering needs; picklable (plain data) so it can go to a worker."""

    template: str
    conversation: list[dict]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[dict]] = None
    # The tokenizer's special tokens (bos_token, ...) and the request's chat_template_kwargs.
    template_kwargs: dict[str, Any] = field(default_factory=dict)


class TemplateRenderError(ValueError):
    """The template raised, or could not be compiled (its message is the template's)."""


def render_job(job: ChatRenderJob) -> str:
    """The prompt text ``job`` renders to (as ``apply_chat_template(..., tokenize=False)``).

    Raises ``TemplateRenderError`` for an error the template raises or a
    template that does not compile.
    """
    import jinja2  # imported here, so a worker lowers its priority before it pays for these imports
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template(
            conversations=[job.conversation], tools=job.tools, chat_template=job.template,
            add_generation_prompt=job.add_generation_prompt, continue_final_message=job.continue_final_message,
            **job.template_kwargs)
    except MemoryError:
        raise
    except (jinja2.TemplateError, ValueError, TypeError) as error:
        raise TemplateRenderError(str(error)[:MAX_ERROR_CHARS]) from error
    except Exception as error:  # noqa: BLE001 -- whatever a template's expression raises (1/0, recursion)
        raise TemplateRenderError(f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS]) from error
    return rendered[0]


def serve_renders(conn: Connection, max_memory_bytes: int, max_output_bytes: int) -> None:
    """A worker's life: cap itself, say ready, then answer ``(job, timeout_s)`` messages with
    ``(status, payload, retiring)`` until the frontend closes the connection, or until it retires
    (out of memory, or grown by more than ``RETIRE_GROWTH_BYTES``)."""
    os.nice(WORKER_NICENESS)
    import transformers.utils.chat_template_utils  # noqa: F401 -- loaded before the cap and before "ready"

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space_bytes() + max_memory_bytes
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    baseline_rss = _resident_bytes()
    try:
        conn.send((READY, os.getpid()))
    except OSError:
        return  # the frontend stopped while this worker started
    while True:
        try:
            job, timeout_s = conn.recv()
        except (EOFError, OSError):
            return  # the frontend is gone
        except MemoryError:  # the job alone is larger than the cap
            _send_quietly(conn, (OUT_OF_MEMORY, None, True))
            return
        _cap_cpu_seconds(timeout_s)
        try:
            status, payload = _render_checked(job, max_output_bytes)
            del job
            retiring = _resident_bytes() > baseline_rss + RETIRE_GROWTH_BYTES
            conn.send((status, payload, retiring))
        except MemoryError:
            _send_quietly(conn, (OUT_OF_MEMORY, None, True))
            return  # a heap that ran out may stay fragmented: the frontend starts a fresh worker
        except OSError:
            return  # the frontend is gone (or killed this worker's peer end)
        if retiring:
            return


def _render_checked(job: ChatRenderJob, max_output_bytes: int) -> tuple[str, Any]:
    try:
        text = render_job(job)
    except TemplateRenderError as error:
        return TEMPLATE_ERROR, str(error)
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as error:  # e.g. a "\ud800" escape in a template literal
        return INVALID_OUTPUT, error.start
    if size > max_output_bytes:
        return OUTPUT_TOO_LARGE, size
    return OK, text


def _cap_cpu_seconds(timeout_s: float) -> None:
    """CPU seconds this render may use: what is used so far plus the wall-time bound (and a
    margin). The parent's kill comes first; this holds even if the parent is gone."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + timeout_s) + 2
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _send_quietly(conn, message: tuple) -> None:
    try:
        conn.send(message)
    except (OSError, MemoryError):
        pass


def main(argv: Optional[list[str]] = None) -> int:
    """A worker's entry point (``frontend.template_sandbox`` runs it with ``--fd N ...``): serve
    renders on the inherited connected socket N."""
    parser = argparse.ArgumentParser(description="a chat template worker (started by frontend.template_sandbox)")
    parser.add_argument("--fd", type=int, required=True, help="the connected socket to the frontend")
    parser.add_argument("--max-memory-bytes", type=int, required=True)
    parser.add_argument("--max-output-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    conn = Connection(socket.socket(fileno=args.fd).detach())
    serve_renders(conn, args.max_memory_bytes, args.max_output_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
