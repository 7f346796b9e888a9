"""Tandem frontend: tokenization, the OpenAI-compatible HTTP API, offline ``LLM``.

``from frontend import LLM, SamplingParams`` works; ``LLM`` (which runs an engine
in this process, with torch) is imported only when first used, so the frontend
package itself stays torch-free.
"""

from backend.types.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from frontend.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'frontend' has no attribute {name!r}")
