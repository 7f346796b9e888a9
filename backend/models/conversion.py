"""Converting checkpoints once into the cache: GGUF files into Hugging Face directories (and the
race-safe ``build_once`` that also converts slow tokenizers)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from backend.types.errors import ModelNotFoundError

# A converted directory is complete once its weights exist (they are written before the rename).
CONVERTED_MARKER = "model.safetensors"


def convert_gguf_once(gguf_file: Path, target: Path) -> Path:
    """``target``, a Hugging Face directory converted from ``gguf_file`` unless already there."""
    return build_once(target, lambda scratch: convert_gguf(gguf_file, scratch))


def build_once(target: Path, build: Callable[[Path], None], marker: str = CONVERTED_MARKER) -> Path:
    """Make ``target`` with ``build(scratch_dir)`` unless it is already complete (holds ``marker``).

    Safe when processes race: each builds its own scratch directory next to the target and
    renames it into place; whoever comes second finds the target taken and drops its copy.
    """
    if is_converted(target, marker):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    try:
        build(scratch)
        # mkdtemp makes the directory private and safetensors writes its file 0600; the cache is
        # shared like any download.
        scratch.chmod(0o755)
        for written in scratch.rglob("*"):
            written.chmod(0o755 if written.is_dir() else 0o644)
        try:
            os.rename(scratch, target)
        except OSError:
            # rename refuses a non-empty target: another process finished first.
            if not is_converted(target, marker):
                raise ModelNotFoundError(
                    f"{target} exists but is not a complete converted model; delete it and retry.")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # gone already after a successful rename
    return target


def is_converted(target: Path, marker: str = CONVERTED_MARKER) -> bool:
    return (target / marker).is_file()


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_file`` into ``out_dir`` as a plain fp32 Hugging Face directory: weights
    (model.safetensors), config.json, generation_config.json and the tokenizer with its chat
    template. A llama GGUF is converted in one pass (gguf_llama_convert.py, the same bytes in a
    fifth of the time), any other by loading it with transformers. Raises ``ModelNotFoundError``
    when neither can read the file."""
    from backend.models.gguf_llama_convert import convert_llama_gguf, one_pass_plan

    start = time.monotonic()
    plan = one_pass_plan(gguf_file)
    if plan is None:
        convert_gguf_with_transformers(gguf_file, out_dir)
        return
    announce(f"Converting {gguf_file.name} to a Hugging Face directory (once; one pass, ~10 s for a "
             "small model) ...")
    convert_llama_gguf(plan, gguf_file, out_dir, announce)
    announce(f"Converted {gguf_file.name} in {time.monotonic() - start:.0f} s.")


def convert_gguf_with_transformers(gguf_file: Path, out_dir: Path) -> None:
    """``convert_gguf`` by loading the whole model with transformers (any architecture it reads;
    ~50 s for SmolLM2-135M on 2 cores)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    announce(f"Converting {gguf_file.name} to a Hugging Face directory with transformers (once, "
             "~50 s for a small model) ...")
    start = time.monotonic()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except Exception as error:  # the GGUF reader fails in many ways; all mean "cannot use this file"
        raise ModelNotFoundError(
            f"Could not convert {gguf_file}: transformers cannot load it as a causal LM "
            f"({type(error).__name__}: {error}).") from error

    config = model.config
    state = model.state_dict()
    if config.tie_word_embeddings:
        # lm_head shares the embedding's storage, which safetensors refuses to save twice.
        state.pop("lm_head.weight", None)
    save_file({name: tensor.detach().contiguous() for name, tensor in state.items()},
              str(out_dir / CONVERTED_MARKER), metadata={"format": "pt"})

    # save_pretrained refuses a GGUF-loaded model, and the result is no longer quantized.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(out_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    # The GGUF tokenizer knows no length limit; the model's is the one that holds.
    max_length = getattr(config, "max_position_embeddings", None)
    if max_length:
        tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(str(out_dir))
    announce(f"Converted {gguf_file.name} in {time.monotonic() - start:.0f} s.")


def gguf_target(gguf_file: Path, cache_dir: Path) -> Path:
    # The key changes when the file is replaced or edited, so a stale conversion is never reused.
    stat = gguf_file.stat()
    key = f"{gguf_file}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir / "gguf" / f"{gguf_file.stem}-{digest}"


def announce(message: str) -> None:
    """A progress line for the person waiting (long one-time steps only)."""
    print(message, file=sys.stderr, flush=True)
