"""vLLM's legacy guided decoding fields as aliases of ``structured_outputs``.

Clients written for vLLM <= 0.10 send ``guided_json``, ``guided_regex``, ``guided_choice`` or
``guided_grammar`` (and ``guided_decoding_backend``). Each is the ``structured_outputs`` entry of the
same kind (``fold_legacy_guided``); the response then carries a ``Deprecation`` header
(``deprecation_headers``) and the server logs a warning once per field. A request may name one
constraint only: two guided fields, or one beside ``structured_outputs`` or ``response_format``,
are a 400 naming both.
"""

from __future__ import annotations

import logging

from backend.types.errors import InvalidRequestError
from backend.types.sampling_params import StructuredOutputsParams
from frontend import protocol as P

logger = logging.getLogger(__name__)

# Legacy field -> the structured_outputs entry it stands for.
GUIDED_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar"}
LEGACY_FIELDS = (*GUIDED_KINDS, "guided_decoding_backend")
# guided_decoding_backend: Tandem compiles every grammar with xgrammar; "auto" picks it too.
BACKENDS = ("auto", "xgrammar")
# vLLM's backend options ("xgrammar:disable-any-whitespace,no-fallback") -> structured_outputs flags.
BACKEND_OPTIONS = {"disable-any-whitespace": "disable_any_whitespace", "no-fallback": "disable_fallback"}
# RFC 9745's header, in the form most clients test for (its presence).
DEPRECATION_HEADER = "Deprecation"

_warned: set[str] = set()


def legacy_fields(request: P.SamplingFields) -> list[str]:
    """The legacy fields the request sets, in declaration order."""
    return [name for name in LEGACY_FIELDS if getattr(request, name, None) is not None]


def deprecation_headers(request: P.SamplingFields) -> dict[str, str]:
    """The response headers of a request that used legacy fields (none otherwise)."""
    return {DEPRECATION_HEADER: "true"} if legacy_fields(request) else {}


def _backend_options(value: str) -> dict[str, bool]:
    """``guided_decoding_backend`` -> the structured_outputs flags its options set; 400 for
    another backend or an unknown option."""
    name, _, options = value.partition(":")
    if name.strip() not in BACKENDS:
        raise InvalidRequestError(
            f"guided_decoding_backend {value!r} is not available: this server compiles grammars with xgrammar "
            f"only (give one of {', '.join(BACKENDS)}, or leave guided_decoding_backend out).",
            param="guided_decoding_backend")
    flags: dict[str, bool] = {}
    for option in filter(None, (o.strip() for o in options.split(","))):
        if option not in BACKEND_OPTIONS:
            raise InvalidRequestError(f"guided_decoding_backend option {option!r} is not supported (supported: "
                                      f"{', '.join(BACKEND_OPTIONS)}).", param="guided_decoding_backend")
        flags[BACKEND_OPTIONS[option]] = True
    return flags


def fold_legacy_guided(request: P.SamplingFields) -> None:
    """Set ``request.structured_outputs`` from its legacy guided fields, checked as structured_outputs
    is (errors name the legacy field). Does nothing for a request without them."""
    used = legacy_fields(request)
    if not used:
        return
    for name in used:
        if name not in _warned:
            _warned.add(name)
            logger.warning("A request used %s, vLLM's deprecated guided decoding field; use structured_outputs "
                           "instead (logged once per field).", name)
    given = [name for name in GUIDED_KINDS if name in used]
    backend = request.guided_decoding_backend
    flags = _backend_options(backend) if backend is not None else {}
    if len(given) > 1:
        raise InvalidRequestError(f"Give one of {' and '.join(given)}, not several: each is a constraint of its own.",
                                  param=given[0])
    if not given:
        if flags:
            raise InvalidRequestError("guided_decoding_backend options apply only with guided_json, guided_regex, "
                                      "guided_choice or guided_grammar; use structured_outputs' own flags.",
                                      param="guided_decoding_backend")
        return
    name = given[0]
    for other in ("structured_outputs", "response_format"):
        if getattr(request, other) is not None:
            raise InvalidRequestError(f"Give {name} (the legacy name of structured_outputs.{GUIDED_KINDS[name]}) or "
                                      f"{other}, not both.", param=name)
    entry = {GUIDED_KINDS[name]: getattr(request, name), **flags}
    try:
        StructuredOutputsParams.coerce(entry)  # its checks, under the name the client used
    except InvalidRequestError as error:
        message = error.message.replace(f"structured_outputs.{GUIDED_KINDS[name]}", name)
        raise InvalidRequestError(message, param=name) from None
    request.structured_outputs = P.StructuredOutputsRequest.model_validate(entry)
