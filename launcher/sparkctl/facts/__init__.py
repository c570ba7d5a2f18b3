"""Parsers of what nodes and tools print: each returns its fact or raises its own error, never another.

Input is untrusted. Pure: no I/O on nodes (import-linter's purity contract names this package).
"""
