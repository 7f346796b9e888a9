"""The engine's core: the scheduler, the KV-cache block manager, the engine's own request state,
and the request features that live in the engine (structured outputs, speculative decoding's
proposer, beam search). Pure bookkeeping: no tensors but the grammar masks it fills.

Imports: backend.messages, backend.types (never the executor or the worker).
"""
