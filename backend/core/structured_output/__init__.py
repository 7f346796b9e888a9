"""Structured outputs: grammars compiled in bounded worker processes (compiler.py, compile_worker.py)
and each constrained sequence's matcher, which fills the step's masks (manager.py).

Empty on purpose: ``python -m backend.core.structured_output.compile_worker`` imports this package
first, and must not find its own module imported already.
"""
