"""Tandem frontend: tokenization, the OpenAI-compatible HTTP API, offline LLM."""
