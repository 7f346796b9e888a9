"""gRPC's log of a status that found its call already ended is INFO, one line; other errors stay."""

from __future__ import annotations

import logging

import pytest
from grpc._cython import cygrpc

from backend.server import grpc_logs


@pytest.fixture(autouse=True)
def uninstalled_after():
    """Leave gRPC's logger as found, so the servers' tests check that starting one installs it."""
    logger = logging.getLogger(grpc_logs.GRPC_CORE_LOGGER)
    before = list(logger.filters)
    yield
    logger.filters[:] = before


def log_batch_error(operations: str) -> None:
    """Log as gRPC's asyncio server does when a servicer's batch fails in core."""
    try:
        raise cygrpc.ExecuteBatchError(f'Failed "execute_batch": ({operations},)')
    except cygrpc.ExecuteBatchError:
        logging.getLogger(grpc_logs.GRPC_CORE_LOGGER).exception(
            "ExecuteBatchError raised in core by servicer method [%s]", "/tandem.engine.v1.EngineService/Generate")


def test_a_failed_status_batch_is_one_info_line(caplog):
    grpc_logs.install()
    grpc_logs.install()  # idempotent
    assert sum(isinstance(f, grpc_logs.CallerGoneFilter)
               for f in logging.getLogger(grpc_logs.GRPC_CORE_LOGGER).filters) == 1
    with caplog.at_level(logging.INFO, logger=grpc_logs.GRPC_CORE_LOGGER):
        log_batch_error("<grpc._cython.cygrpc.SendStatusFromServerOperation object at 0x7f01ca78c1e0>")
    [record] = caplog.records
    assert record.levelno == logging.INFO and record.exc_info is None
    assert "/tandem.engine.v1.EngineService/Generate had already ended" in record.getMessage()
    assert "Traceback" not in caplog.text and " ERROR " not in caplog.text


def test_other_grpc_errors_stay_errors(caplog):
    grpc_logs.install()
    with caplog.at_level(logging.INFO, logger=grpc_logs.GRPC_CORE_LOGGER):
        log_batch_error("<grpc._cython.cygrpc.SendMessageOperation object at 0x7f01ca78c1e0>")
        logging.getLogger(grpc_logs.GRPC_CORE_LOGGER).error("something else")
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.ERROR]
    assert caplog.records[0].exc_info is not None
