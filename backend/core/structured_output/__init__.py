"""Structured outputs: grammars compiled in bounded worker processes (compiler.py, compile_worker.py)
and each constrained sequence's matcher, which fills the step's masks (manager.py)."""

from backend.core.structured_output.manager import GrammarViolation, StructuredOutputManager

__all__ = ["GrammarViolation", "StructuredOutputManager"]
