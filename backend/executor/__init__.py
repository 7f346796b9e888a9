"""Executors drive the workers: uni, mp, ray, external_launcher (see base.py)."""

from backend.executor.base import Executor, create_executor  # noqa: F401
