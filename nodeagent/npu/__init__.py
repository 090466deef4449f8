"""The NPUs: `npu-smi`/`hccn_tool` parsing and running, health over time with debounce, the monitor that holds
vLLM's start on a fault, each chip's idle HBM baseline.
"""
