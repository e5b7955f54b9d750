#!/usr/bin/env bash
# Build a Debian 12 (bookworm) base image from Debian packages, for hosts that reach a Debian
# mirror (or a local one) but no image registry: mmdebstrap (or debootstrap) writes a root
# filesystem, `docker import` turns it into an image. Its python3 is 3.11, like the public
# python:3.11-slim-bookworm default, and it already holds numactl, jemalloc and tcmalloc, so the
# Dockerfile needs no network on top of it:
#
#   docker/build-base-image.sh                  # -> bigmem-train-base:bookworm
#   docker build --build-arg BASE_IMAGE=bigmem-train-base:bookworm ...
#
# Usage: build-base-image.sh [--force] [TAG]
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian),
#              DEBIAN_SECURITY_MIRROR (default http://deb.debian.org/debian-security; "none" skips it),
#              BOOTSTRAP (mmdebstrap or debootstrap; default mmdebstrap when installed).
set -euo pipefail

force=0
if [ "${1:-}" = "--force" ]; then
    force=1
    shift
fi
tag=${1:-bigmem-train-base:bookworm}
suite=bookworm
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
# python3-venv: the Dockerfile's venv; the rest: what the image offers at run time.
packages=python3,python3-venv,numactl,libjemalloc2,libtcmalloc-minimal4,tzdata

if [ "$force" -eq 0 ] && docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag exists (use --force to rebuild)"
    exit 0
fi
bootstrap=${BOOTSTRAP:-$(command -v mmdebstrap >/dev/null && echo mmdebstrap || echo debootstrap)}
command -v "$bootstrap" >/dev/null || {
    echo "build-base-image.sh: $bootstrap is not installed; bash scripts/setup.sh --ops installs mmdebstrap" >&2
    exit 2
}
[ "$(id -u)" -eq 0 ] || { echo "build-base-image.sh: run as root ($bootstrap needs it)" >&2; exit 2; }

workdir=$(mktemp -d /var/tmp/bigmem-base.XXXXXX)
trap 'rm -rf "$workdir"' EXIT
tarball="$workdir/rootfs.tar"

sources=("deb $mirror $suite main" "deb $mirror $suite-updates main")
[ "$security" = none ] || sources+=("deb $security $suite-security main")

start=$(date +%s)
if [ "$bootstrap" = mmdebstrap ]; then
    # Leave out docs, man pages and locales (the image speaks C.UTF-8) and the apt lists.
    mmdebstrap --variant=minbase --mode=root --format=tar \
        --include="$packages" \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --aptopt='APT::Install-Recommends "false"' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/*.log' \
        "$suite" "$tarball" "${sources[@]}"
else
    rootfs="$workdir/rootfs"
    debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror"
    printf '%s\n' "${sources[@]}" >"$rootfs/etc/apt/sources.list"
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
    tar -C "$rootfs" --numeric-owner -cf "$tarball" .
fi

# The same environment the python slim images set, so either base behaves alike.
docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --change "LABEL org.opencontainers.image.title=bigmem-train-base org.opencontainers.image.description=\"Debian $suite from $mirror with python3, numactl, jemalloc, tcmalloc\" org.opencontainers.image.created=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    "$tarball" "$tag" >/dev/null
echo "base image $tag built in $(($(date +%s) - start)) s ($(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=iec) )"
