"""Probe scripts: standalone Python (and sh) that the cluster layer ships to nodes over SSH
(`python3 - ARGS` with resources.probe_script(NAME) on stdin), because nodes do not have sparkctl
installed. A probe imports the standard library and, absolutely, only the stdlib-only sparkctl
modules listed in resources.PROBE_MODULES (probe_script bundles them). Local code imports the same
modules and calls their functions directly. resources.probe_script is the one loader.
"""
