# Tandem's images, one file for both (build arguments choose):
#
#   frontend  EXTRAS=""           the HTTP API, no torch, no CUDA: `tandem frontend ...`
#   backend   EXTRAS="[backend]"  the engine, torch (CUDA from the base image): `tandem backend ...`
#             CPU_KERNEL_LEVELS=avx2,...  also the CPU kernels, prebuilt per ISA level (the CPU backend)
#             DEFAULT_MODEL=none  without the default model (included, converted, by default)
#
#   docker build -t tandem-frontend .
#   docker build -t tandem-backend --build-arg EXTRAS="[backend]" \
#       --build-arg BASE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime .
#
# Any BASE with python3 (3.10+) and its venv module works. The venv sees the base's own packages,
# so a PyTorch base image's torch (CUDA and all) is used as it is, never installed again. Where no
# registry is reachable, build from a base made locally (deploy/base-image.sh) and a wheelhouse
# (deploy/wheelhouse.sh): --build-arg BASE=tandem-base:bookworm --build-arg PIP_ARGS=--no-index
# --build-arg WHEELHOUSE=.wheelhouse/frontend (or .wheelhouse/backend).

ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
ARG EXTRAS=
ARG WHEELHOUSE=deploy/no-wheels
ARG PIP_ARGS=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY ${WHEELHOUSE} /wheels/
# The dependencies first, from pyproject.toml alone (no packages yet), so source edits reuse this layer.
COPY pyproject.toml /src/
RUN python3 -m venv --system-site-packages /opt/tandem && touch /src/README.md \
    && /opt/tandem/bin/pip install ${PIP_ARGS} --find-links /wheels "/src${EXTRAS}"
# The fused CPU kernels, prebuilt for each ISA level in CPU_KERNEL_LEVELS (compose.cpu.yaml: all
# five, avx2 to amx; empty: none) into /opt/tandem/kernels, where they are looked for first at run
# time ($TANDEM_PREBUILT_KERNELS' default), so the image compiles nothing when it starts. The final
# image has no compiler: this stage installs g++ where its base has none, and only the libraries go
# on (inside /opt/tandem). Keyed by csrc/ and torch alone, this layer outlives edits elsewhere.
ARG CPU_KERNEL_LEVELS=
COPY kernels /src/kernels
RUN if [ -n "${CPU_KERNEL_LEVELS}" ]; then \
        if command -v g++ >/dev/null || { apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ >/dev/null; }; then \
            PYTHONPATH=/src/kernels /opt/tandem/bin/python -m tandem_kernels.build \
                --levels "${CPU_KERNEL_LEVELS}" --out /opt/tandem/kernels; \
        else echo "WARNING: no C++ compiler here and none could be installed: the image carries no" \
            "prebuilt CPU kernels (the backend then runs the plain-torch path)"; fi; fi
# The default model (SmolLM2-135M-Instruct), converted here into /opt/tandem/models, where the
# backend looks first ($TANDEM_PREBUILT_MODELS' default): a backend container serves it with no
# network and converts nothing when it starts, and a cache volume on /cache cannot hide it. Its
# wheel comes from the wheelhouse (deploy/wheelhouse.sh adds it) or the index. Backend images only;
# DEFAULT_MODEL=none leaves it out (an image that serves only a mounted model: ~540 MB smaller).
# Keyed by the few converter files below and the dependencies, this layer outlives other edits.
ARG DEFAULT_MODEL=include
COPY backend/__init__.py /model-src/backend/
COPY backend/types/__init__.py backend/types/errors.py /model-src/backend/types/
COPY backend/models/__init__.py backend/models/conversion.py backend/models/default_model.py \
     backend/models/gguf_file.py backend/models/gguf_llama_convert.py /model-src/backend/models/
RUN case "${EXTRAS}:${DEFAULT_MODEL}" in \
        :*|*:none) echo "no default model in this image (EXTRAS=${EXTRAS:-none}, DEFAULT_MODEL=${DEFAULT_MODEL})";; \
        *:include) PYTHONPATH=/model-src TRANSFORMERS_VERBOSITY=error /opt/tandem/bin/python \
            -m backend.models.default_model --out /opt/tandem/models -- ${PIP_ARGS} --find-links /wheels \
            && chmod -R a+rX,go-w /opt/tandem/models;; \
        *) echo "error: DEFAULT_MODEL must be include or none, not ${DEFAULT_MODEL}" >&2; exit 1;; \
    esac
COPY README.md /src/
COPY frontend /src/frontend
COPY backend /src/backend
COPY protos /src/protos
RUN /opt/tandem/bin/pip install ${PIP_ARGS} --find-links /wheels --no-deps --force-reinstall /src \
    && if [ -z "${EXTRAS}" ]; then /opt/tandem/bin/python -c \
        "import frontend.server, frontend.entrypoints.cli, importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"; fi

# Only the venv (with the prebuilt kernels and the default model) goes on: the wheelhouse, the
# sources and the compiler stay in the build stage.
FROM ${BASE}
COPY --from=build /opt/tandem /opt/tandem
RUN (useradd --system --create-home --uid 1000 tandem 2>/dev/null || useradd --system --create-home tandem) \
    && mkdir -p /cache && chown tandem /cache
USER tandem
ENV PATH=/opt/tandem/bin:$PATH PYTHONUNBUFFERED=1 TANDEM_CACHE=/cache TRANSFORMERS_VERBOSITY=error
# frontend: HTTP 8000; backend: gRPC 50051, metrics 8001
EXPOSE 8000 50051 8001
ENTRYPOINT ["tandem"]
CMD ["--help"]
