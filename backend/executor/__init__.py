"""Executors drive the workers: ``uni`` (one worker in this process) for now."""

from backend.executor.base import Executor, create_executor  # noqa: F401
