"""The image chain: per-layer build contexts, content hashes, the base image's pin, Dockerfiles.

Pure: no I/O on nodes (import-linter's purity contract names this package).
"""
