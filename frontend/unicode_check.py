"""Text from a client must be valid Unicode.

JSON can carry what no UTF-8 text can: a lone UTF-16 surrogate (``"\\ud800"``
not followed by a low surrogate), which Python's JSON parser keeps as a
character. Such a string cannot be tokenized (the tokenizers library takes only
UTF-8) nor written back in a response, so it is refused at the edge with a 400
naming the field, before any work.

``check_valid_unicode`` walks strings, lists and dicts (keys and values) of
any depth without recursion; other values (numbers, booleans, None, parsed
request models, whose own fields are checked when they are built) are passed.
"""

from __future__ import annotations

from typing import Any, Optional

from backend.types.errors import InvalidRequestError

# Elements a list of numbers holds: such a list (a prompt of token IDs) is passed in one C-level scan.
_SCALAR_TYPES = frozenset({int, float, bool, type(None)})


def first_lone_surrogate(text: str) -> Optional[int]:
    """The index of the first character of ``text`` that UTF-8 cannot encode, or None."""
    if text.isascii():  # O(1): CPython records it
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def find_invalid_unicode(value: Any) -> Optional[tuple[str, int, str]]:
    """Where ``value`` first holds a lone surrogate: (path below ``value`` such as
    ``[0].content``, character index, the character as ``U+D800``); None if nowhere."""
    # Each entry: (item, parent entry, key in the parent): the path is built only on a hit.
    stack: list[tuple[Any, Optional[tuple], Any]] = [(value, None, None)]
    while stack:
        entry = stack.pop()
        item = entry[0]
        if isinstance(item, str):
            index = first_lone_surrogate(item)
            if index is not None:
                return _path(entry), index, f"U+{ord(item[index]):04X}"
        elif isinstance(item, (list, tuple)):
            if set(map(type, item)) <= _SCALAR_TYPES:
                continue
            stack.extend((child, entry, i) for i, child in reversed(list(enumerate(item))))
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                index = first_lone_surrogate(key) if isinstance(key, str) else None
                if index is not None:  # the key itself: named by its place, not by its text
                    return _path(entry) + " (a key)", index, f"U+{ord(key[index]):04X}"
                stack.append((child, entry, key))
    return None


def _path(entry: tuple) -> str:
    parts = []
    while entry[1] is not None:
        key = entry[2]
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}" if isinstance(key, str) and key.isidentifier()
                     else f"[{key!r}]")
        entry = entry[1]
    return "".join(reversed(parts))


def check_valid_unicode(value: Any, name: str) -> None:
    """Raise ``InvalidRequestError`` (param ``name``) if any string in ``value`` holds a lone surrogate."""
    found = find_invalid_unicode(value)
    if found is not None:
        path, index, character = found
        raise InvalidRequestError(
            f"{name}{path} is not valid Unicode: it holds a lone UTF-16 surrogate ({character}) at character "
            f"{index}. Surrogates are only valid in pairs; send text as UTF-8 or as paired \\u escapes.",
            param=name)
