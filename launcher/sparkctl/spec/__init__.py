"""What the cluster should be: settings and recipes in; topology, the memory plan, argv, rendered files out.

Pure: no I/O on nodes (import-linter's purity contract names this package).
"""
