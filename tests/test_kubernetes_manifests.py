"""deploy/kubernetes: both stacks (cpu, gpu) pass the Kubernetes schemas and fit the servers.

`kubernetes-validate` checks every resource against the API schemas it bundles (no cluster, no
network). The rest checks what a schema cannot: probes on routes and ports the servers really serve
(and open ones: the kubelet sends no key), the backend token from the Secret only, grace periods
that cover the drain, images named as compose builds them, selectors that select the pods.
The stacks are plain kustomizations (only `resources`), rendered here by following them.
"""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from frontend.app import OPEN_ROUTES

REPO_ROOT = Path(__file__).resolve().parents[1]
KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
STACKS = ["cpu", "gpu"]
# The oldest release with gRPC probes (GA in 1.27) and the newest the validator knows.
KUBERNETES_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]
TOKEN_SECRET = {"name": "tandem-grpc-token", "key": "token"}


def render(directory: Path) -> list[dict]:
    """The resources `kubectl apply -k directory` applies, for kustomizations made of `resources` only."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kustomization) == {"apiVersion", "kind", "resources"}, \
        f"{directory}: only plain resources are rendered here (extend render() for more)"
    resources: list[dict] = []
    for entry in kustomization["resources"]:
        path = (directory / entry).resolve()
        if path.is_dir():
            resources += render(path)
        else:
            resources += [document for document in yaml.safe_load_all(path.read_text()) if document]
    return resources


def by_kind(resources: list[dict], kind: str) -> dict[str, dict]:
    return {resource["metadata"]["name"]: resource for resource in resources if resource["kind"] == kind}


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def port_number(spec: dict, port) -> int:
    """A probe's or Service's port (a number or the name of a container port) as a number."""
    if isinstance(port, int):
        return port
    (number,) = [entry["containerPort"] for entry in spec.get("ports", []) if entry["name"] == port]
    return number


def compose_default_image(compose_file: str, service: str) -> str:
    image = yaml.safe_load((REPO_ROOT / compose_file).read_text())["services"][service]["image"]
    return re.fullmatch(r"\$\{\w+:-(.+)\}", image).group(1)


# Ids other than the bare "gpu" (conftest skips the "gpu" keyword on machines without CUDA).
@pytest.fixture(params=STACKS, ids=[f"{name}-stack" for name in STACKS])
def stack(request) -> tuple[str, list[dict]]:
    return request.param, render(KUBERNETES / request.param)


def test_every_resource_passes_the_kubernetes_schemas(stack):
    name, resources = stack
    kinds = sorted(resource["kind"] for resource in resources)
    assert kinds == ["Deployment", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                     "PodDisruptionBudget", "Service", "Service"], name
    for version in KUBERNETES_VERSIONS:
        for resource in resources:
            kubernetes_validate.validate(resource, version, strict=True)  # raises, naming the field


def test_the_validator_rejects_a_broken_manifest():
    """The check above can fail: a misspelt field and a wrong type are caught."""
    deployment = by_kind(render(KUBERNETES / "cpu"), "Deployment")["tandem-backend"]
    container(deployment)["readinessProbe"]["grpc"]["prot"] = 50051
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)
    deployment = by_kind(render(KUBERNETES / "cpu"), "Deployment")["tandem-backend"]
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_probes_use_the_servers_real_health_endpoints(stack):
    _, resources = stack
    deployments = by_kind(resources, "Deployment")
    frontend = container(deployments["tandem-frontend"])
    http_port = int(flag(frontend["args"], "--port"))
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = frontend[probe]["httpGet"]
        assert get["path"] in OPEN_ROUTES, probe  # served without the API key
        assert port_number(frontend, get["port"]) == http_port, probe
    assert frontend["readinessProbe"]["httpGet"]["path"] == "/health"  # 503 without a serving backend
    assert frontend["livenessProbe"]["httpGet"]["path"] != "/health"  # a backend outage restarts no frontend

    backend = container(deployments["tandem-backend"])
    grpc_port = int(flag(backend["args"], "--port"))
    assert flag(backend["args"], "--host") == "0.0.0.0"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert backend[probe]["grpc"] == {"port": grpc_port}, probe  # grpc.health.v1, the whole server
    assert port_number(backend, "grpc") == grpc_port
    assert port_number(backend, "metrics") == int(flag(backend["args"], "--metrics-port"))
    assert flag(backend["args"], "--metrics-host") == "0.0.0.0"  # reachable by a scraper


def test_the_backend_token_comes_from_the_secret_only(stack):
    _, resources = stack
    for name, deployment in by_kind(resources, "Deployment").items():
        spec = container(deployment)
        (token,) = [entry for entry in spec["env"] if entry["name"] == "TANDEM_GRPC_TOKEN"]
        assert "value" not in token, name
        assert token["valueFrom"]["secretKeyRef"] == TOKEN_SECRET, name  # not optional: no token, no start
        assert not any("token" in argument.lower() for argument in spec["args"]), name  # never on a command line
    assert by_kind(resources, "Secret") == {}  # made by the user, with a random value (never in git)


def test_grace_periods_cover_the_drain(stack):
    _, resources = stack
    for name, deployment in by_kind(resources, "Deployment").items():
        spec = container(deployment)
        drain = float(flag(spec["args"], "--shutdown-timeout"))
        pre_stop = spec.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
        assert pre_stop[0] == "sleep", name
        needed = drain + float(pre_stop[1])
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert needed < grace <= needed + 15, name
        if "livenessProbe" in spec:  # health says NOT_SERVING while draining: no kill before it ends
            liveness = spec["livenessProbe"]
            assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain, name


def test_images_are_named_as_compose_builds_them(stack):
    name, resources = stack
    deployments = by_kind(resources, "Deployment")
    assert container(deployments["tandem-frontend"])["image"] == compose_default_image("compose.yaml", "frontend")
    backend_compose = {"cpu": "compose.cpu.yaml", "gpu": "compose.yaml"}[name]
    assert container(deployments["tandem-backend"])["image"] == compose_default_image(backend_compose, "backend")


def test_services_autoscaler_and_budgets_select_the_pods(stack):
    _, resources = stack
    deployments = by_kind(resources, "Deployment")
    labels = {name: deployment["spec"]["template"]["metadata"]["labels"] for name, deployment in deployments.items()}
    for name, deployment in deployments.items():
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels[name].items(), name
    services = by_kind(resources, "Service")
    for name, service in services.items():
        assert service["spec"]["selector"].items() <= labels[name].items(), name
        for port in service["spec"]["ports"]:
            port_number(container(deployments[name]), port["targetPort"])  # a port the container declares
    assert services["tandem-backend"]["spec"]["clusterIP"] == "None"  # DNS lists every backend pod
    frontend_args = container(deployments["tandem-frontend"])["args"]
    assert flag(frontend_args, "--backend") == "dns:///tandem-backend:50051"
    for name, budget in by_kind(resources, "PodDisruptionBudget").items():
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels[name].items(), name
    target = by_kind(resources, "HorizontalPodAutoscaler")["tandem-frontend"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "tandem-frontend")
    assert "cpu" in container(deployments["tandem-frontend"])["resources"]["requests"]  # what utilization is of


def test_the_gpu_stack_is_the_cpu_stack_with_a_gpu_per_backend():
    cpu, gpu = render(KUBERNETES / "cpu"), render(KUBERNETES / "gpu")
    cpu_backend = by_kind(cpu, "Deployment").pop("tandem-backend")
    gpu_backend = by_kind(gpu, "Deployment").pop("tandem-backend")
    assert [r for r in cpu if r["metadata"]["name"] != "tandem-backend" or r["kind"] != "Deployment"] == \
        [r for r in gpu if r["metadata"]["name"] != "tandem-backend" or r["kind"] != "Deployment"]
    assert container(gpu_backend)["resources"]["limits"].pop("nvidia.com/gpu") == 1
    assert "nvidia.com/gpu" not in str(cpu_backend)
    assert gpu_backend["spec"]["template"]["spec"].pop("tolerations")[0]["key"] == "nvidia.com/gpu"
    container(gpu_backend).pop("image")
    container(cpu_backend).pop("image")
    assert gpu_backend == cpu_backend
