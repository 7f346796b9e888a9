"""docs/architecture.md names files and functions (`path:Name` or `path:Class.method`): each exists.

So the walk through a request's life cannot silently go stale when code moves. A name is found
by parsing the file (Python: classes, functions, methods, nested functions; the .proto: its
messages and rpcs), never by importing it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
# `backend/engine/llm_engine.py:LLMEngine.step`, `kernels/tandem_kernels/attention.py`, `...engine.proto:Generate`
REFERENCE = re.compile(r"`((?:frontend|backend|kernels|protos)/[\w/]+\.(?:py|proto))(?::([\w.]+))?`")


def references() -> list[tuple[str, str]]:
    return [(path, name or "") for path, name in REFERENCE.findall(DOC.read_text())]


def python_names(source: str) -> set[str]:
    """Every class, function and method's qualified name (A, A.f, f, f.inner)."""
    names: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                names.add(name)
                visit(child, name + ".")

    visit(ast.parse(source), "")
    return names


def proto_names(source: str) -> set[str]:
    return set(re.findall(r"^\s*(?:message|service|enum)\s+(\w+)", source, re.M)) | \
        set(re.findall(r"^\s*rpc\s+(\w+)", source, re.M))


def test_the_walk_names_many_places():
    found = references()
    assert len(found) >= 40, "docs/architecture.md should name the files and functions of each step"
    assert any(path.startswith("frontend/") for path, _ in found) and any(path.startswith("backend/") for path, _ in found)


@pytest.mark.parametrize("path, name", sorted(set(references())), ids=lambda value: value or "-")
def test_every_named_file_and_function_exists(path, name):
    file = REPO / path
    assert file.is_file(), f"docs/architecture.md names {path}, which does not exist"
    if not name:
        return
    source = file.read_text()
    names = proto_names(source) if path.endswith(".proto") else python_names(source)
    assert name in names, f"docs/architecture.md names {path}:{name}, which {path} does not define"


def test_the_readme_links_the_walk():
    assert "docs/architecture.md" in (REPO / "README.md").read_text()
