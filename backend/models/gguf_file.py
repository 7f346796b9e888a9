"""Reading a GGUF file's metadata and tensor table in one pass over its header, the tensor data
memory-mapped and left unread until used.

``gguf.GGUFReader`` builds a numpy view per field part, which for a 49k-token vocabulary and its
merges takes ~8 s on a 2-core machine; this reads the same values with ``struct`` in well under
a second. The layout (GGUF v2 and v3, little endian):

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:  key (string) | value type u32 | value
    tensors:   name (string) | n_dims u32 | dims u64[n_dims] (fastest-moving first) | type u32 | offset u64
    padding to ``general.alignment`` (default 32), then the tensor data; each offset counts from there

A string is a u64 byte length and UTF-8 bytes; an array is an element type u32, a count u64 and
the elements.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# The fixed-width value types: type id -> struct format.
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class GgufFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True)
class GgufTensor:
    name: str
    type_id: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # rows first (torch order): [N, K] for a weight of N rows of K
    data: np.ndarray  # [rows, bytes per row] uint8, a view of the file's memory map


@dataclass(frozen=True)
class GgufFile:
    metadata: dict[str, Any]  # key -> int | float | bool | str | list
    tensors: list[GgufTensor]  # in file order

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")


class _Cursor:
    """Reads little-endian values from a buffer, advancing an offset."""

    def __init__(self, buffer) -> None:
        self.buffer = buffer
        self.pos = 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        start, self.pos = self.pos, self.pos + length
        return bytes(self.buffer[start:self.pos]).decode("utf-8")

    def value(self, type_id: int):
        if type_id in SCALAR_FORMATS:
            return self.scalar(SCALAR_FORMATS[type_id])
        if type_id == STRING:
            return self.string()
        if type_id == ARRAY:
            element_type, count = self.scalar("I"), self.scalar("Q")
            if element_type in SCALAR_FORMATS:  # one unpack for the whole array
                fmt = SCALAR_FORMATS[element_type]
                values = list(struct.unpack_from(f"<{count}{fmt}", self.buffer, self.pos))
                self.pos += count * struct.calcsize(fmt)
                return values
            return [self.value(element_type) for _ in range(count)]
        raise GgufFormatError(f"unknown GGUF value type {type_id} at byte {self.pos}")


def read_gguf(path: Path) -> GgufFile:
    """The file's metadata and tensors (their data mapped, not read). Raises ``GgufFormatError``
    for a file that is not GGUF v2/v3, is cut short, or holds a tensor type gguf does not know."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as error:  # an empty file
            raise GgufFormatError(f"{path} is empty") from error
    cursor = _Cursor(mapped)
    try:
        if mapped[:4] != MAGIC:
            raise GgufFormatError(f"{path} does not start with {MAGIC!r}")
        cursor.pos = 4
        version, tensor_count, metadata_count = cursor.scalar("I"), cursor.scalar("Q"), cursor.scalar("Q")
        if version not in VERSIONS:
            raise GgufFormatError(f"{path} is GGUF version {version}; read are {VERSIONS}")
        metadata = {}
        for _ in range(metadata_count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.scalar("I"))
        table = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = [cursor.scalar("Q") for _ in range(cursor.scalar("I"))]
            table.append((name, tuple(reversed(dims)), cursor.scalar("I"), cursor.scalar("Q")))
    except (struct.error, UnicodeDecodeError) as error:
        raise GgufFormatError(f"{path}: a damaged or cut-short header ({error})") from error

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    data_start = -(-cursor.pos // alignment) * alignment
    whole = np.frombuffer(mapped, dtype=np.uint8)
    tensors = []
    for name, shape, type_id, offset in table:
        try:
            block_weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        except (ValueError, KeyError) as error:
            raise GgufFormatError(f"{path}: tensor {name} has unknown type {type_id}") from error
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        row_bytes = shape[-1] // block_weights * block_bytes
        begin = data_start + offset
        if shape[-1] % block_weights or begin + rows * row_bytes > len(whole):
            raise GgufFormatError(f"{path}: tensor {name} {shape} does not fit its type or the file")
        data = whole[begin:begin + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append(GgufTensor(name, type_id, shape, data))
    return GgufFile(metadata, tensors)
