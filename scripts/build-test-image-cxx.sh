#!/usr/bin/env bash
# The test image (scripts/build-test-image.sh) plus Debian's g++ and openssl: the CPU inductor builds
# torch.compile's kernels with a C++ compiler and checksums its precompiled header with `openssl` (without it:
# "InductorError: FileNotFoundError: ... 'openssl'"), so a real CPU vLLM that compiles (no --enforce-eager) needs
# both inside the container (bench/restart_cost_container.py). Debian's packages come from the rootfs's own apt source (the registry this
# machine reaches); built once per base image, then cached by tag.
#
# Usage: build-test-image-cxx.sh [ROOTFS]   prints the image name (localhost/dsv4-agent-test-cxx:<base>-<recipe>).
set -euo pipefail
self=$(realpath "$0")
cd "$(dirname "$self")/.."
log() { printf 'build-test-image-cxx: %s\n' "$*" >&2; }

base=$(bash scripts/build-test-image.sh "$@" | tail -n1)
IMAGE="localhost/dsv4-agent-test-cxx:${base##*:}-$(sha256sum "$self" | cut -c1-8)"
if podman image exists "$IMAGE"; then
    log "cached image is current: $IMAGE"
    echo "$IMAGE"
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/Containerfile" <<FILE
FROM $base
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ openssl \
    >/dev/null && rm -rf /var/lib/apt/lists/*
FILE
start=$(date +%s)
podman build --quiet -t "$IMAGE" "$work" >/dev/null
log "built $IMAGE from $base in $(($(date +%s) - start)) s"
echo "$IMAGE"
