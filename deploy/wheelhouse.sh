#!/usr/bin/env bash
# Download every wheel the two images install into a local wheelhouse, for air-gapped image builds:
#
#   deploy/wheelhouse.sh [DIR]        default DIR: .wheelhouse  ->  DIR/backend, DIR/frontend
#
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
# The frontend's wheels are a subset of the backend's: resolved from those, with no index.
download "$dir/frontend" --no-index --find-links "$dir/backend" .
