"""The engine: ``LLMEngine`` (schedule -> execute -> update, one synchronous step) and
``AsyncLLMEngine`` (its asyncio loop, the in-process ``EngineClient``).

Imports: backend.core, backend.executor and below.
"""
