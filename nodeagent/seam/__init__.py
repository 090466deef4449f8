"""What the node and the cluster layer share, and nothing else: the `StackPort` contract (holds, views,
layers), the plain values a component exchanges with its host, the restart policy both apply.
"""
