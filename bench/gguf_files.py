"""GGUF files for the llama.cpp side of the benchmarks, written with the ``gguf`` package.

- ``write_gguf`` streams tensors into a file one at a time (a 1B model never sits in memory
  whole), every matrix in one number format, vectors (norms) in F32;
- ``reencode_gguf`` writes a copy of a GGUF file with every matrix dequantized and re-encoded in
  another format, so llama.cpp and Tandem serve numbers from the same weights;
- ``describe_gguf`` reads back what a file really holds (its file type and its tensors' types),
  which is what the benchmark tables are labelled with.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

import gguf
from gguf import GGMLQuantizationType, LlamaFileType

# The formats the benchmarks pair against Tandem's: name -> (tensor type, file type).
FORMATS = {
    "BF16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "Q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "Q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
}

# Keys a writer sets itself, or that would describe the source file rather than the copy.
_OWN_KEYS = ("GGUF.", "general.architecture", "general.file_type", "general.quantization_version")

# One tensor to write: (GGUF name, numpy shape (rows, cols) or (n,), a function giving its fp32 values).
TensorSource = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def write_gguf(path: Path, arch: str, metadata: Iterable[tuple[str, object, object, object]],
               tensors: list[TensorSource], fmt: str) -> Path:
    """Write ``tensors`` to ``path`` with every 2-D tensor in ``fmt`` (a ``FORMATS`` key) and
    every 1-D one in F32. ``metadata`` is (key, value, GGUFValueType, sub type or None) tuples.
    Each tensor's values are produced, encoded and written in turn; the file appears at ``path``
    only once complete."""
    qtype, file_type = FORMATS[fmt]
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch)
    for key, value, vtype, sub_type in metadata:
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, shape, _ in tensors:
        tensor_type = qtype if len(shape) == 2 else GGMLQuantizationType.F32
        if tensor_type == GGMLQuantizationType.F32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, tensor_type)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                                   raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape, values in tensors:
        data = np.ascontiguousarray(values(), dtype=np.float32)  # shape
        if data.shape != tuple(shape):
            raise ValueError(f"{name}: produced {data.shape}, declared {shape}")
        if len(shape) == 2:
            data = gguf.quants.quantize(data, qtype).view(np.uint8)
        writer.write_tensor_data(data)
    writer.close()
    os.replace(partial, path)
    return path


def copied_metadata(reader: gguf.GGUFReader, keep: Callable[[str], bool]) -> list[tuple]:
    """The key/value fields of ``reader`` that ``keep(key)`` accepts, as ``write_gguf`` takes them."""
    out = []
    for key, field in reader.fields.items():
        if key.startswith(_OWN_KEYS) or not keep(key):
            continue
        vtype = field.types[0]
        sub_type = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        out.append((key, value, vtype, sub_type))
    return out


def reencode_gguf(source: Path, dest: Path, fmt: str) -> Path:
    """``dest``: ``source`` with every matrix dequantized to fp32 and re-encoded as ``fmt``,
    vectors in F32, all metadata but the file type kept. Reuses ``dest`` when it exists."""
    if dest.exists():
        return dest
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()

    def dequantized(tensor) -> Callable[[], np.ndarray]:
        return lambda: gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(numpy_shape(tensor))

    tensors = [(t.name, numpy_shape(t), dequantized(t)) for t in reader.tensors]
    return write_gguf(dest, arch, copied_metadata(reader, lambda key: True), tensors, fmt)


def numpy_shape(tensor) -> tuple[int, ...]:
    """A reader tensor's logical shape in numpy order (GGUF lists dimensions innermost first)."""
    return tuple(int(d) for d in reversed(tensor.shape))


def describe_gguf(path: Path) -> dict:
    """What ``path`` holds: {"file_type": e.g. "MOSTLY_Q4_1", "tensor_types": {"Q4_1": 210, ...},
    "label": "MOSTLY_Q4_1 (Q4_1 x210, F32 x61, Q8_0 x1)", "bytes": file size}."""
    reader = gguf.GGUFReader(path)
    field = reader.fields.get("general.file_type")
    file_type = LlamaFileType(int(field.contents())).name if field is not None else "unknown"
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    parts = ", ".join(f"{name} x{n}" for name, n in counts.most_common())
    return {"file_type": file_type, "tensor_types": dict(counts), "label": f"{file_type} ({parts})",
            "bytes": path.stat().st_size}
