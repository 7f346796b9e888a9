"""A grammar compiler's worker process:
``python -m backend.core.structured_output.compile_worker FD PARENT_PID TOKENIZER_INFO JSON_MAX_WHITESPACE``.

For each structured-output spec it is sent it makes the grammar's EBNF (``grammar_ebnf``) and
compiles that with xgrammar, so the engine process learns, within its time bound, whether and
how a spec compiles before it compiles the same EBNF itself (``backend.core.structured_output.compiler``
says why it works this way). The engine kills this process when a compile overruns that bound:
xgrammar cannot be interrupted any other way.

Messages, over one socket (a ``multiprocessing`` Connection on FD): once set up it sends
``(READY, pid)`` (or ``(START_FAILED, traceback)`` and exits); then every
``StructuredOutputsParams`` it receives is answered ``(OK, ebnf)`` or ``(INVALID, message)``.
TOKENIZER_INFO is a file holding ``xgrammar.TokenizerInfo.serialize_json()``: the vocabulary
comes from the engine, so the worker never loads a tokenizer. JSON_MAX_WHITESPACE is the engine's
``json_max_whitespace`` (0: unbounded). A closed socket ends it, and so
does the engine's death (a watchdog thread), even in the middle of a compile.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from backend.types.child_process import exit_when_orphaned

READY = "ready"
START_FAILED = "start_failed"
OK = "ok"
INVALID = "invalid"

# xgrammar prefixes its messages with "[time] file.cc:line: "; users need only the rest.
_XGRAMMAR_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
# xgrammar's rule for the characters of a string with minLength/maxLength lets control
# characters through (a raw tab), which strict JSON parsers refuse; JSON strings exclude them.
_LENGTH_STRING_CHARS = ('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n]')


def grammar_ebnf(spec, json_max_whitespace: int = 0) -> str:
    """The EBNF (start rule ``root``) of the outputs a ``StructuredOutputsParams`` allows.

    JSON is xgrammar's strict mode, control characters kept out of strings, with at most
    ``json_max_whitespace`` whitespace characters between two JSON tokens (0: any number; a
    model left free to emit whitespace can loop on newlines until max_tokens). Raises xgrammar's
    RuntimeError/ValueError for a spec it cannot take.
    """
    import xgrammar

    if spec.json is not None or spec.json_object:
        ebnf = str(xgrammar.Grammar.from_json_schema(spec.json or '{"type": "object"}',
                                                     any_whitespace=not spec.disable_any_whitespace,
                                                     max_whitespace_cnt=json_max_whitespace or None,
                                                     strict_mode=True))
        return ebnf.replace(*_LENGTH_STRING_CHARS)
    if spec.regex is not None:
        return str(xgrammar.Grammar.from_regex(spec.regex))
    if spec.choice is not None:  # JSON string escapes are GBNF's too
        return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
    return str(xgrammar.Grammar.from_ebnf(spec.grammar))


def xgrammar_message(error: BaseException) -> str:
    """xgrammar's error text without its source location."""
    return _XGRAMMAR_LOCATION.sub("", str(error).strip())


def serve(conn: Connection, tokenizer_info_path: str, json_max_whitespace: int) -> int:
    try:
        import xgrammar

        with open(tokenizer_info_path, encoding="utf-8") as f:
            info = xgrammar.TokenizerInfo.deserialize_json(f.read())
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    except Exception:  # noqa: BLE001 -- reported to the engine, which logs it
        conn.send((START_FAILED, traceback.format_exc()))
        return 1
    conn.send((READY, os.getpid()))
    while True:
        try:
            spec = conn.recv()
        except EOFError:  # the engine closed the socket
            return 0
        try:
            ebnf = grammar_ebnf(spec, json_max_whitespace)
            compiler.compile_grammar(ebnf)  # what the engine will repeat: known now to finish
        except (RuntimeError, ValueError, TypeError) as error:
            conn.send((INVALID, xgrammar_message(error)))
            continue
        conn.send((OK, ebnf))


def main() -> int:
    fd, parent_pid, tokenizer_info_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    json_max_whitespace = int(sys.argv[4])
    exit_when_orphaned(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    conn = Connection(fd)
    try:
        return serve(conn, tokenizer_info_path, json_max_whitespace)
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
