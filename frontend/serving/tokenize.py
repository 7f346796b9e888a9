"""/tokenize, /detokenize and /tokenizer_info (vLLM's): the model's tokenizer as a service.

/tokenize takes a text or a chat (rendered with the chat template, as
/v1/chat/completions would), so a client counts the tokens a request will use.
A chat with ``tools`` renders exactly what the template renders with them (as
vLLM's does): the tool prompt /v1/chat/completions adds for a template without
tool support (``frontend.tool_calls``) belongs to generation, not to /tokenize.
"""

from __future__ import annotations

from typing import Any

from backend.types.errors import InvalidRequestError
from frontend import protocol as P
from frontend.serving.base import OpenAIServing
from frontend.tool_calls import check_tools, messages_for_template


class OpenAIServingTokenization(OpenAIServing):
    """Tokenize, detokenize, and describe the tokenizer."""

    async def tokenize(self, request: P.TokenizeRequest) -> P.TokenizeResponse:
        self._check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise InvalidRequestError("Give exactly one of prompt or messages.", param="prompt")
        self.renderer.check_chat_template(request.chat_template)
        if request.messages is not None:
            check_tools(request.tools, None)
            # As a template with tool support gets them: tool-call arguments as objects, no fallback.
            messages = messages_for_template(request.messages, request.tools, supports_tools=True)
            _, tokens = await self.renderer.render_and_encode_chat(
                messages, request.add_generation_prompt, request.chat_template, request.continue_final_message,
                {**(request.chat_template_kwargs or {}), "tools": request.tools},
                add_special_tokens=bool(request.add_special_tokens))
        else:
            tokens = await self.renderer.encode(request.prompt,
                                                add_special_tokens=request.add_special_tokens is not False)
        token_strs = self.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return P.TokenizeResponse(count=len(tokens), max_model_len=self.model_info.max_model_len, tokens=tokens,
                                  token_strs=token_strs)

    async def detokenize(self, request: P.DetokenizeRequest) -> P.DetokenizeResponse:
        self._check_model(request.model)
        self.renderer.check_token_ids(request.tokens, param="tokens")
        text = await self.renderer.off_loop(len(request.tokens), self.tokenizer.decode, request.tokens)
        return P.DetokenizeResponse(prompt=text)

    def tokenizer_info(self) -> P.TokenizerInfoResponse:
        """The tokenizer's configuration, as vLLM's /tokenizer_info (lm-eval's remote tokenizer reads it)."""
        tokenizer = self.tokenizer
        info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            info[key] = getattr(tokenizer, key, None)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            info[key] = getattr(tokenizer, key, None)
        info.update(model_max_length=self.model_info.max_model_len, chat_template=tokenizer.chat_template,
                    add_bos_token=getattr(tokenizer, "add_bos_token", None), vocab_size=len(tokenizer),
                    padding_side=tokenizer.padding_side, truncation_side=tokenizer.truncation_side,
                    clean_up_tokenization_spaces=tokenizer.clean_up_tokenization_spaces)
        return P.TokenizerInfoResponse(**info)
