"""Probes: a probe's targets from its component, the probe kinds' runs, the Kubernetes-style
startup/liveness/readiness runner, the watch of a vLLM's own process tree.
"""
