"""The services the flows call: the service's containers, the lock and audit trail, releases, cleanup,
readiness, retention, the supervisor's state, the head's HTTP API, the argv judge.

They run things on nodes through sparkctl.cluster; orchestrate calls them (the layers contract).
"""
