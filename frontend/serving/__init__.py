"""The OpenAI endpoints' logic, one module per endpoint family (``frontend.app`` routes to them).

Endpoints, each a class over the shared ``base.ServingContext``:
``completions`` (/v1/completions), ``chat`` (/v1/chat/completions),
``tokenize`` (/tokenize, /detokenize, /tokenizer_info), ``models``
(/v1/models), ``invocations`` (SageMaker's /invocations, to chat or
completions), ``status`` (/health, /load, /metrics, /version). A new endpoint
family (embeddings, responses, messages) is a new module here, built on
``base.OpenAIServing``, with its bodies in ``frontend.protocol``.

Shared pieces: ``base`` (the context, the checks every request meets, the
engine call and stream merging), ``errors`` (errors -> HTTP status and OpenAI
error JSON: the one place), ``prompts`` (text and chats -> token IDs, bounded),
``sampling`` (request fields -> ``SamplingParams``), ``logprobs`` (OpenAI's
logprob formats), ``sse`` (server-sent event framing).
"""
