"""The HTTP app: the routes, each delegating to its endpoint in ``frontend.serving``.

Routes: /v1/completions, /v1/chat/completions, /v1/embeddings, vLLM's /pooling, /score (and
/v1/score) and /rerank (and /v1/rerank, /v2/rerank), /invocations, /v1/models, /tokenize,
/detokenize, /tokenizer_info, OpenAI's Responses API (POST
/v1/responses; GET and DELETE /v1/responses/{id}), and Anthropic's /v1/messages and
/v1/messages/count_tokens, whose errors take Anthropic's shape (all behind
``--api-key`` when set), and
/health, /load, /metrics, /version, /docs, /openapi.json (always open:
``OPEN_ROUTES``). ``create_app`` also installs the one mapping of errors to
OpenAI error JSON (``frontend.serving.errors``) and the edge's middleware
(``frontend.middleware``: metrics, request IDs, the API key before any body is
read, the body's size and time bounds, then admission) with the bound on the
wait for a request's head (``frontend.http_protocol``). Every bound is a
setting of ``backend.types.limits``. The process around it (connecting to the
backends, uvicorn, signals) is ``frontend.server``.
"""

from __future__ import annotations

from typing import Optional, Sequence

from fastapi import FastAPI, Request
from prometheus_client.registry import Collector
from starlette.responses import PlainTextResponse, Response
from transformers import PreTrainedTokenizerFast

from backend.types.limits import Limits
from backend.types.outputs import ModelInfo
from frontend import protocol as P
from frontend.engine_client import EngineClient
from frontend.http_protocol import head_deadline_protocol
from frontend.openapi import install_openapi, json_body
from frontend.middleware import (AdmissionMiddleware, AuthenticationMiddleware, BodyReaderMiddleware, HttpMetrics,
                                 MetricsMiddleware)
from frontend.protocol import anthropic as A
from frontend.protocol import responses as R
from frontend.serving.anthropic import AnthropicServingMessages
from frontend.serving.anthropic_errors import anthropic_route_class
from frontend.serving.base import ServingContext
from frontend.serving.chat import OpenAIServingChat
from frontend.serving.completions import OpenAIServingCompletion
from frontend.serving.embeddings import OpenAIServingEmbedding
from frontend.serving.errors import install_error_handlers
from frontend.serving.guided import deprecation_headers
from frontend.serving.invocations import OpenAIServingInvocations
from frontend.serving.models import OpenAIServingModels
from frontend.serving.response_store import ResponseStore
from frontend.serving.responses import OpenAIServingResponses
from frontend.serving.scoring import OpenAIServingScores
from frontend.serving.status import ServingStatus, tandem_version
from frontend.serving.tokenize import OpenAIServingTokenization

# The routes that pool prompts (the embeddings endpoint's engine calls) besides /v1/embeddings.
SCORE_ROUTES = ("/score", "/v1/score")
RERANK_ROUTES = ("/rerank", "/v1/rerank", "/v2/rerank")
POOLING_ROUTES = ("/pooling", *SCORE_ROUTES, *RERANK_ROUTES)
# The routes that queue work on the engine: admission control counts these.
GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations", "/v1/messages",
                               "/v1/responses", "/v1/embeddings", *POOLING_ROUTES})
# The routes open without the API key (probes, metrics, the schema); none takes a body. Every
# other path, unknown ones included, needs the key when one is set.
OPEN_ROUTES = frozenset({"/health", "/load", "/metrics", "/version", "/docs", "/docs/oauth2-redirect",
                         "/openapi.json"})


def create_app(engine_client: EngineClient, tokenizer: PreTrainedTokenizerFast, model_info: ModelInfo,
               api_key: Optional[str] = None, collectors: Sequence[Collector] = (),
               limits: Optional[Limits] = None, tool_call_parser: str = "auto",
               response_store: Optional[ResponseStore] = None, enable_prompt_tokens_details: bool = False) -> FastAPI:
    """The HTTP app over an engine client. ``model_info.model_name`` is the served name.

    ``collectors`` (e.g. the router's) are served on ``/metrics`` with the HTTP metrics;
    ``tool_call_parser`` is the format of tool calls in the model's replies; ``response_store``
    keeps /v1/responses' stored responses (default: this process's memory);
    ``enable_prompt_tokens_details``: chat and completions usage reports the prompt tokens the
    prefix cache served (``prompt_tokens_details``, vLLM's flag). The endpoints'
    shared ``ServingContext`` is ``app.state.serving`` (its ``close()`` stops the chat template
    workers, if request templates are allowed).
    """
    context = ServingContext(engine_client, tokenizer, model_info, limits, tool_call_parser,
                             enable_prompt_tokens_details)
    limits = context.limits
    metrics = HttpMetrics()
    for collector in collectors:
        metrics.registry.register(collector)
    # Named apart from the routes: a route's function name is its operationId in /openapi.json.
    serving_completion = OpenAIServingCompletion(context)
    serving_chat = OpenAIServingChat(context)
    serving_invocations = OpenAIServingInvocations(serving_chat, serving_completion)
    serving_messages = AnthropicServingMessages(context, serving_chat)
    serving_responses = OpenAIServingResponses(context, serving_chat, response_store)
    serving_tokenization = OpenAIServingTokenization(context)
    serving_embedding = OpenAIServingEmbedding(context)
    serving_scores = OpenAIServingScores(context, serving_embedding)
    serving_models = OpenAIServingModels(context)
    serving_status = ServingStatus(context, metrics.registry)
    # /openapi.json and /docs describe exactly the request models the routes parse.
    app = FastAPI(title="Tandem", version=tandem_version(), docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.serving = context
    # A generation route's 200: its JSON body, or its SSE events with stream (frontend.openapi describes them).
    sse = {"text/event-stream": {}}
    completion_answers = {200: {"model": P.CompletionResponse, "content": sse}}
    chat_answers = {200: {"model": P.ChatCompletionResponse, "content": sse}}

    @app.post("/v1/completions", responses=completion_answers)
    async def completions(request: P.CompletionRequest, raw_request: Request) -> Response:
        response = await serving_completion.create_completion(request, raw_request)
        response.headers.update(deprecation_headers(request))  # vLLM's legacy guided_* fields
        return response

    @app.post("/v1/chat/completions", responses=chat_answers)
    async def chat_completions(request: P.ChatCompletionRequest, raw_request: Request) -> Response:
        response = await serving_chat.create_chat_completion(request, raw_request)
        response.headers.update(deprecation_headers(request))  # vLLM's legacy guided_* fields
        return response

    @app.post("/v1/embeddings", response_model=P.EmbeddingResponse)
    async def create_embeddings(request: P.EmbeddingRequest, raw_request: Request) -> Response:
        """Each input's pooled final hidden states (OpenAI's embeddings API)."""
        return await serving_embedding.create_embedding(request, raw_request)

    @app.post("/pooling", response_model=P.PoolingResponse)
    async def create_pooling(request: P.PoolingRequest, raw_request: Request) -> Response:
        """vLLM's pooling API: each input's pooled vector, as /v1/embeddings gives it."""
        return await serving_embedding.create_pooling(request, raw_request)

    async def create_score(request: P.ScoreRequest, raw_request: Request) -> Response:
        """vLLM's score API: the cosine similarity of text_1's and text_2's embeddings, per pair."""
        return await serving_scores.create_score(request, raw_request)

    async def create_rerank(request: P.RerankRequest, raw_request: Request) -> Response:
        """Jina's and Cohere's rerank API: documents ordered by the cosine of their embeddings with the query's."""
        return await serving_scores.create_rerank(request, raw_request)

    for path in SCORE_ROUTES:
        app.add_api_route(path, create_score, methods=["POST"], response_model=P.ScoreResponse)
    for path in RERANK_ROUTES:
        app.add_api_route(path, create_rerank, methods=["POST"], response_model=P.RerankResponse)

    either_json = {"schema": {"anyOf": [{"$ref": "#/components/schemas/ChatCompletionResponse"},
                                        {"$ref": "#/components/schemas/CompletionResponse"}]}}

    @app.post("/invocations", response_model=None,
              openapi_extra=json_body(P.ChatCompletionRequest, P.CompletionRequest), responses={200: {"content": {"application/json": either_json, **sse}}})
    async def invocations(raw_request: Request) -> Response:
        """SageMaker's route: a chat body (``messages``) or a completions body (``prompt``)."""
        return await serving_invocations.create_invocation(raw_request)

    # Documented answers: the response (JSON, or its events with ``stream``) and the errors.
    error = {"model": P.ErrorResponse}
    response_answers = {200: {"content": {"text/event-stream": {}}}, 400: error, 404: error, 413: error, 429: error}

    @app.post("/v1/responses", response_model=R.ResponseObject, responses=response_answers)
    async def create_response(request: R.ResponsesRequest, raw_request: Request) -> Response:
        """OpenAI's Responses API (JSON, or its SSE events with ``stream``), served by the chat endpoint."""
        return await serving_responses.create_response(request, raw_request)

    @app.get("/v1/responses/{response_id}", response_model=R.ResponseObject, responses={404: error})
    async def retrieve_response(response_id: str) -> Response:
        """A response stored (``store``) by this frontend."""
        return await serving_responses.retrieve_response(response_id)

    @app.delete("/v1/responses/{response_id}", responses={404: error})
    async def delete_response(response_id: str) -> R.DeletedResponse:
        return await serving_responses.delete_response(response_id)

    # Anthropic's Messages API: its routes answer errors in Anthropic's shape.
    anthropic_route = anthropic_route_class(limits.retry_after_s)

    async def messages(request: A.AnthropicMessagesRequest, raw_request: Request) -> Response:
        """Anthropic's Messages API (JSON, or its SSE events with ``stream``), served by the chat endpoint."""
        return await serving_messages.create_message(request, raw_request)

    async def count_message_tokens(request: A.AnthropicCountTokensRequest) -> A.AnthropicCountTokensResponse:
        return await serving_messages.count_tokens(request)

    app.router.add_api_route("/v1/messages", messages, methods=["POST"], response_model=A.AnthropicMessagesResponse,
                             responses={200: {"content": sse}}, route_class_override=anthropic_route)
    app.router.add_api_route("/v1/messages/count_tokens", count_message_tokens, methods=["POST"],
                             route_class_override=anthropic_route)

    @app.get("/v1/models")
    async def models() -> P.ModelList:
        return serving_models.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> P.ModelCard:
        return serving_models.model_card(model_id)

    # Serialized by pydantic in one call: FastAPI's own encoding of a long token list takes
    # seconds on the event loop.
    @app.post("/tokenize", response_model=P.TokenizeResponse)
    async def tokenize(request: P.TokenizeRequest) -> Response:
        return Response((await serving_tokenization.tokenize(request)).model_dump_json(), media_type="application/json")

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> P.TokenizerInfoResponse:
        return serving_tokenization.tokenizer_info()

    @app.get("/load")
    async def load() -> P.LoadResponse:
        return serving_status.load()

    @app.post("/detokenize")
    async def detokenize(request: P.DetokenizeRequest) -> P.DetokenizeResponse:
        return await serving_tokenization.detokenize(request)

    @app.get("/health", response_class=Response, responses={
        200: {"description": "Serving (no body)."},
        503: {"model": P.ErrorResponse, "description": "The backend is unavailable or not serving."}})
    async def health() -> Response:
        return await serving_status.health()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_route() -> Response:
        """The frontend's HTTP and router metrics, then the engines' (``Router.metrics_text``:
        each backend's GetMetrics, labelled by backend). A client without it serves only ours."""
        return await serving_status.metrics()

    @app.get("/version")
    async def version() -> P.VersionResponse:
        return serving_status.version()

    install_openapi(app, limits, model_info, OPEN_ROUTES, GENERATION_ROUTES, api_key is not None)
    install_error_handlers(app, limits.retry_after_s)
    # Added innermost first: a request meets them in the opposite order (frontend.middleware).
    app.add_middleware(AdmissionMiddleware, paths=GENERATION_ROUTES, limit=limits.max_concurrent_requests,
                       retry_after_s=limits.retry_after_s, metrics=metrics)
    app.add_middleware(BodyReaderMiddleware, max_bytes=limits.max_request_body_bytes,
                       timeout_s=limits.http_body_timeout_s, max_concurrent=limits.max_concurrent_body_reads,
                       retry_after_s=limits.retry_after_s, skip_paths=OPEN_ROUTES, metrics=metrics)
    app.add_middleware(AuthenticationMiddleware, api_key=api_key, open_paths=OPEN_ROUTES,
                       max_unauthenticated=limits.max_unauthenticated_requests, retry_after_s=limits.retry_after_s,
                       metrics=metrics)
    # Added last, so outermost: it counts (and gives an ID to) every response, 401s and 404s included.
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=frozenset(route.path for route in app.routes))
    # The bound on the wait for a request's head lives below ASGI: serve the app with
    # ``uvicorn.Config(app, http=app.state.http_protocol)``.
    app.state.http_protocol = head_deadline_protocol(
        limits.http_header_timeout_s, limits.max_pending_connections,
        on_close=lambda limit: metrics.rejected.labels(limit).inc())
    return app
