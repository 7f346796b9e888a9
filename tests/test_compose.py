"""compose.yaml (GPU) and compose.cpu.yaml: valid, the same stack but for the backend's GPU parts,
secure with nothing set, and self-healing.

The CPU file is standalone (an override cannot remove a GPU reservation with every Compose
version), so this test keeps the two from drifting apart. `docker compose config` runs where
Compose v2 is installed (.ci/run installs it from PyPI; tests/deploy/compose_smoke.sh runs the
stack). The token plumbing (the one-shot grpc-token service and the services' entrypoint) is run
here for real, without Docker: its Python and its shell line are taken from the compose file.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILES = ["compose.yaml", "compose.cpu.yaml"]
TOKEN_DIR = "/run/tandem"  # where the grpc-token volume is mounted


def load(name: str) -> dict:
    return yaml.safe_load((REPO_ROOT / name).read_text())


def compose_command() -> list[str]:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    pytest.skip("no Docker Compose v2 (`docker compose`) installed (.ci/run installs it from PyPI)")


def unescape(value: str) -> str:
    """A compose string as the container sees it (`$$` is a literal `$`)."""
    return value.replace("$$", "$")


def test_the_cpu_variant_is_the_gpu_stack_without_the_gpu():
    gpu, cpu = load("compose.yaml"), load("compose.cpu.yaml")
    assert set(gpu["services"]) == set(cpu["services"]) == {"grpc-token", "backend", "frontend", "lb"}
    for same in ("grpc-token", "frontend", "lb"):
        assert gpu["services"][same] == cpu["services"][same], same
    assert gpu["volumes"] == cpu["volumes"]
    gpu_backend, cpu_backend = dict(gpu["services"]["backend"]), dict(cpu["services"]["backend"])
    devices = gpu_backend.pop("deploy")["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "deploy" not in cpu_backend
    assert "CPU_KERNEL_LEVELS" not in gpu_backend["build"]["args"]  # a CUDA backend never builds them
    cpu_backend["build"]["args"].pop("CPU_KERNEL_LEVELS")
    for backend in (gpu_backend, cpu_backend):
        for differs in ("BASE", "PIP_ARGS"):
            backend["build"]["args"].pop(differs)
        backend.pop("image")
    assert gpu_backend == cpu_backend


def test_the_cpu_backend_image_carries_the_kernels_prebuilt_for_every_isa_level():
    """compose.cpu.yaml asks for every level; the Dockerfile compiles them in its build stage (which
    has or installs g++) into the directory the kernels look in first, and that goes on into the
    final image, which has no compiler (tests/test_kernel_isa_levels.py runs the build command)."""
    from tandem_kernels.isa import LEVELS

    levels = load("compose.cpu.yaml")["services"]["backend"]["build"]["args"]["CPU_KERNEL_LEVELS"]
    assert levels.startswith("${TANDEM_CPU_KERNEL_LEVELS:-") and levels.endswith("}")  # fewer where asked
    assert levels.removeprefix("${TANDEM_CPU_KERNEL_LEVELS:-")[:-1].split(",") == [level.name for level in LEVELS]
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    build_stage, _, final_stage = dockerfile.partition("\nFROM ${BASE}\n")
    assert "ARG CPU_KERNEL_LEVELS=\n" in build_stage  # empty by default: frontend and GPU images skip it
    assert "apt-get install -y -qq --no-install-recommends g++" in build_stage
    assert ('-m tandem_kernels.build \\\n                --levels "${CPU_KERNEL_LEVELS}" --out /opt/tandem/kernels'
            in build_stage)
    assert "none could be installed" in build_stage  # no compiler and none installable: said, not failed
    kernels_src = (REPO_ROOT / "kernels" / "tandem_kernels" / "build.py").read_text()
    assert 'DEFAULT_PREBUILT_DIR = "/opt/tandem/kernels"' in kernels_src  # where the image's are found
    assert "COPY --from=build /opt/tandem /opt/tandem\n" in final_stage
    assert "g++" not in final_stage and "apt-get" not in final_stage


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_frontends_scale_and_wait_for_a_healthy_backend(name):
    services = load(name)["services"]
    frontend = services["frontend"]
    assert "container_name" not in frontend and "ports" not in frontend  # --scale frontend=N works
    assert "container_name" not in services["backend"] and "ports" not in services["backend"]
    assert frontend["depends_on"]["backend"] == {"condition": "service_healthy"}
    assert "dns:///backend:50051" in frontend["command"]
    assert services["lb"]["ports"] == ["${TANDEM_HOST:-127.0.0.1}:${TANDEM_PORT:-8000}:8080"]


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_dead_services_are_restarted_and_the_one_shot_is_not(name):
    services = load(name)["services"]
    for service in ("backend", "frontend", "lb"):
        assert services[service]["restart"] == "unless-stopped", service
    assert services["grpc-token"]["restart"] == "no"
    # Docker's init is PID 1, so the engine is an ordinary process: when it dies (kill -9 included,
    # which PID 1 cannot receive from inside), the container exits and the policy above applies.
    for service in ("backend", "frontend"):
        assert services[service]["init"] is True, service


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_unhealthy_services_say_why(name):
    """The health check's output (docker inspect .State.Health) names the cause and where to look."""
    services = load(name)["services"]
    probes = {"backend": "tandem healthcheck grpc 127.0.0.1:50051",
              "frontend": "tandem healthcheck http http://127.0.0.1:8000/health",
              "lb": "wget -q -O /dev/null http://127.0.0.1:8080/health"}
    for service, probe in probes.items():
        kind, command = services[service]["healthcheck"]["test"]
        assert kind == "CMD-SHELL" and command.startswith(probe + " || { echo "), service
        assert command.endswith("; exit 1; }") and "docker compose logs" in command, service


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_backends_and_frontends_wait_for_the_token_and_read_it(name):
    services = load(name)["services"]
    volumes = load(name)["volumes"]
    assert "grpc-token" in volumes
    assert services["grpc-token"]["volumes"] == [f"grpc-token:{TOKEN_DIR}"]
    for service in ("backend", "frontend"):
        spec = services[service]
        assert spec["depends_on"]["grpc-token"] == {"condition": "service_completed_successfully"}, service
        assert f"grpc-token:{TOKEN_DIR}:ro" in spec["volumes"], service
        assert spec["environment"]["TANDEM_GRPC_TOKEN"] == "${TANDEM_GRPC_TOKEN:-}", service
        assert spec["entrypoint"][-1] == "tandem" and spec["entrypoint"][:2] == ["/bin/sh", "-c"], service
    assert services["backend"]["entrypoint"] == services["frontend"]["entrypoint"]
    # The token generator runs in the frontend's image, which compose builds: never pulled.
    assert services["grpc-token"]["image"] == services["frontend"]["image"]
    assert services["grpc-token"]["pull_policy"] == "never"


def run_token_service(service: dict, token_dir: Path) -> str:
    program, flag, script = service["entrypoint"]
    assert (program, flag) == ("python3", "-c")
    script = unescape(script).replace(TOKEN_DIR, str(token_dir))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.timeout(60)
def test_the_token_service_writes_a_random_token_once(tmp_path):
    service = load("compose.yaml")["services"]["grpc-token"]
    first_dir, second_dir = tmp_path / "one", tmp_path / "two"
    first_dir.mkdir()
    second_dir.mkdir()
    assert "wrote a new random token" in run_token_service(service, first_dir)
    token = (first_dir / "grpc-token").read_text()
    assert len(token) == 64 and int(token, 16) >= 0  # 32 random bytes, hex
    assert stat.S_IMODE((first_dir / "grpc-token").stat().st_mode) == 0o444
    # A second `up` keeps it (running replicas hold it); another stack (`down -v`, then up) gets another.
    assert "keeping the token" in run_token_service(service, first_dir)
    assert (first_dir / "grpc-token").read_text() == token
    run_token_service(service, second_dir)
    assert (second_dir / "grpc-token").read_text() != token
    assert sorted(os.listdir(first_dir)) == ["grpc-token"]  # no temporary file left behind


def run_entrypoint(entrypoint: list[str], tmp_path: Path, token_dir: Path, environment: dict) -> str:
    """The service's entrypoint with `tandem` replaced by a script that prints its token and argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "tandem"
    fake.write_text('#!/bin/sh\necho "token=$TANDEM_GRPC_TOKEN args=$*"\n')
    fake.chmod(0o755)
    shell, flag, line, zero = (unescape(part) for part in entrypoint)
    line = line.replace(TOKEN_DIR, str(token_dir))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", **environment}
    result = subprocess.run([shell, flag, line, zero, "backend", "--port", "50051"], capture_output=True, text=True,
                            env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("service", ["backend", "frontend"])
def test_the_entrypoint_takes_the_set_token_else_the_generated_one(service, tmp_path):
    entrypoint = load("compose.yaml")["services"][service]["entrypoint"]
    token_dir = tmp_path / "volume"
    token_dir.mkdir()
    (token_dir / "grpc-token").write_text("generated-token")
    # Nothing set (compose passes an empty variable): the generated token.
    assert run_entrypoint(entrypoint, tmp_path, token_dir, {"TANDEM_GRPC_TOKEN": ""}) == \
        "token=generated-token args=backend --port 50051"
    # An explicitly set TANDEM_GRPC_TOKEN wins.
    assert run_entrypoint(entrypoint, tmp_path, token_dir, {"TANDEM_GRPC_TOKEN": "mine"}) == \
        "token=mine args=backend --port 50051"
    # No token anywhere: an empty one, which the backend refuses beyond loopback (default-deny).
    (token_dir / "grpc-token").unlink()
    assert run_entrypoint(entrypoint, tmp_path, token_dir, {}).startswith("token= args=backend")


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_config_is_valid(name):
    result = subprocess.run([*compose_command(), "-f", name, "config", "-q"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
