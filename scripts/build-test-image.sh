#!/usr/bin/env bash
# Build (or reuse) the container image the container-mode tests run the stack in, offline: no registry is
# reachable from the build machines, so the image is `podman import` of the cached Debian rootfs that
# scripts/build-test-rootfs.sh makes (it stands in for the vllm-ascend image: a distribution userland, no CANN).
# The stack itself (the agent, etcd, dscli and the datasystem worker, the vLLM stand-in — all in the venv) is not
# copied in: the tests bind-mount the worktree (with its .venv) and the venv's interpreter read-only at the same
# paths, which costs nothing per run (copying them would add ~1.2 GB and ~30 s per build).
# Usage: build-test-image.sh [ROOTFS]   prints the image name (localhost/dsv4-agent-test:<hash>) on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

ROOTFS="${1:-/var/cache/dsv4-agent-test/rootfs-bookworm}"
log() { printf 'build-test-image: %s\n' "$*" >&2; }

if ! command -v podman >/dev/null 2>&1; then
    log "podman is not installed (apt-get install -y --no-install-recommends podman runc)"
    exit 1
fi
bash scripts/build-test-rootfs.sh "$ROOTFS" >&2
# The tag follows the rootfs stamp and this script, so a change to either builds a new image.
tag=$( (cat "$ROOTFS/.dsv4-agent-rootfs-stamp"; cat "$0") | sha256sum | cut -c1-12)
IMAGE="localhost/dsv4-agent-test:$tag"
exec 9>"$ROOTFS.image.lock"
flock 9
if podman image exists "$IMAGE"; then
    log "cached image is current: $IMAGE"
    echo "$IMAGE"
    exit 0
fi
start=$(date +%s)
tar -C "$ROOTFS" --exclude=./.dsv4-agent-rootfs-stamp -cf - . \
    | podman import --quiet --change 'CMD ["bash"]' --change 'WORKDIR /' - "$IMAGE" >/dev/null
log "built $IMAGE from $ROOTFS in $(($(date +%s) - start)) s"
echo "$IMAGE"
