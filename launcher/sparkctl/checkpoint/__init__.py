"""The checkpoint rules: a scan of the model folder in, findings out; model sync's plan.

Pure: no I/O on nodes (import-linter's purity contract names this package).
"""
