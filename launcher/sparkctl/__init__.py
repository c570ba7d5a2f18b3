"""sparkctl: one declarative input, a few commands, a running multi-node vLLM service."""

__version__ = "0.1.0"
