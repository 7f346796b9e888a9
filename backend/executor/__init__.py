"""Executors drive the workers: uni, mp, ray, external_launcher (the interface: base.py).

Imports: backend.worker, backend.messages, backend.models, backend.distributed, backend.types
(never backend.core: what the scheduler decided arrives as a ``SchedulerOutput``).
"""

from backend.executor.base import Executor
from backend.types.config import EngineConfig

__all__ = ["Executor", "create_executor"]


def create_executor(config: EngineConfig) -> Executor:
    """The executor ``config.executor_backend`` names (``config`` is resolved and checked)."""
    backend = config.executor_backend
    if backend == "uni":
        from backend.executor.uni import UniExecutor

        return UniExecutor(config)
    if backend == "mp":
        from backend.executor.mp import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from backend.executor.ray import RayExecutor

        return RayExecutor(config)
    from backend.executor.external_launcher import ExternalLauncherExecutor

    return ExternalLauncherExecutor(config)
