"""Limits: every bound on what one client may ask of a server, in one place.

Pure Python (no torch): the HTTP frontend and the gRPC backend both check
these at their edge, before any work is queued, so no single request can
exhaust memory or starve the others. Each field is a ``--flag-name`` of the
processes that enforce it (``FRONTEND_LIMITS``, ``BACKEND_LIMITS``) and its
error names the flag, so an operator knows what to raise.

Where each is checked:

    check_sampling_params   n, stop strings/token IDs, logprobs: the frontend
                            before it sends, the engine before it queues
                            (``LLMEngine.validate``, in process and over gRPC)
    check_request_id        the gRPC server
    check_cache_salt        the frontend and the gRPC server
    the rest                where its comment says
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Optional

from backend.types.errors import InvalidRequestError


@dataclass(frozen=True)
class Limits:
    # ---- one request (both edges) ----
    max_n: int = 128  # sequences per prompt (OpenAI's cap on n)
    max_stop_sequences: int = 64  # stop strings, and stop token IDs, each
    max_stop_sequence_length: int = 1024  # characters in one stop string (matched on every delta)
    max_logprobs: int = 20  # top alternatives per position (vLLM's --max-logprobs; -1: the whole vocabulary)
    max_logprob_token_ids: int = 128  # tokens whose logprobs one request asks for by ID (each a vocab-wide rank)
    max_logit_bias: int = 300  # tokens one request biases (OpenAI's bound)
    max_cache_salt_length: int = 256  # characters
    max_request_id_length: int = 256  # characters (gRPC GenerateRequest.request_id)
    # ---- one HTTP request (frontend) ----
    max_prompts_per_request: int = 1024  # prompts in one /v1/completions list
    max_sequences_per_request: int = 1024  # prompts x n
    max_request_body_bytes: int = 32 * 1024 * 1024  # HTTP 413 beyond
    request_timeout_s: int = 3600  # a generation request's deadline (gRPC deadline -> the engine aborts it)
    # ---- admission (excess refused at once: HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED) ----
    max_concurrent_requests: int = 2048  # frontend: generation requests being answered
    max_num_queued_requests: int = 1024  # backend: sequences waiting beyond the max_num_seqs running
    # ---- the Responses API's stored responses (backend; least recently used evicted first) ----
    max_stored_responses: int = 1024  # responses kept for previous_response_id and GET
    max_stored_response_bytes: int = 64 * 1024 * 1024  # their JSON, all together
    max_stored_response_age_s: int = 30 * 24 * 3600  # each is forgotten this long after it was stored
    retry_after_s: int = 1  # the Retry-After a refused client is told
    # ---- the HTTP edge, before admission (frontend; see frontend/middleware.py) ----
    http_header_timeout_s: int = 10  # a request's head must arrive whole within this (else 408, closed)
    http_body_timeout_s: int = 60  # a request's body must arrive whole within this of its head (else 408)
    max_pending_connections: int = 1024  # connections part-way through a request's head; beyond, the oldest is closed
    max_unauthenticated_requests: int = 64  # requests answered without a verified API key (open routes, 401s)
    max_concurrent_body_reads: int = 512  # requests whose body is still arriving (past the key check); more wait
    # ---- transport ----
    max_grpc_message_bytes: int = 16 * 1024 * 1024  # each gRPC message, both directions, both ends
    # ---- a request's chat_template (frontend): refused unless trusted, then rendered in worker processes ----
    trust_request_chat_template: bool = False  # vLLM's --trust-request-chat-template
    chat_template_workers: int = 2  # worker processes rendering request templates
    chat_template_timeout_s: int = 5  # wall time one rendering may take; then its worker is killed
    max_chat_template_output_bytes: int = 32 * 1024 * 1024  # the rendered prompt, in UTF-8
    max_chat_template_memory_bytes: int = 512 * 1024 * 1024  # address space a worker may grow by

    def __post_init__(self) -> None:
        for f in fields(self):
            if isinstance(getattr(self, f.name), bool):  # a switch, not a bound
                continue
            if f.name == "max_logprobs" and self.max_logprobs == -1:  # no cap but the vocabulary (vLLM's)
                continue
            if getattr(self, f.name) < 1:
                raise InvalidRequestError(f"{f.name} must be at least 1; got {getattr(self, f.name)}.",
                                          param=f.name)

    # ---- checks ----

    def check_sampling_params(self, params, vocab_size: Optional[int]) -> None:
        """Raise ``InvalidRequestError`` naming the bound a ``SamplingParams`` exceeds.

        ``vocab_size`` resolves a -1 (the whole vocabulary) in the logprobs counts and in
        max_logprobs; None where it is not known (the gRPC edge, whose proto carries no -1):
        max_logprobs -1 then bounds nothing there, and the engine checks again knowing it.
        """
        self._at_most("n", params.n, self.max_n, "max_n")
        self._at_most("stop", len(params.stop), self.max_stop_sequences, "max_stop_sequences", what="stop strings")
        longest = max((len(s) for s in params.stop), default=0)
        self._at_most("stop", longest, self.max_stop_sequence_length, "max_stop_sequence_length",
                      what="characters in a stop string")
        self._at_most("stop_token_ids", len(params.stop_token_ids), self.max_stop_sequences, "max_stop_sequences",
                      what="stop token IDs")
        for name in ("logprobs", "prompt_logprobs"):
            self.logprobs_count(name, getattr(params, name), vocab_size)
        if params.logprob_token_ids is not None:
            self._at_most("logprob_token_ids", len(params.logprob_token_ids), self.max_logprob_token_ids,
                          "max_logprob_token_ids", what="tokens in logprob_token_ids")
        if params.logit_bias:
            self._at_most("logit_bias", len(params.logit_bias), self.max_logit_bias, "max_logit_bias",
                          what="tokens in logit_bias")

    def logprobs_count(self, param: str, value: Optional[int], vocab_size: Optional[int]) -> Optional[int]:
        """A request's logprobs per position (``param``: its field) with vLLM's -1, the whole
        vocabulary, resolved to ``vocab_size``; raises InvalidRequestError naming ``param`` for a
        count below -1 or above --max-logprobs (whose own -1 is the vocabulary size too).
        ``vocab_size`` None (not known here): a -1 stays -1, allowed only under --max-logprobs -1."""
        if value is None:
            return None
        if value < -1:
            raise InvalidRequestError(f"{param} must be -1 (the whole vocabulary) or non-negative; got {value}.",
                                      param=param)
        count = vocab_size if value == -1 and vocab_size is not None else value
        limit = vocab_size if self.max_logprobs == -1 else self.max_logprobs
        if limit is None:  # --max-logprobs -1 and the vocabulary not known here
            return count
        if count == -1 or count > limit:
            asked = str(value)
            if value == -1:
                asked += f" (the whole vocabulary, {count} tokens)" if count != -1 else " (the whole vocabulary)"
            raise InvalidRequestError(
                f"{param} must be at most {limit} (the server's --max-logprobs, which -1 sets to the vocabulary "
                f"size); got {asked}.", param=param)
        return count

    def check_request_id(self, request_id: str) -> None:
        if not request_id:
            raise InvalidRequestError("request_id must not be empty.", param="request_id")
        self._at_most("request_id", len(request_id), self.max_request_id_length, "max_request_id_length",
                      what="characters in request_id")

    def check_cache_salt(self, cache_salt: Optional[str]) -> None:
        if cache_salt is None:
            return
        if not cache_salt:
            raise InvalidRequestError("cache_salt must not be empty when given.", param="cache_salt")
        self._at_most("cache_salt", len(cache_salt), self.max_cache_salt_length, "max_cache_salt_length",
                      what="characters in cache_salt")

    def check_prompt_count(self, num_prompts: int, n: int) -> None:
        self._at_most("n", n, self.max_n, "max_n")
        self._at_most("prompt", num_prompts, self.max_prompts_per_request, "max_prompts_per_request",
                      what="prompts in one request")
        self._at_most("n", num_prompts * n, self.max_sequences_per_request, "max_sequences_per_request",
                      what="sequences (prompts x n) in one request")

    @staticmethod
    def _at_most(param: str, value: int, limit: int, setting: str, what: Optional[str] = None) -> None:
        if value > limit:
            what = what or param
            raise InvalidRequestError(
                f"{what} must be at most {limit} (the server's --{setting.replace('_', '-')}); got {value}.",
                param=param)

    # ---- command line ----

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
        from backend.types.config import add_dataclass_cli_args

        group = parser.add_argument_group("limits (checked before any work is queued)")
        add_dataclass_cli_args(group, cls, list(names), _HELP)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "Limits":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


_HELP = {
    "max_n": "most sequences one prompt may ask for (n)",
    "max_stop_sequences": "most stop strings, and most stop token IDs, per request",
    "max_stop_sequence_length": "most characters in one stop string",
    "max_logprobs": "most top logprobs per position (logprobs, prompt_logprobs, top_logprobs); -1: the whole "
                    "vocabulary, which a request asks for with -1",
    "max_logprob_token_ids": "most tokens one request asks logprobs of by ID (logprob_token_ids)",
    "max_logit_bias": "most tokens one request biases (logit_bias)",
    "max_cache_salt_length": "most characters in cache_salt",
    "max_request_id_length": "most characters in a gRPC request_id",
    "max_prompts_per_request": "most prompts in one /v1/completions request",
    "max_sequences_per_request": "most sequences (prompts x n) in one HTTP request",
    "max_request_body_bytes": "largest HTTP request body (413 beyond)",
    "request_timeout_s": "seconds a generation request may take; then the engine aborts it (HTTP 504)",
    "max_concurrent_requests": "generation requests answered at once; more get 429 with Retry-After",
    "max_num_queued_requests": "sequences that may wait beyond the max_num_seqs running; "
                               "more get RESOURCE_EXHAUSTED (HTTP 429)",
    "retry_after_s": "the Retry-After (seconds) sent with a 429",
    "http_header_timeout_s": "seconds a connection may take to send a request's head (line and headers), "
                             "from its opening or its last response; then 408 and closed",
    "http_body_timeout_s": "seconds a request's body may take to arrive whole, from its head; then 408",
    "max_pending_connections": "connections part-way through sending a request's head; beyond, the one "
                               "pending longest is closed (once it has been so for 1 s)",
    "max_unauthenticated_requests": "requests answered at once without a verified API key (/health, /metrics, "
                                    "..., 401s); more get 429",
    "max_concurrent_body_reads": "requests whose body is still arriving (after the API key check, before "
                                 "admission); more wait for a slot, 429 if none frees within "
                                 "--http-body-timeout-s",
    "max_grpc_message_bytes": "largest gRPC message either way",
    "max_stored_responses": "most /v1/responses responses kept (store: true) for previous_response_id and GET; "
                            "beyond, the least recently used goes",
    "max_stored_response_bytes": "most bytes (JSON) of stored /v1/responses responses, all together",
    "max_stored_response_age_s": "seconds a stored /v1/responses response is kept after it was stored; then "
                                 "it is gone (404), however recently it was used",
    "trust_request_chat_template": "render a chat_template sent in a request (chat completions, /tokenize) in a "
                                   "bounded worker process; off: such a request gets a 400",
    "chat_template_workers": "worker processes that render request chat templates",
    "chat_template_timeout_s": "seconds one request chat template may take to render; then its worker is "
                               "killed and the request gets a 400",
    "max_chat_template_output_bytes": "largest prompt a request chat template may render (UTF-8 bytes)",
    "max_chat_template_memory_bytes": "memory (address space) a request chat template's worker may grow by",
}

# The limits each process enforces, hence its flags (``tandem serve`` passes each its own).
FRONTEND_LIMITS = ("max_n", "max_stop_sequences", "max_stop_sequence_length", "max_logprobs",
                   "max_logprob_token_ids", "max_logit_bias", "max_cache_salt_length", "max_prompts_per_request", "max_sequences_per_request",
                   "max_request_body_bytes", "request_timeout_s", "max_concurrent_requests", "retry_after_s", "max_grpc_message_bytes",
                   "trust_request_chat_template", "chat_template_workers", "chat_template_timeout_s",
                   "max_chat_template_output_bytes", "max_chat_template_memory_bytes",
                   "http_header_timeout_s", "http_body_timeout_s", "max_pending_connections",
                   "max_unauthenticated_requests", "max_concurrent_body_reads")
BACKEND_LIMITS = ("max_n", "max_stop_sequences", "max_logprobs", "max_logprob_token_ids", "max_logit_bias",
                  "max_cache_salt_length",
                  "max_request_id_length", "max_num_queued_requests", "max_grpc_message_bytes",
                  "max_stored_responses", "max_stored_response_bytes", "max_stored_response_age_s")
