#!/usr/bin/env bash
# Fetch Debian's crun (and the libyajl it links) into a cache folder, unpacked, not installed: podman's default
# runtime stays runc for the rest of the suite, and one test makes crun the default through its own containers.conf
# to show the agent's runc adaptation against the real crun refusal (nodeagent/container/host.py). Idempotent.
# Usage: fetch-crun.sh [DEST] (default .cache/crun); prints the wrapper's path.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.cache/crun}"
if [ ! -x "$dest/crun" ]; then
  command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || { echo "fetch-crun.sh: needs apt-get and dpkg-deb" >&2; exit 1; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  chmod 755 "$tmp"  # apt's _apt user downloads into it when it can
  ( cd "$tmp" && apt-get download -qq crun libyajl2 >/dev/null 2>&1 ) \
    || { [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null && ( cd "$tmp" && apt-get download -qq crun libyajl2 >/dev/null 2>&1 ); }
  mkdir -p "$dest"
  for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$dest/root"; done
  lib=$(dirname "$(find "$dest/root" -name 'libyajl.so.2*' | head -1)")
  abs=$(cd "$dest" && pwd)
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$abs/${lib#"$dest/"}" "$abs/root/usr/bin/crun" > "$dest/crun.tmp"
  chmod +x "$dest/crun.tmp" && mv "$dest/crun.tmp" "$dest/crun"
fi
"$dest/crun" --version >/dev/null
echo "$(cd "$dest" && pwd)/crun"
