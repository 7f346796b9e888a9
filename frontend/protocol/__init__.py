"""Request and response bodies of the OpenAI-compatible HTTP API (data only, no behaviour).

Field names, types and defaults mirror OpenAI's API plus vLLM's extensions.
Every field a request model declares takes effect, except those in
``UNSUPPORTED_FIELDS``, which are declared (so a 400 names them when set) and
left out of /openapi.json; an undeclared field is refused too.
``IGNORED_FIELDS`` are the few accepted without effect, as OpenAI metadata.
Value ranges are not checked here: ``SamplingParams`` checks them and names the
parameter, so the HTTP server and the offline ``LLM`` reject the same values
with the same words; ``ranged`` states them in the schema (``frontend.openapi``
adds the bounds that are settings). Text is: any string in any request field (nested ones,
dict keys included) that is not valid Unicode is refused naming the field.

One module per endpoint family, as in ``frontend.serving`` (``common`` holds what
they share); every model is also importable from here (``from frontend import
protocol as P``; ``P.ChatCompletionRequest``).
"""

from frontend.protocol.chat import (ChatCompletionLogprobContent, ChatCompletionLogProbs, ChatCompletionRequest,
                                    ChatCompletionResponse, ChatCompletionResponseChoice, ChatCompletionStreamChoice,
                                    ChatCompletionStreamResponse, ChatCompletionTopLogprob, ChatMessage, DeltaMessage,
                                    DeltaToolCall, FunctionCall, ToolCall)
from frontend.protocol.common import (IGNORED_FIELDS, INT64, UNSUPPORTED_FIELDS, ErrorInfo, ErrorResponse,
                                      JsonSchemaFormat, LegacyGuidedFields, Logprobs, PromptLogprob,
                                      PromptTokensDetails, RequestModel, ResponseFormat, ResponseModel,
                                      SamplingFields, StreamOptions, StructuredOutputsRequest, Unsupported, UsageInfo,
                                      created_now)
from frontend.protocol.completions import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                           CompletionResponseChoice, CompletionStreamChoice, CompletionStreamResponse)
from frontend.protocol.embeddings import (EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, PoolingData,
                                          PoolingRequest, PoolingResponse)
from frontend.protocol.models import ModelCard, ModelList
from frontend.protocol.scoring import (CROSS_ENCODER_FIELDS, RerankDocument, RerankRequest, RerankResponse, RerankResult,
                                       ScoreData, ScoreRequest, ScoreResponse)
from frontend.protocol.status import LoadResponse, VersionResponse
from frontend.protocol.tokenize import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
                                        TokenizerInfoResponse)

__all__ = [
    "IGNORED_FIELDS", "INT64", "UNSUPPORTED_FIELDS", "ErrorInfo", "ErrorResponse", "JsonSchemaFormat",
    "LegacyGuidedFields", "Logprobs",
    "PromptLogprob", "PromptTokensDetails", "RequestModel", "ResponseFormat", "ResponseModel", "SamplingFields",
    "StreamOptions", "StructuredOutputsRequest", "Unsupported", "UsageInfo", "created_now",
    "CompletionLogProbs", "CompletionRequest", "CompletionResponse", "CompletionResponseChoice",
    "CompletionStreamChoice", "CompletionStreamResponse",
    "ChatCompletionLogprobContent", "ChatCompletionLogProbs", "ChatCompletionRequest", "ChatCompletionResponse",
    "ChatCompletionResponseChoice", "ChatCompletionStreamChoice", "ChatCompletionStreamResponse",
    "ChatCompletionTopLogprob", "ChatMessage", "DeltaMessage", "DeltaToolCall", "FunctionCall", "ToolCall",
    "DetokenizeRequest", "DetokenizeResponse", "TokenizeRequest", "TokenizeResponse", "TokenizerInfoResponse",
    "ModelCard", "ModelList", "LoadResponse", "VersionResponse",
    "EmbeddingData", "EmbeddingRequest", "EmbeddingResponse", "EmbeddingUsage",
    "PoolingData", "PoolingRequest", "PoolingResponse",
    "CROSS_ENCODER_FIELDS", "RerankDocument", "RerankRequest", "RerankResponse", "RerankResult", "ScoreData",
    "ScoreRequest", "ScoreResponse",
]
