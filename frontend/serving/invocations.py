"""/invocations (SageMaker's route): a chat body or a completions body, told apart by its fields."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from backend.types.errors import InvalidRequestError
from frontend import protocol as P
from frontend.serving.chat import OpenAIServingChat
from frontend.serving.completions import OpenAIServingCompletion


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
            return await self.chat.create_chat_completion(P.ChatCompletionRequest.model_validate(body), raw_request)
        if isinstance(body, dict) and "prompt" in body:
            return await self.completions.create_completion(P.CompletionRequest.model_validate(body), raw_request)
        raise InvalidRequestError("/invocations takes a chat completion body (with messages) or a completion "
                                  "body (with prompt).", param="messages")
