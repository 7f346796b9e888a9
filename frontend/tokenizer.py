"""Tokenizer loading, chat templates, incremental detokenization and stop strings.

Everything here runs in the frontend and must not import torch: the tokenizer is
loaded as ``transformers.PreTrainedTokenizerFast`` (``AutoTokenizer`` would pull
torch in) and decoded through its ``tokenizers`` backend.

The text of generated tokens is what they read as *continuing the prompt*,
i.e. ``decode(prompt + gen)[len(decode(prompt)):]`` (vLLM's behaviour): a
SentencePiece "▁Hello" after a prompt reads " Hello", not "Hello".
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from typing import Any, Optional

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from backend.types.errors import InvalidRequestError, ModelNotFoundError
from backend.types.tokenizer_files import tokenizer_fingerprint  # noqa: F401 -- one definition for both sides
from frontend.template_worker import ChatRenderJob, TemplateRenderError, render_job
from frontend.unicode_check import check_valid_unicode

# apply_chat_template's own parameters: a template variable with one of these
# names would change what the call returns instead of reaching the template.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})

# OpenAI's chat roles ("function" is its deprecated form of "tool"). Any other role string is passed
# to the template as it is (vLLM's custom roles: the template decides what it means), up to this length.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_ROLE_CHARS = 64

# The detokenizer starts from a short prompt suffix, not the whole prompt: enough
# for the first generated token to read as a continuation, and cheap to prime.
_MAX_CONTEXT_TOKENS = 24

# tokenizers raises a bare Exception with this text when a decoder rewrote text
# it had already produced; only the message tells it apart from a real bug.
_INVALID_PREFIX = "Invalid prefix encountered"


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Load the fast tokenizer (and its chat template) from a local directory."""
    if not os.path.isdir(path):
        raise ModelNotFoundError(f"Tokenizer directory {path!r} does not exist.")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ModelNotFoundError(
            f"Tokenizer directory {path!r} has no tokenizer.json; Tandem needs a fast "
            f"(tokenizers-library) tokenizer. Found: {sorted(os.listdir(path))}.")
    return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)


def encode_prompt(tokenizer: PreTrainedTokenizerFast, text: str,
                  add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
    """Token IDs of a prompt.

    ``add_special_tokens`` follows the tokenizer's post-processor (e.g. a BOS);
    pass False for text rendered by a chat template, which already holds them.
    Text that is not valid Unicode is an ``InvalidRequestError`` naming ``param``.
    """
    if not isinstance(text, str):
        raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}.", param=param)
    check_valid_unicode(text, param)  # the tokenizers library takes only UTF-8
    backend = _plain_backend(tokenizer)
    if backend is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def _plain_backend(tokenizer: PreTrainedTokenizerFast):
    """The ``tokenizers`` tokenizer under ``tokenizer`` when its own ``encode`` gives what
    ``tokenizer.encode`` gives, else None.

    For this class, transformers' ``encode`` of one text turns the backend's truncation and
    padding off, sets its ``encode_special_tokens`` to ``split_special_tokens``, then encodes
    through it; when those are already so, the backend's ``encode`` is the same, without ~50 µs
    of wrapping per prompt (a subclass may do more: it keeps transformers' path)."""
    if type(tokenizer) is not PreTrainedTokenizerFast:
        return None
    backend = tokenizer._tokenizer
    if (backend.truncation is not None or backend.padding is not None
            or backend.encode_special_tokens != bool(tokenizer.split_special_tokens)):
        return None
    return backend


def prepare_chat(
    tokenizer: PreTrainedTokenizerFast,
    messages: list[dict],
    add_generation_prompt: bool = True,
    chat_template: Optional[str] = None,
    continue_final_message: bool = False,
    tools: Optional[list[dict]] = None,
    **template_kwargs: Any,
) -> ChatRenderJob:
    """Check OpenAI-style chat messages and gather what the template sees (``render_job`` renders it).

    ``chat_template``: a template, or the name of one of the model's; None (or
    empty): the model's own. Text-only content parts (``[{"type": "text",
    "text": ...}]``) are joined with newlines; keys whose value is null are left
    out, as ``apply_chat_template`` does. Raises ``InvalidRequestError`` for
    malformed messages or a missing template.
    """
    if not (chat_template or tokenizer.chat_template):
        raise InvalidRequestError(
            "The model's tokenizer has no chat template, so chat messages cannot be "
            "rendered; supply one with chat_template.", param="messages")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true.",
            param="continue_final_message")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)}.", param="chat_template_kwargs")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list.", param="messages")
    conversation = [_normalize_message(message, i) for i, message in enumerate(messages)]
    try:
        template = tokenizer.get_chat_template(chat_template or None, tools)
    except ValueError as exc:  # several named templates and none chosen
        raise InvalidRequestError(str(exc), param="chat_template") from exc
    return ChatRenderJob(template=template, conversation=conversation, add_generation_prompt=add_generation_prompt,
                         continue_final_message=continue_final_message, tools=tools,
                         template_kwargs={**tokenizer.special_tokens_map, **template_kwargs})


def render_chat(
    tokenizer: PreTrainedTokenizerFast,
    messages: list[dict],
    add_generation_prompt: bool = True,
    chat_template: Optional[str] = None,
    continue_final_message: bool = False,
    tools: Optional[list[dict]] = None,
    **template_kwargs: Any,
) -> str:
    """Render OpenAI-style chat messages to the prompt text the model expects, in this process.

    For templates this process trusts (the model's, or an offline caller's): a
    template from an HTTP client renders in ``frontend.template_sandbox``.
    Tokenize the result with ``encode_prompt(..., add_special_tokens=False)``.
    Raises ``InvalidRequestError`` as ``prepare_chat`` does, or for an error the
    template itself raises.
    """
    job = prepare_chat(tokenizer, messages, add_generation_prompt, chat_template, continue_final_message, tools,
                       **template_kwargs)
    try:
        return render_job(job)
    except TemplateRenderError as exc:
        raise InvalidRequestError(f"Could not render the chat template: {exc}", param="messages") from exc


def _normalize_message(message: Any, position: int) -> dict:
    """A copy of one message with its content as a plain string (or None)."""
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"messages[{position}] must be an object, got {type(message).__name__}.",
                                  param="messages")
    role = message.get("role")
    if not isinstance(role, str) or not 0 < len(role) <= MAX_ROLE_CHARS:
        raise InvalidRequestError(f"messages[{position}].role must be a string of 1 to {MAX_ROLE_CHARS} characters "
                                  f"(OpenAI's: {', '.join(sorted(CHAT_ROLES))}; other roles go to the chat "
                                  f"template as they are); got {role!r:.40}.", param="messages")
    # apply_chat_template's normalization: templates test for a key's presence, not for null.
    normalized = {key: value for key, value in message.items() if value is not None}
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"messages[{position}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                    f"are supported, got {part!r:.80}.", param="messages")
            texts.append(part["text"])
        normalized["content"] = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise InvalidRequestError(
            f"messages[{position}].content must be a string or a list of text parts.", param="messages")
    return normalized


def decode_token(tokenizer: PreTrainedTokenizerFast, token_id: int) -> str:
    """The text of one token on its own, special tokens included (vLLM's ``decoded_token``).

    A token holding part of a multi-byte character decodes to U+FFFD here. Logprobs ask
    for it for every alternative of every token, so each tokenizer keeps the texts it
    has decoded (at most one per vocabulary entry).
    """
    texts = _TOKEN_TEXTS.get(tokenizer)
    if texts is None:
        texts = _TOKEN_TEXTS[tokenizer] = {}
    text = texts.get(token_id)
    if text is None:
        text = tokenizer.backend_tokenizer.decode([token_id], skip_special_tokens=False)
        if len(texts) < _MAX_CACHED_TOKEN_TEXTS:  # IDs beyond the vocabulary must not grow it for ever
            texts[token_id] = text
    return text


_TOKEN_TEXTS: "weakref.WeakKeyDictionary[PreTrainedTokenizerFast, dict[int, str]]" = weakref.WeakKeyDictionary()
_MAX_CACHED_TOKEN_TEXTS = 1 << 18  # above any vocabulary served today (~256k)


class IncrementalDetokenizer:
    """Turns generated token IDs into text as they arrive, one sequence at a time.

    Text is released only once it is whole: a character split over several
    byte tokens is held back until its last byte arrives, so ``push`` never
    yields a broken character that later tokens would complete. Built on
    ``tokenizers``' ``DecodeStream``, primed with a prompt suffix so the first
    generated token reads as a continuation of the prompt.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # The stream decodes [last released chunk] + [pending]; mirrored here so
        # flush() can say what the pending tokens read as.
        self._chunk_ids: list[int] = []
        self._pending_ids: list[int] = []
        # Only consulted when special tokens are shown without separators: the
        # decoder may put a space between two added tokens that we must drop.
        self._added_token_text: Optional[dict[int, str]] = None
        self._last_was_added = False
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._added_token_text = {
                token_id: added.content for token_id, added in self._backend.get_added_tokens_decoder().items()}
        self.token_ids: list[int] = []
        self._pieces: list[str] = []  # the text released so far, joined only when asked (``text``)
        # Prime on the prompt's tail; what it decodes to is the prompt's, not ours.
        for token_id in _prompt_context(self._backend, prompt_token_ids, skip_special_tokens):
            self._step(token_id)

    @property
    def text(self) -> str:
        """The text released so far (every ``push`` and ``flush`` return, joined)."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def push(self, new_token_ids: list[int]) -> str:
        """Add generated tokens; return the text they completed (may be "").

        O(new tokens): each token is one ``DecodeStream`` step over the last
        released chunk and the tokens held back, never the whole sequence.
        """
        if len(new_token_ids) == 1:  # the common case: one token per engine step
            delta = self._step(new_token_ids[0])
        else:
            delta = "".join([self._step(token_id) for token_id in new_token_ids])
        self.token_ids.extend(new_token_ids)
        if delta:
            self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of the sequence: the text of tokens still held back.

        A character the sequence never completed comes out as U+FFFD, as in a
        full decode. Call once, after the last ``push``.
        """
        if not self._pending_ids:
            return ""
        head = self._decode(self._chunk_ids)
        whole = self._decode(self._chunk_ids + self._pending_ids)
        tail = whole[len(head):] if whole.startswith(head) else self._decode(self._pending_ids)
        self._chunk_ids, self._pending_ids = self._chunk_ids + self._pending_ids, []
        if tail:
            self._pieces.append(tail)
        return tail

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _step(self, token_id: int) -> str:
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception as exc:  # noqa: BLE001 -- tokenizers raises it untyped
            if _INVALID_PREFIX not in str(exc):
                raise
            # The decoder rewrote text already released (e.g. a run of byte-fallback
            # tokens that turned invalid as a whole). Released text cannot be taken
            # back: restart from the tokens not yet released, without context.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            self._chunk_ids = []
            piece = self._stream.step(self._backend, self._pending_ids + [token_id])
        self._pending_ids.append(token_id)
        if self._added_token_text is not None:
            raw = self._added_token_text.get(token_id)
            if raw is not None and self._last_was_added and piece:
                piece = raw
            self._last_was_added = raw is not None
        if piece is None:
            return ""
        self._chunk_ids, self._pending_ids = self._pending_ids, []
        return piece


def _prompt_context(backend, prompt_token_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The shortest prompt suffix that decodes to whole, non-empty text.

    It must start on a character boundary (else its first character is U+FFFD)
    and hold some text (a lone skipped special token gives a decoder no
    context: SentencePiece would then drop the first generated token's space).
    """
    longest = min(len(prompt_token_ids), _MAX_CONTEXT_TOKENS)
    for length in range(1, longest + 1):
        suffix = prompt_token_ids[-length:]
        text = backend.decode(suffix, skip_special_tokens=skip_special_tokens)
        if text and "\ufffd" not in text:
            return suffix
    return prompt_token_ids[-longest:] if longest else []


class StopStringMatcher:
    """Finds stop strings in a stream of text deltas and says what may be shown.

    A stop string counts only where it ends inside the text pushed with
    ``can_stop=True`` (vLLM ignores stop strings before ``min_tokens``). The
    match that completes first wins, however the text was split into deltas.
    Without ``include_stop_str_in_output`` a tail that could be the start of a
    stop string is held back until it is decided (at most ``max(len(stop)) - 1``
    characters); with it nothing needs holding back.
    """

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        if any(not isinstance(stop, str) or not stop for stop in stops):
            raise InvalidRequestError("stop strings must be non-empty strings.", param="stop")
        self._stops = list(stops)
        self._include = include_stop_str_in_output
        self._lookback = max((len(stop) for stop in self._stops), default=1) - 1
        self._recent = ""  # last released chars, where a match may begin (include mode)
        self._held = ""  # unreleased text that may be the start of a stop string
        self.stop_string: Optional[str] = None  # the stop string that matched

    def push(self, text: str, can_stop: bool = True) -> str:
        """Feed the next text delta; return the text that may be released now."""
        if self.stop_string is not None:
            return ""
        if not self._stops:
            return text
        released = len(self._recent)
        window = self._recent + self._held + text
        if can_stop:
            match = self._first_match(window, new_chars=len(text))
            if match is not None:
                start, stop = match
                end = start + len(stop) if self._include else start
                self.stop_string, self._held = stop, ""
                return window[released:max(end, released)]
        keep = 0 if self._include else self._possible_stop_start(window, released)
        out = window[released:len(window) - keep]
        self._held = window[len(window) - keep:]
        self._recent = (self._recent + out)[-self._lookback:] if self._lookback else ""
        return out

    def flush(self) -> str:
        """At the end of the sequence: release the held-back tail (no stop followed)."""
        held, self._held = ("", "") if self.stop_string is not None else (self._held, "")
        return held

    def _first_match(self, window: str, new_chars: int) -> Optional[tuple[int, str]]:
        """(start, stop) of the match that ends first, the longer one on a tie."""
        best: Optional[tuple[int, str]] = None
        for stop in self._stops:
            # Matches ending before the new text were already ruled out.
            start = window.find(stop, max(0, len(window) - new_chars - len(stop) + 1))
            if start != -1 and (best is None or (start + len(stop), start) < (best[0] + len(best[1]), best[0])):
                best = (start, stop)
        return best

    def _possible_stop_start(self, window: str, released: int) -> int:
        """Length of the longest unreleased tail that is a proper prefix of a stop string."""
        keep = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(window) - released), keep, -1):
                if window.endswith(stop[:length]):
                    keep = length
                    break
        return keep
