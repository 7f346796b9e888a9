"""Tandem's import names leave other packages' names alone.

transformers (>= 5.25) requires Hugging Face's ``kernels`` package and imports it; Tandem's kernels are
``tandem_kernels`` (in the ``kernels/`` folder, which has no ``__init__.py``), so even run from the
repository's root, where the folder is on ``sys.path``, ``import kernels`` never finds ours.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)


def _run_at_root(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=100,
                          check=True).stdout.strip()


def test_kernels_from_the_repository_root_is_never_tandems():
    origin = _run_at_root("import importlib.util as u; s = u.find_spec('kernels'); "
                          "print(s.origin if s and s.origin else '')")
    assert not origin.startswith(str(ROOT / "kernels")), f"`import kernels` finds Tandem's {origin}"
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_transformers_models_import_from_the_repository_root():
    # the import that failed when Tandem's package was called `kernels` (transformers' hub_kernels)
    out = _run_at_root("import transformers.activations, transformers.models.llama.modeling_llama as m; "
                       "import tandem_kernels.ops; print(m.LlamaForCausalLM.__name__)")
    assert out.endswith("LlamaForCausalLM")
