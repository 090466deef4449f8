"""Node layers beyond a component's own policy, each a `NodeLayer` or its rules: start guards (preflight, NPU
health), the chip-reset and isolation ladder, the worker's memory headroom, the KV-transfer log; preflight and
the port lint they use.
"""
