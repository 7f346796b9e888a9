"""bench/make_bench_model.py on a tiny Llama shape: the Hugging Face directory serves in Tandem, the
GGUF files hold the same tensors in the formats they are named after, and bench/gguf_files.py
re-encodes and describes GGUF files truthfully."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from bench import make_bench_model  # noqa: E402
from bench.gguf_files import describe_gguf, reencode_gguf  # noqa: E402

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 32.0},
        "initializer_range": 0.02, "tie_word_embeddings": True}
FORMATS = ("BF16", "Q8_0", "Q4_0", "Q4_1")


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory, default_model_dir) -> Path:
    out = tmp_path_factory.mktemp("bench-model")
    config = out / "tiny.json"
    config.write_text(json.dumps(TINY))
    make_bench_model.main(["--out", str(out), "--config", str(config), "--seed", "3"])
    return out


def test_config_is_the_default_models_vocabulary_with_plain_rope(bench_model, default_model_dir):
    config = json.loads((bench_model / "hf" / "config.json").read_text())
    default = json.loads((default_model_dir / "config.json").read_text())
    assert config["vocab_size"] == default["vocab_size"] == 49152
    assert "rope_scaling" not in config and config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True and config["hidden_size"] == 64
    assert (bench_model / "hf" / "tokenizer.json").read_bytes() == (default_model_dir / "tokenizer.json").read_bytes()


def test_gguf_files_hold_the_named_formats_and_the_tokenizer(bench_model):
    for fmt in FORMATS:
        path = bench_model / f"bench-1b.{fmt}.gguf"
        reader = gguf.GGUFReader(path)
        matrices = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
        vectors = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 1}
        assert matrices == {fmt} and vectors == {"F32"}, path
        assert len(reader.tensors) == 1 + 2 * 9 + 1  # embeddings (tied: no output.weight), layers, norm
        assert len(reader.fields["tokenizer.ggml.tokens"].data) == 49152
        assert describe_gguf(path)["file_type"] == f"MOSTLY_{fmt}"


def test_bf16_gguf_is_the_safetensors_bit_for_bit(bench_model):
    """transformers reads the GGUF back (undoing the rotary row order): the same tensors."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(bench_model / "hf"), dtype=torch.float32).state_dict()
    back = AutoModelForCausalLM.from_pretrained(str(bench_model), gguf_file="bench-1b.BF16.gguf",
                                                dtype=torch.float32).state_dict()
    assert hf.keys() == back.keys()
    for name in hf:
        assert torch.equal(hf[name], back[name]), name
    assert hf["model.layers.0.self_attn.q_proj.weight"].std() > 0.01  # noise, not zeros


def test_tandem_serves_the_hf_directory(bench_model):
    from frontend import LLM, SamplingParams

    llm = LLM(model=str(bench_model / "hf"), dtype="float32", max_model_len=256, num_kv_blocks=64)
    try:
        out = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert len(out.token_ids) == 6 and all(0 <= t < 49152 for t in out.token_ids)


def test_reencode_keeps_values_within_the_formats_error(bench_model, tmp_path):
    source = bench_model / "bench-1b.BF16.gguf"
    copy = reencode_gguf(source, tmp_path / "copy.Q8_0.gguf", "Q8_0")
    assert describe_gguf(copy)["tensor_types"] == {"Q8_0": 15, "F32": 5}
    a = {t.name: t for t in gguf.GGUFReader(source).tensors}
    b = {t.name: t for t in gguf.GGUFReader(copy).tensors}
    assert a.keys() == b.keys()
    x = gguf.quants.dequantize(a["blk.1.ffn_up.weight"].data, a["blk.1.ffn_up.weight"].tensor_type)
    y = gguf.quants.dequantize(b["blk.1.ffn_up.weight"].data, b["blk.1.ffn_up.weight"].tensor_type)
    assert x.shape == y.shape and np.abs(x - y).max() <= np.abs(x).max() / 127
    assert gguf.GGUFReader(copy).fields["tokenizer.ggml.pre"].contents() == "smollm"


def test_llamacpp_wheel_serves_the_q8_gguf(bench_model, tmp_path):
    import httpx
    import xllamacpp  # noqa: F401 -- a test dependency: missing, the test fails rather than skips

    from bench import llamacpp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = llamacpp.tuned_settings(1, 64, threads=1)
    argv = llamacpp.server_argv(llamacpp.XLLAMACPP, bench_model / "bench-1b.Q8_0.gguf", port, settings,
                                tmp_path / "params.json")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, reply = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                                   json={"prompt": "Hello there", "max_tokens": 4, "ignore_eos": True})
                if reply.status_code != 503:  # 503: still loading the model
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    finally:
        proc.kill()
        proc.wait()
    assert reply is not None and reply.status_code == 200, reply
    assert reply.json()["usage"]["completion_tokens"] == 4
    params = json.loads((tmp_path / "params.json").read_text())
    assert params["params"]["n_parallel"] == 1 and params["cpuparams"]["n_threads"] == 1
    assert sys.executable == argv[0]


FAKE_QUANTIZE = """#!{python}
import shutil, sys
with open(sys.argv[0] + ".log", "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[3] != "Q4_K_M":
    sys.exit("unknown type")
shutil.copyfile(sys.argv[1], sys.argv[2])
"""


def test_k_quants_come_from_the_bf16_file_through_llama_quantize(bench_model, tmp_path):
    """Q4_K_M: the BF16 file handed to llama-quantize (here a stand-in that copies it and logs its
    arguments), its output written under a partial name and renamed once complete; a missing tool
    is refused before anything is written, and a failing one leaves no file."""
    tool = tmp_path / "llama-quantize"
    tool.write_text(FAKE_QUANTIZE.format(python=sys.executable))
    tool.chmod(0o755)
    config = bench_model / "tiny.json"
    common = ["--out", str(bench_model), "--config", str(config), "--seed", "3"]
    with pytest.raises(SystemExit):
        make_bench_model.main([*common, "--formats", "Q4_K_M", "--llama-quantize", str(tmp_path / "absent")])
    assert not (bench_model / "bench-1b.Q4_K_M.gguf").exists()

    make_bench_model.main([*common, "--formats", "Q4_K_M", "--llama-quantize", str(tool)])
    bf16, q4k = bench_model / "bench-1b.BF16.gguf", bench_model / "bench-1b.Q4_K_M.gguf"
    assert q4k.read_bytes() == bf16.read_bytes()
    assert Path(f"{tool}.log").read_text().split() == [str(bf16), f"{q4k}.partial", "Q4_K_M"]

    q4k.unlink()
    tool.write_text(FAKE_QUANTIZE.format(python=sys.executable).replace('"Q4_K_M"', '"none"'))
    with pytest.raises(RuntimeError, match="llama-quantize failed"):
        make_bench_model.main([*common, "--formats", "Q4_K_M", "--llama-quantize", str(tool)])
    assert not q4k.exists() and not Path(f"{q4k}.partial").exists()
