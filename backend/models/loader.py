"""Finding a checkpoint and reading it: ``model=`` -> a local Hugging Face-format directory -> tensors.

``resolve_model`` accepts what vLLM's ``model=`` accepts, and a GGUF file:

- ``None``: the default model (see default_model.py), fetched and converted once;
- an existing directory: used as is (it must hold config.json);
- a ``.gguf`` file: dequantized once into a plain fp32 directory under the cache;
- ``org/name``: a Hugging Face Hub repo, from the local HF cache first, else downloaded.

Every conversion is built in a scratch directory next to its target and renamed into place, so a
complete target is the only thing other processes can ever see, and racing processes are safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

from backend.models.conversion import announce, build_once, convert_gguf_once, gguf_target
from backend.types.errors import ModelNotFoundError
from backend.types.startup_log import log_phase

if TYPE_CHECKING:  # torch and transformers load only when a model does
    import torch
    from transformers import PretrainedConfig

HOW_TO_POINT_AT_A_CHECKPOINT = (
    "Pass model= a local Hugging Face model directory (config.json, *.safetensors weights, "
    "tokenizer files), a .gguf file, or leave model unset for the default model "
    "SmolLM2-135M-Instruct."
)

# Everything an engine needs from a hub repo except the weights, whose format is chosen separately.
HUB_NON_WEIGHT_PATTERNS = ["*.json", "tokenizer*", "*.model", "*.txt", "*.jinja"]
SAFETENSORS_PATTERN = "*.safetensors"
PYTORCH_BIN_PATTERN = "pytorch_model*.bin"

logger = logging.getLogger(__name__)


def resolve_model(model: Optional[str], cache_dir: Path, revision: Optional[str] = None) -> Path:
    """Return a local Hugging Face-format directory (config.json, weights, tokenizer files incl.
    chat template) for ``model``. Raises ``ModelNotFoundError`` naming what is missing. Logs the
    ``model`` start-up phase (backend/types/startup_log.py)."""
    start = time.monotonic()
    path = _resolve_model(model, Path(cache_dir).expanduser(), revision)
    log_phase(logger, "model", f"{model or 'the default model'} in {path}", time.monotonic() - start)
    return path


def _resolve_model(model: Optional[str], cache_dir: Path, revision: Optional[str]) -> Path:
    if model is None:
        from backend.models.default_model import default_model_dir

        return default_model_dir(cache_dir)

    path = Path(model).expanduser()
    if path.is_dir():
        return checked_model_dir(path.resolve())
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf_once(path.resolve(), gguf_target(path.resolve(), cache_dir))
    if path.exists():
        raise ModelNotFoundError(
            f"model={model!r} is a file but neither a model directory nor a .gguf file. "
            f"{HOW_TO_POINT_AT_A_CHECKPOINT}")
    if _looks_like_a_path(model):
        what = "file" if path.suffix.lower() == ".gguf" else "directory"
        raise ModelNotFoundError(
            f"model={model!r}: no such {what} ({path.absolute()}). {HOW_TO_POINT_AT_A_CHECKPOINT}")
    return _from_hub(model, revision)


def checked_model_dir(path: Path) -> Path:
    """``path`` if it is a Hugging Face model directory, else ``ModelNotFoundError``."""
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"{path} has no config.json, so it is not a Hugging Face model directory. "
            f"{HOW_TO_POINT_AT_A_CHECKPOINT}")
    return path


def load_hf_config(model_path: Path) -> PretrainedConfig:
    """The checkpoint's ``transformers.PretrainedConfig`` (from its config.json)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_path))
    except (OSError, ValueError, KeyError) as error:
        # OSError: unreadable file; ValueError/KeyError: malformed JSON or an unknown model_type.
        raise ModelNotFoundError(
            f"Could not read the model config in {model_path}: {error}") from error


class PlainModelConfig:
    """A transformers config reduced to its values (aliases included), for worker processes.

    Unpickling a transformers config imports transformers, which costs each worker process
    seconds; this pickles as plain Python values. Anything it lacks (a method, a computed
    property) is looked up on the real config, loaded from the checkpoint on first use.
    """

    def __init__(self, hf_config: PretrainedConfig, model_path: Path) -> None:
        values = dict(vars(hf_config))
        for alias, target in getattr(type(hf_config), "attribute_map", {}).items():
            values[alias] = getattr(hf_config, target, None)
        self.__dict__.update(values)
        self._model_path = model_path
        self._real: Optional[PretrainedConfig] = None

    def real(self) -> PretrainedConfig:
        if self._real is None:
            self._real = load_hf_config(self._model_path)
        return self._real

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_real", "_model_path"):  # e.g. while unpickling
            raise AttributeError(name)
        return getattr(self.real(), name)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_real": None}


def transformers_config(config) -> PretrainedConfig:
    """The transformers object behind ``config`` (itself unless it is a PlainModelConfig)."""
    return config.real() if isinstance(config, PlainModelConfig) else config


def weight_files(model_path: Path) -> list[Path]:
    """The checkpoint's weight files in load order: *.safetensors, else pytorch_model*.bin.

    When an index file exists, only the files it names count: some repos also ship the same
    weights in another layout (e.g. consolidated.safetensors), which must not be loaded twice.
    """
    for pattern, index_name in ((SAFETENSORS_PATTERN, "model.safetensors.index.json"),
                                (PYTORCH_BIN_PATTERN, "pytorch_model.bin.index.json")):
        index = model_path / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [model_path / name for name in sorted(set(weight_map.values()))]
        files = sorted(model_path.glob(pattern))
        if files:
            return files
    return []


def iter_weights(model_path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint by its checkpoint name, as a view of the memory-mapped file.

    Nothing is read until a tensor's elements are: a tensor-parallel rank that copies its slice
    reads only that slice's pages, and a pipeline stage never reads the other stages' layers.
    """
    files = weight_files(model_path)
    if not files:
        raise ModelNotFoundError(
            f"{model_path} holds no weights: expected *.safetensors or pytorch_model*.bin files.")
    if files[0].suffix == ".safetensors":
        for file in files:
            yield from mapped_safetensors(file)
    else:
        import torch

        for file in files:
            # mmap: tensors are paged in as the model copies them, not all read up front.
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            del state


def mapped_safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a .safetensors file as views of one copy-on-write memory map of it.

    The format: an 8-byte little-endian header length, a JSON header mapping each name to its
    dtype, shape and [begin, end) byte offsets in the data that follows.
    """
    import mmap
    import struct

    import torch

    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in dtypes:
            raise ModelNotFoundError(f"{file}: tensor {name!r} has dtype {info['dtype']}, "
                                     "which Tandem does not load.")
        dtype, (begin, end) = dtypes[info["dtype"]], info["data_offsets"]
        offset, count = 8 + header_len + begin, (end - begin) // dtype.itemsize
        if count == 0:
            tensor = torch.empty(info["shape"], dtype=dtype)
        elif offset % dtype.itemsize:  # unaligned (after an odd-sized tensor): copy it out
            tensor = torch.frombuffer(bytearray(data[offset:offset + end - begin]), dtype=dtype)
        else:  # the tensor keeps the map alive
            tensor = torch.frombuffer(data, dtype=dtype, count=count, offset=offset)
        yield name, tensor.view(info["shape"])


# --- tokenizer ------------------------------------------------------------------------------------

FAST_TOKENIZER_FILE = "tokenizer.json"
SLOW_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")


def resolve_tokenizer(tokenizer: Optional[str], model_path: Path, cache_dir: Path) -> Path:
    """A directory holding a fast tokenizer (tokenizer.json) for the model.

    ``tokenizer`` (a local directory) overrides the model's own files. Checkpoints that ship
    only slow-tokenizer files (OPT's vocab.json + merges.txt, a SentencePiece model) are
    converted once into the cache, so the torch-free frontend can load them.
    """
    source = Path(tokenizer).expanduser() if tokenizer else Path(model_path)
    if not source.is_dir():
        raise ModelNotFoundError(f"Tokenizer directory {str(source)!r}: no such directory.")
    if (source / FAST_TOKENIZER_FILE).is_file():
        return source
    if not any((source / name).is_file() for name in SLOW_TOKENIZER_FILES):
        raise ModelNotFoundError(
            f"{source} has no tokenizer files ({FAST_TOKENIZER_FILE} or "
            f"{', '.join(SLOW_TOKENIZER_FILES)}); pass tokenizer= a directory that has them.")
    digest = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]
    target = Path(cache_dir) / "tokenizers" / f"{source.name}-{digest}"

    def convert(scratch: Path) -> None:
        from transformers import AutoTokenizer

        announce(f"Converting the tokenizer of {source} to tokenizer.json (once) ...")
        AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(scratch))

    return build_once(target, convert, marker=FAST_TOKENIZER_FILE)


# --- Hugging Face Hub ----------------------------------------------------------------------------


def _looks_like_a_path(model: str) -> bool:
    # A hub repo id is "name" or "org/name"; anything else can only have meant a local path.
    return (model.startswith(("/", ".", "~")) or model.endswith("/")
            or model.count("/") > 1 or "\\" in model or model.lower().endswith(".gguf"))


def _from_hub(repo_id: str, revision: Optional[str]) -> Path:
    """The repo's snapshot directory: from the local HF cache, else downloaded (unless offline)."""
    from huggingface_hub.errors import HFValidationError

    cache_dir = _hf_hub_cache()
    try:
        return _hub_snapshot(repo_id, revision, cache_dir, local_files_only=True)
    except HFValidationError as error:
        raise ModelNotFoundError(
            f"model={repo_id!r} is neither an existing path nor a valid Hugging Face repo id "
            f"({error}). {HOW_TO_POINT_AT_A_CHECKPOINT}") from error
    except (OSError, ValueError) as error:  # not (fully) in the local cache
        cache_miss = error
    if _hub_offline():
        raise ModelNotFoundError(
            f"model={repo_id!r} is not in the local Hugging Face cache ({cache_dir}) and "
            f"HF_HUB_OFFLINE is set, so it cannot be downloaded. {HOW_TO_POINT_AT_A_CHECKPOINT}"
        ) from cache_miss
    try:
        return _hub_snapshot(repo_id, revision, cache_dir, local_files_only=False)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelNotFoundError(
            f"model={repo_id!r} is not in the local Hugging Face cache ({cache_dir}) and could "
            f"not be downloaded from the Hub ({reason}). {HOW_TO_POINT_AT_A_CHECKPOINT}"
        ) from error


def _hub_snapshot(repo_id: str, revision: Optional[str], cache_dir: Path,
                  local_files_only: bool) -> Path:
    """A snapshot with config and weights: safetensors when the repo has them, else .bin files.
    Raises ``ModelNotFoundError`` (a ValueError, so the caller counts it as a cache miss) when
    the snapshot holds no weights."""
    from huggingface_hub import snapshot_download

    def fetch(weights_pattern: str) -> Path:
        return Path(snapshot_download(
            repo_id, revision=revision, cache_dir=str(cache_dir),
            local_files_only=local_files_only,
            allow_patterns=HUB_NON_WEIGHT_PATTERNS + [weights_pattern]))

    path = fetch(SAFETENSORS_PATTERN)
    if not any(path.glob(SAFETENSORS_PATTERN)):
        path = fetch(PYTORCH_BIN_PATTERN)  # older repos ship only pytorch_model*.bin
    if not weight_files(path):
        # e.g. a cache holding only the config.json some earlier tool fetched.
        raise ModelNotFoundError(f"The snapshot of {repo_id!r} in {path} holds no weights.")
    return checked_model_dir(path)


def _hf_hub_cache() -> Path:
    # Read at call time: huggingface_hub fixes its own copy of these when first imported.
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
