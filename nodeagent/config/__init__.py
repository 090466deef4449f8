"""The one YAML: models (msgspec), the loader with file/line errors, the `cluster:` section, each member's
settings and the cluster layout (ranks, ports, endpoints). Pure; imports `core` and `vllm` only.
"""
