"""llamatron: a distributed trainer for LLaMA-family language models."""

__version__ = "0.1.0"
