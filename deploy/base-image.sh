#!/usr/bin/env bash
# Build a minimal Debian base image with Python, locally and from Debian's packages only (no image
# registry): debootstrap a minbase root file system, then `docker import` it.
#
#   deploy/base-image.sh [IMAGE]          default IMAGE: tandem-base:bookworm
#
# TANDEM_BASE_SUITE (bookworm: its python3 is 3.11) and TANDEM_BASE_MIRROR choose the release and
# mirror. With TANDEM_BASE_CACHE=DIR the root file system's tarball is kept there and reused, so a
# second machine or a wiped Docker imports it in seconds instead of debootstrapping (~2 min).
set -euo pipefail

image=${1:-tandem-base:bookworm}
suite=${TANDEM_BASE_SUITE:-bookworm}
mirror=${TANDEM_BASE_MIRROR:-http://deb.debian.org/debian}
packages=python3,python3-venv,ca-certificates

if docker image inspect "$image" >/dev/null 2>&1; then
    echo "base image $image: already there"
    exit 0
fi
tarball=${TANDEM_BASE_CACHE:+$TANDEM_BASE_CACHE/rootfs-$suite.tar}
if [[ -z $tarball || ! -s $tarball ]]; then
    command -v debootstrap >/dev/null || { echo "error: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
    rootfs=$(mktemp -d)
    trap 'rm -rf "$rootfs"' EXIT
    echo "base image $image: debootstrap $suite ($packages) ..."
    nice -n 19 debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" >/dev/null
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* \
        "$rootfs"/usr/share/man/*
    if [[ -n $tarball ]]; then
        mkdir -p "$(dirname "$tarball")"
        tar -C "$rootfs" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
    else
        tarball=$rootfs.tar
        tar -C "$rootfs" -cf "$tarball" .
        trap 'rm -rf "$rootfs" "$tarball"' EXIT
    fi
fi
docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' "$tarball" "$image" >/dev/null
echo "base image $image: $(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1/1e6}')"
