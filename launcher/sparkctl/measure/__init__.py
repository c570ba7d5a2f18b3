"""bench's figures as vLLM names them, and the argv and result readers of `vllm bench serve` and llama-benchy.

Pure: no I/O on nodes (import-linter's purity contract names this package).
"""
