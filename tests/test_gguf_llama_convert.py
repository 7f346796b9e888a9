"""The one-pass llama GGUF conversion (backend/models/gguf_llama_convert.py) writes the same bytes as
converting through transformers, and hands every file it does not cover to transformers; the
header reader (backend/models/gguf_file.py) reads what ``gguf.GGUFReader`` reads."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from test_loader import write_tiny_llama_gguf

from backend.models import conversion
from backend.models.gguf_file import GgufFormatError, read_gguf
from backend.models.gguf_llama_convert import one_pass_plan

gguf = pytest.importorskip("gguf")


def file_digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def both_ways(gguf_file: Path, tmp_path: Path) -> tuple[dict, dict]:
    """(the one-pass directory's files, the transformers path's) as name -> sha256."""
    one_pass, reference = tmp_path / "one-pass", tmp_path / "transformers"
    one_pass.mkdir()
    reference.mkdir()
    plan = one_pass_plan(gguf_file)
    assert plan is not None
    conversion.convert_gguf(gguf_file, one_pass)
    conversion.convert_gguf_with_transformers(gguf_file, reference)
    return file_digests(one_pass), file_digests(reference)


def quantized_linears(name: str):
    """Attention Q4_0, MLP Q4_1, the LM head Q8_0, layer 1's attn_v fp16; embedding and norms fp32."""
    if "norm" in name or name == "token_embd.weight":
        return None
    if name == "blk.1.attn_v.weight":
        return "F16"
    if name == "output.weight":
        return "Q8_0"
    return "Q4_0" if "attn_" in name else "Q4_1"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("types,untied", [(None, False), (quantized_linears, True), (quantized_linears, False)],
                         ids=["fp32-tied", "quantized-untied", "quantized-tied"])
def test_one_pass_writes_the_bytes_transformers_writes(tmp_path, types, untied):
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(gguf_file, types, untied=untied)
    mine, theirs = both_ways(gguf_file, tmp_path)
    assert set(mine) >= {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                         "tokenizer_config.json", "chat_template.jinja"}
    assert mine == theirs


@pytest.mark.timeout(300)
def test_one_pass_writes_the_bytes_transformers_writes_for_k_quants(tmp_path):
    from test_gguf_blocks import write_mixed_gguf  # Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1 rows of 256

    gguf_file = write_mixed_gguf(tmp_path / "tiny-mixed.gguf")
    mine, theirs = both_ways(gguf_file, tmp_path)
    assert mine == theirs


def test_files_the_one_pass_does_not_cover_go_to_transformers(tmp_path, monkeypatch):
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(gguf_file)
    assert one_pass_plan(gguf_file) is not None
    (tmp_path / "tokenizer_config.json").write_text("{}")  # could name another tokenizer class
    assert one_pass_plan(gguf_file) is None

    calls = []
    monkeypatch.setattr(conversion, "convert_gguf_with_transformers", lambda *args: calls.append(args))
    out = tmp_path / "out"
    conversion.convert_gguf(gguf_file, out)
    assert calls == [(gguf_file, out)]


def test_a_tensor_without_a_llama_name_is_not_converted_in_one_pass(tmp_path):
    # A GGUF of llama's tensors plus one it does not name (llama 3.1 files carry rope_freqs).
    source = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(source)
    reader = gguf.GGUFReader(str(source))
    extended = tmp_path / "extended.gguf"
    writer = gguf.GGUFWriter(str(extended), "llama")
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        value_type = field.types[0]
        value = field.contents()
        if value_type == gguf.GGUFValueType.ARRAY:
            writer.add_array(field.name, value)
        else:
            writer.add_key_value(field.name, value, value_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.add_tensor("rope_freqs.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_gguf(extended).tensors[-1].name == "rope_freqs.weight"
    assert one_pass_plan(extended) is None


def test_the_header_reader_reads_what_gguf_reads(tmp_path):
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(gguf_file, quantized_linears, untied=True)
    mine = read_gguf(gguf_file)
    theirs = gguf.GGUFReader(str(gguf_file))
    expected_metadata = {name: field.contents() for name, field in theirs.fields.items()
                         if not name.startswith("GGUF.")}
    assert mine.metadata == expected_metadata
    assert [t.name for t in mine.tensors] == [t.name for t in theirs.tensors]
    for tensor, reference in zip(mine.tensors, theirs.tensors):
        assert tensor.type_id == reference.tensor_type
        assert tensor.shape == tuple(int(d) for d in reversed(reference.shape))
        assert tensor.data.tobytes() == np.asarray(reference.data).tobytes(), tensor.name


@pytest.mark.parametrize("damage", ["not gguf", "cut short", "empty"])
def test_the_header_reader_refuses_what_is_not_a_whole_gguf(tmp_path, damage):
    whole = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(whole)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes({"not gguf": b"not a gguf file at all", "cut short": whole.read_bytes()[:5000],
                        "empty": b""}[damage])
    with pytest.raises(GgufFormatError):
        read_gguf(broken)
    assert one_pass_plan(broken) is None  # transformers then names the file in its error


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_default_model_converts_to_the_same_bytes_both_ways(tmp_path):
    from backend.models.default_model import download_default_gguf

    mine, theirs = both_ways(download_default_gguf(tmp_path / "download"), tmp_path)
    assert mine == theirs
