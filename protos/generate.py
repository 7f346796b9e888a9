"""Generate the Python gRPC stubs of the engine contract, or check they are fresh.

    python protos/generate.py          # rewrite protos/tandem/engine/v1/engine_pb2*.py(i)
    python protos/generate.py --check  # exit 1 if the checked-in stubs are stale

protoc runs with ``protos/`` as the include root, so the descriptor's file name
is ``tandem/engine/v1/engine.proto``, as buf and every other language see it.
protoc then writes an absolute ``from tandem.engine.v1 import engine_pb2`` into
the ``_grpc`` file; we make that import relative so the stubs work as the
package ``protos.tandem.engine.v1``, from the repo root and when installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.resources
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILE = "tandem/engine/v1/engine.proto"
STUB_DIR = PROTO_ROOT / "tandem" / "engine" / "v1"
STUB_FILES = ("engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py")

_ABSOLUTE_IMPORT = "from tandem.engine.v1 import engine_pb2 as"
_RELATIVE_IMPORT = "from . import engine_pb2 as"


def generate(out_root: Path) -> Path:
    """Write the stubs under ``out_root/tandem/engine/v1/`` and return that directory."""
    from grpc_tools import protoc  # build-time tool: imported only when generating

    well_known_types = importlib.resources.files("grpc_tools") / "_proto"
    exit_code = protoc.main([
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--proto_path={well_known_types}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(PROTO_ROOT / PROTO_FILE),
    ])
    if exit_code != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILE} (exit code {exit_code}); see its output above.")
    stub_dir = out_root / "tandem" / "engine" / "v1"
    _make_grpc_import_relative(stub_dir / "engine_pb2_grpc.py")
    return stub_dir


def _make_grpc_import_relative(grpc_stub: Path) -> None:
    source = grpc_stub.read_text()
    if _ABSOLUTE_IMPORT not in source:
        raise RuntimeError(f"{grpc_stub.name} no longer imports engine_pb2 as expected; update generate.py.")
    grpc_stub.write_text(source.replace(_ABSOLUTE_IMPORT, _RELATIVE_IMPORT))


def stale_stubs(stub_dir: Path = STUB_DIR) -> list[str]:
    """Names of the stubs in ``stub_dir`` that differ from freshly generated ones (or are missing)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_dir = generate(Path(tmp))
        return [name for name in STUB_FILES
                if not (stub_dir / name).is_file()
                or (stub_dir / name).read_bytes() != (fresh_dir / name).read_bytes()]


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
            print(f"Stale gRPC stubs in {STUB_DIR}: {', '.join(stale)} differ from what "
                  f"grpcio-tools {importlib.metadata.version('grpcio-tools')} generates. "
                  "Run `python protos/generate.py` and commit the result.", file=sys.stderr)
            return 1
        print("gRPC stubs are up to date.")
        return 0
    generate(PROTO_ROOT)
    print(f"Wrote {', '.join(STUB_FILES)} to {STUB_DIR}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
