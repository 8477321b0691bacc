"""dtlab: a distributed-training lab for PyTorch."""

__version__ = "0.1.0"
