"""compose.yaml (GPU) and compose.cpu.yaml: valid, and the same stack but for the backend's GPU parts.

The CPU file is standalone (an override cannot remove a GPU reservation with every Compose
version), so this test keeps the two from drifting apart. `compose config` runs when a
Compose is installed (CI installs docker-compose; tests/deploy/compose_smoke.sh runs the stack).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]


def load(name: str) -> dict:
    return yaml.safe_load((REPO_ROOT / name).read_text())


def compose_command() -> list[str]:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("no Docker Compose installed (CI installs docker-compose)")


def test_the_cpu_variant_is_the_gpu_stack_without_the_gpu():
    gpu, cpu = load("compose.yaml"), load("compose.cpu.yaml")
    assert set(gpu["services"]) == set(cpu["services"]) == {"backend", "frontend", "lb"}
    assert gpu["services"]["frontend"] == cpu["services"]["frontend"]
    assert gpu["services"]["lb"] == cpu["services"]["lb"]
    assert gpu["volumes"] == cpu["volumes"]
    gpu_backend, cpu_backend = dict(gpu["services"]["backend"]), dict(cpu["services"]["backend"])
    devices = gpu_backend.pop("deploy")["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "deploy" not in cpu_backend
    for backend in (gpu_backend, cpu_backend):
        for differs in ("BASE", "PIP_ARGS"):
            backend["build"]["args"].pop(differs)
        backend.pop("image")
    assert gpu_backend == cpu_backend


def test_frontends_scale_and_wait_for_a_healthy_backend():
    services = load("compose.yaml")["services"]
    frontend = services["frontend"]
    assert "container_name" not in frontend and "ports" not in frontend  # --scale frontend=N works
    assert frontend["depends_on"] == {"backend": {"condition": "service_healthy"}}
    assert "dns:///backend:50051" in frontend["command"]
    assert services["backend"]["healthcheck"]["test"][:3] == ["CMD", "tandem", "healthcheck"]
    assert services["lb"]["ports"] == ["${TANDEM_HOST:-127.0.0.1}:${TANDEM_PORT:-8000}:8080"]


@pytest.mark.parametrize("name", ["compose.yaml", "compose.cpu.yaml"])
def test_compose_config_is_valid(name):
    result = subprocess.run([*compose_command(), "-f", name, "config", "-q"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
