"""The 1B-class benchmark model: Llama-3.2-1B's shape with seeded random weights, for both engines.

From one tensor set (tensor i is drawn from a generator seeded with (seed, i), rounded to bf16)
this writes

- ``OUT/hf/``: a Hugging Face directory for Tandem (config.json, bf16 safetensors shards with
  their index, and the default model's tokenizer files), and
- ``OUT/bench-1b.{BF16,Q8_0,Q4_0,Q4_1}.gguf`` for llama.cpp: the same values, every matrix in
  that format (Q/K rows permuted into GGUF's rotary layout, so both compute the same function),
  with the default model's tokenizer in the metadata, as llama.cpp needs it;
- ``OUT/bench-1b.Q4_K_M.gguf`` on request: the BF16 file quantized by llama.cpp's own
  ``llama-quantize`` (the ``gguf`` package cannot write K-quants; ``bench/build_llamacpp.sh``
  builds the tool beside the server, where ``--llama-quantize`` looks by default).

Dimensions come from ``bench/configs/llama-3.2-1b.json`` (hidden 2048, 16 layers, 32 query / 8 KV
heads, intermediate 8192, tied embeddings) with three changes: the vocabulary is the default
model's 49,152 tokens (so both engines tokenize alike; ~1.0 B parameters instead of 1.24 B),
``max_position_embeddings`` is 8192 and the rope is plain (Llama 3's scaling would need
``rope_freqs`` in the GGUF). The weights are noise: benchmarks use ``ignore_eos`` and fixed
lengths, so only the speed means anything. Files already there are kept (``--force`` rewrites).

    python bench/make_bench_model.py --out ~/.cache/tandem/bench/bench-1b
    python bench/make_bench_model.py --out ~/.cache/tandem/bench/bench-1b --formats Q4_K_M
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

# Run as a script, bench/ is sys.path[0]: the repository's root goes there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.gguf_files import FORMATS, TensorSource, copied_metadata, write_gguf  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "llama-3.2-1b.json"
GGUF_STEM = "bench-1b"
K_QUANTS = ("Q4_K_M",)  # written by llama-quantize from the BF16 file
# Where bench/build_llamacpp.sh puts it (same environment variables).
DEFAULT_LLAMA_QUANTIZE = (
    Path(os.environ.get("TANDEM_BENCH_CACHE", Path.home() / ".cache" / "tandem" / "bench"))
    / f"llama.cpp-{os.environ.get('LLAMA_CPP_PYTHON_VERSION', '0.3.36')}-native" / "llama-quantize")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def bench_config(base: dict, vocab_size: int, bos: int, eos: int) -> dict:
    """``base`` (a Llama config) with the default model's vocabulary, 8k positions, plain rope."""
    config = {k: v for k, v in base.items() if k != "rope_scaling"}
    config.update(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, max_position_embeddings=8192,
                  tie_word_embeddings=True, torch_dtype="bfloat16")
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return config


def tensor_plan(config: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(HF name, GGUF name, numpy shape) of every tensor, in the order they are drawn."""
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_rows, kv_rows = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    plan = [("model.embed_tokens.weight", "token_embd.weight", (config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        plan += [(hf + "input_layernorm.weight", gg + "attn_norm.weight", (hidden,)),
                 (hf + "self_attn.q_proj.weight", gg + "attn_q.weight", (q_rows, hidden)),
                 (hf + "self_attn.k_proj.weight", gg + "attn_k.weight", (kv_rows, hidden)),
                 (hf + "self_attn.v_proj.weight", gg + "attn_v.weight", (kv_rows, hidden)),
                 (hf + "self_attn.o_proj.weight", gg + "attn_output.weight", (hidden, q_rows)),
                 (hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight", (hidden,)),
                 (hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight", (inter, hidden)),
                 (hf + "mlp.up_proj.weight", gg + "ffn_up.weight", (inter, hidden)),
                 (hf + "mlp.down_proj.weight", gg + "ffn_down.weight", (hidden, inter))]
    return plan + [("model.norm.weight", "output_norm.weight", (hidden,))]


def draw(seed: int, index: int, shape: tuple[int, ...], std: float):
    """Tensor ``index`` of the set: norms are ones, matrices N(0, std), rounded to bf16."""
    import torch

    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return (torch.randn(shape, generator=generator) * std).to(torch.bfloat16)


def to_gguf_rotary_layout(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Q/K rows of HF's rotary layout (each head's first half rotates with its second half) in
    GGUF's (adjacent pairs rotate together): per head, row j of each half becomes row 2j / 2j+1."""
    rows, cols = weight.shape
    halves = weight.reshape(num_heads, 2, rows // num_heads // 2, cols)  # [head, half, j, in]
    return halves.swapaxes(1, 2).reshape(rows, cols)  # [head, j, half, in] -> rows


def write_hf(out: Path, config: dict, seed: int, tokenizer_dir: Path) -> None:
    """``out``: config.json, one safetensors shard per layer (plus embeddings, final norm), index."""
    from safetensors.torch import save_file

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    plan = tensor_plan(config)
    shard_of = [0] + [1 + i // 9 for i in range(len(plan) - 2)] + [config["num_hidden_layers"]]
    num_shards = shard_of[-1] + 1
    weight_map = {}
    for shard in range(num_shards):
        name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        tensors = {hf: draw(seed, i, shape, config["initializer_range"])
                   for i, (hf, _, shape) in enumerate(plan) if shard_of[i] == shard}
        save_file(tensors, str(partial / name), metadata={"format": "pt"})
        weight_map.update({hf: name for hf in tensors})
    (partial / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).exists():
            shutil.copy(tokenizer_dir / file, partial / file)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)


def gguf_metadata(config: dict, tokenizer_gguf: Path) -> list[tuple]:
    import gguf

    v = gguf.GGUFValueType
    arch = "llama"
    own = [("general.name", "tandem-bench-1b (random weights)", v.STRING),
           (f"{arch}.context_length", config["max_position_embeddings"], v.UINT32),
           (f"{arch}.embedding_length", config["hidden_size"], v.UINT32),
           (f"{arch}.block_count", config["num_hidden_layers"], v.UINT32),
           (f"{arch}.feed_forward_length", config["intermediate_size"], v.UINT32),
           (f"{arch}.attention.head_count", config["num_attention_heads"], v.UINT32),
           (f"{arch}.attention.head_count_kv", config["num_key_value_heads"], v.UINT32),
           (f"{arch}.attention.key_length", config["head_dim"], v.UINT32),
           (f"{arch}.attention.value_length", config["head_dim"], v.UINT32),
           (f"{arch}.rope.dimension_count", config["head_dim"], v.UINT32),
           (f"{arch}.rope.freq_base", float(config["rope_theta"]), v.FLOAT32),
           (f"{arch}.attention.layer_norm_rms_epsilon", float(config["rms_norm_eps"]), v.FLOAT32),
           (f"{arch}.vocab_size", config["vocab_size"], v.UINT32)]
    tokenizer = copied_metadata(gguf.GGUFReader(tokenizer_gguf), lambda key: key.startswith("tokenizer."))
    return [(key, value, vtype, None) for key, value, vtype in own] + tokenizer


def write_gguf_file(path: Path, config: dict, seed: int, fmt: str, metadata: list[tuple]) -> None:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    def source(i: int, hf: str, shape: tuple[int, ...]):
        def values() -> np.ndarray:
            w = draw(seed, i, shape, config["initializer_range"]).float().numpy()
            if hf.endswith("q_proj.weight"):
                return to_gguf_rotary_layout(w, heads)
            if hf.endswith("k_proj.weight"):
                return to_gguf_rotary_layout(w, kv_heads)
            return w
        return values

    tensors: list[TensorSource] = [(gg, shape, source(i, hf, shape))
                                   for i, (hf, gg, shape) in enumerate(tensor_plan(config))]
    write_gguf(path, "llama", metadata, tensors, fmt)


def quantize(tool: Path, source: Path, path: Path, fmt: str) -> None:
    """``path``: ``source`` quantized to ``fmt`` by llama.cpp's ``llama-quantize``; it appears only
    once complete."""
    partial = path.with_name(path.name + ".partial")
    done = subprocess.run([str(tool), str(source), str(partial), fmt], capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize failed ({done.returncode}): {done.stderr[-2000:]}")
    partial.rename(path)


def default_tokenizer_sources(work: Path) -> tuple[Path, Path]:
    """(the converted default model's directory, the default model's GGUF file): the tokenizer
    both engines use, as Tandem's files and as GGUF metadata."""
    from backend.models.default_model import download_default_gguf
    from backend.models.loader import resolve_model
    from backend.types.config import EngineConfig

    return resolve_model(None, cache_dir=EngineConfig().cache_dir), download_default_gguf(work)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a Llama config.json to take the shape from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help=f"GGUF formats, of {', '.join([*FORMATS, *K_QUANTS])} (default: all but K-quants)")
    parser.add_argument("--llama-quantize", type=Path, default=DEFAULT_LLAMA_QUANTIZE,
                        help="llama.cpp's quantizer, for K-quant formats (bench/build_llamacpp.sh builds it)")
    parser.add_argument("--force", action="store_true", help="rewrite files that exist")
    args = parser.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in FORMATS and f not in K_QUANTS]
    if unknown:
        parser.error(f"unknown --formats {unknown}; known: {', '.join([*FORMATS, *K_QUANTS])}")
    if any(f in K_QUANTS for f in formats) and not args.llama_quantize.is_file():
        parser.error(f"{args.llama_quantize} does not exist: run bench/build_llamacpp.sh, or pass --llama-quantize "
                     "(from bench/peers.py: --llama-server, with llama-quantize in its folder)")

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir, tokenizer_gguf = default_tokenizer_sources(args.out / ".tokenizer")
    base_tokenizer = json.loads((tokenizer_dir / "config.json").read_text())
    config = bench_config(json.loads(args.config.read_text()), base_tokenizer["vocab_size"],
                          base_tokenizer.get("bos_token_id", 1), base_tokenizer.get("eos_token_id", 2))
    params = sum(int(np.prod(shape)) for _, _, shape in tensor_plan(config))
    print(f"{params / 1e9:.3f} B parameters (embeddings tied), seed {args.seed}", flush=True)

    hf_dir = args.out / "hf"
    if args.force or not (hf_dir / "model.safetensors.index.json").exists():
        write_hf(hf_dir, config, args.seed, tokenizer_dir)
    print(hf_dir, flush=True)
    metadata = gguf_metadata(config, tokenizer_gguf)
    for fmt in sorted(formats, key=lambda f: f in K_QUANTS):  # BF16 before the K-quants made from it
        path = args.out / f"{GGUF_STEM}.{fmt}.gguf"
        if fmt in K_QUANTS and (args.force or not path.exists()):
            source = args.out / f"{GGUF_STEM}.BF16.gguf"
            if not source.exists() or (args.force and "BF16" not in formats):  # not rewritten above
                write_gguf_file(source, config, args.seed, "BF16", metadata)
            quantize(args.llama_quantize, source, path, fmt)
        elif args.force or not path.exists():
            write_gguf_file(path, config, args.seed, fmt, metadata)
        print(path, flush=True)
    shutil.rmtree(args.out / ".tokenizer", ignore_errors=True)


if __name__ == "__main__":
    main()
