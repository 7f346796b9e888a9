"""gRPC's own log lines, told truthfully: a call whose caller left first is not a server error.

When a handler ends, gRPC sends the call's status in one last batch. If the client cancelled the
call, passed its deadline or dropped the connection just before, that batch fails and gRPC's
asyncio server logs ``ExecuteBatchError raised in core by servicer method [...]`` at ERROR with a
traceback. The frontend cancels calls routinely (a client that hung up, a stop string), so a busy
backend logs that now and then (once in a 76,000-request soak) although nothing was lost: there was
no one left to receive the status. ``install()`` turns exactly those records (a failed batch that
carried the status) into one INFO line; every other gRPC error stays as gRPC logged it.
"""

from __future__ import annotations

import logging
import re

from grpc._cython import cygrpc

GRPC_CORE_LOGGER = "grpc._cython.cygrpc"
_STATUS_OPERATION = "SendStatusFromServerOperation"
_METHOD = re.compile(r"\[(.*)\]")


class CallerGoneFilter(logging.Filter):
    """Rewrites a failed status batch's ERROR record as INFO, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, cygrpc.ExecuteBatchError) and _STATUS_OPERATION in str(error):
            method = _METHOD.search(record.getMessage())
            record.msg = ("Call %s had already ended in gRPC (its caller cancelled, its deadline passed "
                          "or its connection closed) when its status was sent: no one was left to tell.")
            record.args = (method.group(1) if method else "a call",)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


def install() -> None:
    """Add the filter to gRPC's core logger (once, however often called)."""
    logger = logging.getLogger(GRPC_CORE_LOGGER)
    if not any(isinstance(f, CallerGoneFilter) for f in logger.filters):
        logger.addFilter(CallerGoneFilter())
