"""Generate the Python gRPC stubs of the protos, or check they are fresh.

    python protos/generate.py          # rewrite the *_pb2.py(i) and *_pb2_grpc.py beside each .proto
    python protos/generate.py --check  # exit 1 if the checked-in stubs are stale

Two protos: the engine contract, and gRPC's reflection protocol v1 (grpcio-reflection
ships only v1alpha; backend/server/reflection.py serves v1 with these stubs).

protoc runs with ``protos/`` as the include root, so a descriptor's file name is
its path below it (``tandem/engine/v1/engine.proto``), as buf and every other
language see it. protoc then writes an absolute ``from tandem.engine.v1 import
engine_pb2`` into each ``_grpc`` file; we make that import relative so the stubs
work as the package ``protos.tandem.engine.v1`` (``protos.grpc.reflection.v1``),
from the repo root and when installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.resources
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILE = "tandem/engine/v1/engine.proto"  # the engine contract
PROTO_FILES = (PROTO_FILE, "grpc/reflection/v1/reflection.proto")
STUB_DIR = PROTO_ROOT / "tandem" / "engine" / "v1"
STUB_FILES = ("engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py")


def stub_paths(proto_file: str) -> tuple[str, str, str]:
    """The stubs protoc writes for ``proto_file``, as paths below the proto root."""
    stem = proto_file.removesuffix(".proto")
    return f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"


def all_stub_paths() -> list[str]:
    return [path for proto_file in PROTO_FILES for path in stub_paths(proto_file)]


def generate(out_root: Path) -> Path:
    """Write every proto's stubs under ``out_root`` (same layout as ``protos/``); return the
    engine stubs' directory, ``out_root/tandem/engine/v1``."""
    from grpc_tools import protoc  # build-time tool: imported only when generating

    well_known_types = importlib.resources.files("grpc_tools") / "_proto"
    exit_code = protoc.main([
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--proto_path={well_known_types}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(PROTO_ROOT / proto_file) for proto_file in PROTO_FILES),
    ])
    if exit_code != 0:
        raise RuntimeError(f"protoc failed on {', '.join(PROTO_FILES)} (exit code {exit_code}); see its output above.")
    for proto_file in PROTO_FILES:
        _make_grpc_import_relative(out_root, proto_file)
    return out_root / "tandem" / "engine" / "v1"


def _make_grpc_import_relative(out_root: Path, proto_file: str) -> None:
    package, _, name = proto_file.removesuffix(".proto").rpartition("/")
    absolute = f"from {package.replace('/', '.')} import {name}_pb2 as"
    grpc_stub = out_root / stub_paths(proto_file)[2]
    source = grpc_stub.read_text()
    if absolute not in source:
        raise RuntimeError(f"{grpc_stub.name} no longer imports {name}_pb2 as expected; update generate.py.")
    grpc_stub.write_text(source.replace(absolute, f"from . import {name}_pb2 as"))


def stale_stubs(root: Path = PROTO_ROOT) -> list[str]:
    """Paths (below ``root``) of the stubs that differ from freshly generated ones (or are missing)."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [path for path in all_stub_paths()
                if not (root / path).is_file() or (root / path).read_bytes() != (Path(tmp) / path).read_bytes()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only compare the checked-in stubs with fresh ones; exit 1 if they differ")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_stubs()
        if stale:
            # The stubs record the generator's version, so another grpcio-tools
            # release alone makes them differ: say which one ran.
            print(f"Stale gRPC stubs in {PROTO_ROOT}: {', '.join(stale)} differ from what "
                  f"grpcio-tools {importlib.metadata.version('grpcio-tools')} generates. "
                  "Run `python protos/generate.py` and commit the result.", file=sys.stderr)
            return 1
        print("gRPC stubs are up to date.")
        return 0
    generate(PROTO_ROOT)
    print(f"Wrote {', '.join(all_stub_paths())} under {PROTO_ROOT}.")
    return 0


if __name__ == "__main__":
    # Run as a script, Python puts protos/ first on sys.path, where protos/grpc/ (the
    # reflection stubs) would hide the real grpc package from anything importing it.
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != PROTO_ROOT]
    sys.exit(main())
