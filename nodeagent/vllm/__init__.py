"""What the agent knows of vLLM itself, independent of our config: its `/metrics` text and progress, its
fault-tolerance API and the rules of its retry, prefix-cache hit rates, the KV-transfer failure lines of its
connector, a model folder's completeness. Imports only `core`.
"""
