"""Facts in, findings out: check's rules, the fabric discovery rule, memory, NCCL, the supervisor's policy.

Pure: no I/O on nodes (import-linter's purity contract names this package).
"""
