#!/usr/bin/env bash
# Build the bigmem-train image from this repository, offline when need be:
#   1. the base: $BASE_IMAGE if given; else python:3.11-slim-bookworm when it is here or can be
#      pulled; else a Debian 12 base built from Debian packages (docker/build-base-image.sh);
#   2. the wheelhouse .whl/ from docker/requirements.lock (docker/build-wheelhouse.sh);
#   3. docker build, with --network none when the base already holds the Debian packages.
# The image carries the SHA-256 of its build context (docker/build_context.py, shared with the Ansible
# role bigmem_image) as the label org.bigmem-train.context-sha256; when TAG, or another image, carries
# the current one and is built on the chosen base, nothing is built (use --force to build anyway).
#
# Usage: docker/build-image.sh [--force] [--local-base] [TAG]     (default TAG: bigmem-train:latest)
#   --local-base  skip the registry and use (or build) bigmem-train-base:bookworm
# Prints the timings of each step and, last, the tag.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
cd "$repo"

force=0
local_base=0
while [ $# -gt 0 ]; do
    case $1 in
        --force) force=1 ;;
        --local-base) local_base=1 ;;
        -h | --help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "build-image.sh: unknown option $1" >&2; exit 2 ;;
        *) break ;;
    esac
    shift
done
tag=${1:-bigmem-train:latest}
public_base=python:3.11-slim-bookworm
local_base_tag=bigmem-train-base:bookworm
python=${PYTHON:-python3}
seconds() { date +%s; }

# The client of a newer Docker without the buildx plugin needs the classic builder asked for.
if [ -z "${DOCKER_BUILDKIT:-}" ] && ! docker buildx version >/dev/null 2>&1; then
    export DOCKER_BUILDKIT=0
fi

# 1. The base image.
start=$(seconds)
base=${BASE_IMAGE:-}
if [ -z "$base" ]; then
    if [ "$local_base" -eq 0 ] && { docker image inspect "$public_base" >/dev/null 2>&1 ||
        timeout 120 docker pull --quiet "$public_base" >/dev/null 2>&1; }; then
        base=$public_base
    else
        [ "$local_base" -eq 1 ] || echo "no image registry reachable: building the base from Debian packages"
        "$here/build-base-image.sh" "$local_base_tag"
        base=$local_base_tag
    fi
fi
base_id=$(docker image inspect -f '{{.Id}}' "$base")
base_seconds=$(($(seconds) - start))

# The context hash (docker/build_context.py, the one definition the Ansible role uses too). An image
# is current when it carries that hash as its label and is built on the chosen base's layers.
context_sha256=$("$python" "$here/build_context.py" "$repo")
base_layers=$(docker image inspect -f '{{json .RootFS.Layers}}' "$base")
on_base() { # IMAGE: whether IMAGE's layers start with the base's
    local layers
    layers=$(docker image inspect -f '{{json .RootFS.Layers}}' "$1" 2>/dev/null) || return 1
    [[ "$layers" == "${base_layers%]}"[],]* ]]
}
current=$(docker image inspect -f '{{index .Config.Labels "org.bigmem-train.context-sha256"}}' "$tag" 2>/dev/null || true)
if [ "$force" -eq 0 ] && [ "$current" = "$context_sha256" ] && on_base "$tag"; then
    echo "image $tag is current (context ${context_sha256:0:16})"
    echo "$tag"
    exit 0
fi
# Another tag of the same context on the same base (bigmem-train:ctx-HASH the Ansible role made, or
# bigmem-train:latest for the tests' bigmem-train:test): retag it.
if [ "$force" -eq 0 ]; then
    for same in $(docker images -q --filter "label=org.bigmem-train.context-sha256=$context_sha256"); do
        if on_base "$same"; then
            docker tag "$same" "$tag"
            echo "image $tag is current (context ${context_sha256:0:16}, tagged from $same)"
            echo "$tag"
            exit 0
        fi
    done
fi

# 2. The wheelhouse (kept when PyPI is out of reach and it is already filled: the build checks hashes).
start=$(seconds)
if ! PYTHON="$python" "$here/build-wheelhouse.sh" "$repo/.whl"; then
    if ls "$repo"/.whl/*.whl >/dev/null 2>&1; then
        echo "build-image.sh: could not refresh the wheelhouse; building from the wheels in .whl/" >&2
    else
        echo "build-image.sh: no wheelhouse and no package index: run docker/build-wheelhouse.sh where PyPI is reachable" >&2
        exit 1
    fi
fi
wheelhouse_seconds=$(($(seconds) - start))

# 3. The image; no network inside the build when the base already holds numactl and the allocators.
network=()
if docker run --rm --network none --entrypoint dpkg-query "$base" -W numactl libjemalloc2 libtcmalloc-minimal4 \
    >/dev/null 2>&1; then
    network=(--network none)
fi
version=$("$python" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
revision=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
if [ "$revision" != unknown ] && [ -n "$(git status --porcelain -- pyproject.toml README.md src templates docker 2>/dev/null)" ]; then
    revision="$revision-dirty"
fi
start=$(seconds)
docker build "${network[@]}" --pull=false -f docker/Dockerfile \
    --build-arg BASE_IMAGE="$base" \
    --build-arg VERSION="$version" \
    --build-arg GIT_REVISION="$revision" \
    --build-arg BUILD_DATE="$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    --build-arg CONTEXT_SHA256="$context_sha256" \
    -t "$tag" -t "${tag%%:*}:$version" .
build_seconds=$(($(seconds) - start))
size=$(docker image inspect -f '{{.Size}}' "$tag")
echo "built $tag from $base: base ${base_seconds}s, wheelhouse ${wheelhouse_seconds}s, docker build ${build_seconds}s;" \
    "size $((size / 1000000)) MB; context ${context_sha256:0:16}, revision $revision"
echo "$tag"
