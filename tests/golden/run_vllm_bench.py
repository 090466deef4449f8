#!/usr/bin/env python3

"""
vLLM Benchmark Runner - Single Test
运行单个 vLLM benchmark 测试

使用示例：
    python run_vllm_bench.py \
        --total-len 2048 \
        --repeat-prefix-ratio 0.9 \
        --output-len 10 \
        --num-prompts 1 \
        --num-prefixes 1 \
        --concurrency 8

可选参数：
    --output-dir      输出目录（默认: 当前目录）
    --seed            随机种子（默认: 1000）
    --request-rate    请求速率（不传则不限制）
"""

import argparse
import os
import subprocess
import sys

sys.stdout.reconfigure(line_buffering=True)
from pathlib import Path
from datetime import datetime

# TODO： Need to modify

BENCH_HOST = "localhost"
BENCH_PORT = 8080
MODEL = "dsv4"
TOKENIZER_PATH = "/mnt/cephfs/models/DeepSeek-V4-Flash-w8a8-mtp"

def run_bench(
    total_len: int,
    repeat_prefix_ratio: float,
    output_len: int,
    num_prompts: int,
    num_prefixes: int,
    concurrency: int,
    output_dir: str = None,
    seed: int = 1000,
    request_rate: float = None,
):
    """
    运行 vLLM benchmark 测试

    Args:
        total_len: 总长度（例如 32768 表示 32k）
        repeat_prefix_ratio: 重复前缀率（例如 0.9）
        output_len: 输出长度（例如 1024）
        num_prompts: prompt 数量
        num_prefixes: prefix 数量
        concurrency: 并发数
        output_dir: 输出目录
        seed: 随机种子
        request_rate: 请求速率（None 表示不限制）
    """
    # 计算前缀和后缀长度
    prefix_len = int(total_len * repeat_prefix_ratio)
    suffix_len = total_len - prefix_len

    print("=======bench info========")
    print(f"总长度: {total_len}")
    print(f"重复前缀率: {repeat_prefix_ratio}")
    print(f"前缀长度: {prefix_len}")
    print(f"输出长度: {output_len}")
    print(f"并发数: {concurrency}")

    # 创建输出目录
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)

    # 构建 vllm bench serve 命令
    cmd = [
        "vllm", "bench", "serve",
        "--backend", "openai-chat",
        "--endpoint", "/v1/chat/completions",
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(prefix_len),
        "--prefix-repetition-suffix-len", str(suffix_len),
        "--prefix-repetition-output-len", str(output_len),
        "--num-prompts", str(num_prompts),
        "--prefix-repetition-num-prefixes", str(num_prefixes),
        "--ignore-eos",
        "--model", MODEL,
        "--tokenizer", TOKENIZER_PATH,
        "--seed", str(seed),
        "--host", BENCH_HOST,
        "--port", str(BENCH_PORT),
        "--max-concurrency", str(concurrency),
    ]

    # 如果指定了 request_rate，添加到命令
    if request_rate is not None:
        cmd.extend(["--request-rate", str(request_rate)])

    print(f"\n执行命令:")
    print(" ".join(cmd))
    print("===============")
    print("")

    # 运行命令
    result = subprocess.run(cmd, capture_output=False)

    return result.returncode

def main():
    parser = argparse.ArgumentParser(description="运行 vLLM benchmark 单次测试")

    # 必需参数
    parser.add_argument("--total-len", type=int, required=True,
                        help="总长度（例如 32768 表示 32k）")
    parser.add_argument("--repeat-prefix-ratio", type=float, required=True,
                        help="重复前缀率（例如 0.9）")
    parser.add_argument("--output-len", type=int, required=True,
                        help="输出长度")
    parser.add_argument("--num-prompts", type=int, required=True,
                        help="prompt 数量")
    parser.add_argument("--num-prefixes", type=int, required=True,
                        help="prefix 数量")
    parser.add_argument("--concurrency", type=int, required=True,
                        help="并发数")

    # 可选参数
    parser.add_argument("--output-dir", type=str, default=".",
                        help="输出目录（默认: 当前目录）")
    parser.add_argument("--seed", type=int, default=1000,
                        help="随机种子（默认: 1000）")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="请求速率（不传则不限制）")

    args = parser.parse_args()

    returncode = run_bench(
        total_len=args.total_len,
        repeat_prefix_ratio=args.repeat_prefix_ratio,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        num_prefixes=args.num_prefixes,
        concurrency=args.concurrency,
        output_dir=args.output_dir,
        seed=args.seed,
        request_rate=args.request_rate,
    )

    sys.exit(returncode)

if __name__ == "__main__":
    main()
