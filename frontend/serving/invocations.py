"""/invocations (SageMaker's route): a chat body or a completions body, told apart by its fields."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from backend.types.errors import InvalidRequestError
from frontend import protocol as P
from frontend.serving.chat import OpenAIServingChat
from frontend.serving.completions import OpenAIServingCompletion
from frontend.serving.guided import deprecation_headers


class OpenAIServingInvocations:
    """A body with ``messages`` goes to the chat endpoint, one with ``prompt`` to completions."""

    def __init__(self, chat: OpenAIServingChat, completions: OpenAIServingCompletion) -> None:
        self.chat = chat
        self.completions = completions

    async def create_invocation(self, raw_request: Request) -> Response:
        try:
            body = await raw_request.json()
        except ValueError:
            raise InvalidRequestError("The body must be a JSON object.", param="body") from None
        if isinstance(body, dict) and "messages" in body:
            chat = P.ChatCompletionRequest.model_validate(body)
            response = await self.chat.create_chat_completion(chat, raw_request)
            response.headers.update(deprecation_headers(chat))
            return response
        if isinstance(body, dict) and "prompt" in body:
            completion = P.CompletionRequest.model_validate(body)
            response = await self.completions.create_completion(completion, raw_request)
            response.headers.update(deprecation_headers(completion))
            return response
        raise InvalidRequestError("/invocations takes a chat completion body (with messages) or a completion "
                                  "body (with prompt).", param="messages")
