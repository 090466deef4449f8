"""dsv4-agent: one supervisor daemon per node for a DeepSeek-V4 deployment on Ascend."""

__version__ = "0.1.0"
