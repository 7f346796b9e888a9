"""Tandem's GPU side: engine, scheduler, KV cache, executor, workers and models.

Importing this package does not import torch; ``backend.request`` and
``backend.errors`` are pure Python and shared with the frontend.
"""
