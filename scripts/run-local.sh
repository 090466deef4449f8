#!/usr/bin/env bash
# Install and run the agent on the embedded local default: real etcd, the real datasystem worker and the vLLM
# stand-in on loopback, all state under .dsv4-agent/. Ctrl-C (SIGTERM) stops the stack in reverse order.
set -euo pipefail
cd "$(dirname "$0")/.."
# Install only when pyproject.toml (or the stand-in's) changed since the last install (stamp: its hash), so a plain restart shows
# no pip output.
stamp=.venv/.run-local-installed
want="$(cat pyproject.toml standin/pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -x .venv/bin/dsv4-agent ] || [ ! -x .venv/bin/vllm-standin ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  scripts/install-dev.sh >&2
  echo "$want" >"$stamp"
fi
echo "dsv4-agent: starting on config/local.yaml (logs: .dsv4-agent/logs/, state: .dsv4-agent/state/)" >&2
exec .venv/bin/dsv4-agent --config config/local.yaml "$@"
