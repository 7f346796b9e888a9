"""What both processes share, torch-free: sampling parameters, engine outputs, model info,
errors, limits, the engine config, ports, tokenizer files and wire constants.

The frontend imports nothing else of the backend (but its entry points, ``frontend.entrypoints``).
Imports: the standard library only (and ``backend.types`` itself).
"""
