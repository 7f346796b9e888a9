"""Which files make up a tokenizer, and the fingerprint that identifies them.

Pure Python (no torch, no transformers): the backend sends these files over
GetTokenizer and reports their fingerprint in GetModelInfo; the frontend
computes the same fingerprint over its copy. One definition for both sides.
"""

from __future__ import annotations

import hashlib
import os

from backend.types.errors import ModelNotFoundError

# Files that define how text maps to token IDs and how chats are rendered.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)


def tokenizer_file_names(tokenizer_dir: str) -> list[str]:
    """The tokenizer files present in ``tokenizer_dir``, sorted by name (= by UTF-8 bytes).

    Raises ``ModelNotFoundError`` when there are none.
    """
    present = sorted(name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, name)))
    if not present:
        raise ModelNotFoundError(
            f"No tokenizer files in {tokenizer_dir!r} (looked for {', '.join(TOKENIZER_FILES)}).")
    return present


def tokenizer_fingerprint(tokenizer_dir: str) -> str:
    """sha256 (hex) over each tokenizer file, in name order: name, 0x00, size (8 bytes little-endian), bytes.

    Two processes with equal fingerprints map text to the same token IDs and
    render chats alike. engine.proto (GetModelInfoResponse.tokenizer_fingerprint)
    states the same algorithm for clients in other languages.
    """
    digest = hashlib.sha256()
    for name in tokenizer_file_names(tokenizer_dir):
        with open(os.path.join(tokenizer_dir, name), "rb") as f:
            data = f.read()
        # Name and length first, so no two file sets hash the same bytes.
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()
