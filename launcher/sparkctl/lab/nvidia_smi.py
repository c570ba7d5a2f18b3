#!/usr/bin/python3
"""The lab's `nvidia-smi` seam: answers like a DGX Spark's (GB10) nvidia-smi does. Stdlib only.

Built from real output captured on an H200 host (driver 580.159.04, CUDA 13.0; see the project's
captures/nvidia-smi-h200/): the same CSV layout (", "-separated, "name [unit]" headers, units on
values unless nounits), the same table frame, the same error for an unknown field (exit 2), and the
real list of queryable fields (nvidia_smi_help_query.txt next to this file). What changes is only
what a GB10 differs in: the name "NVIDIA GB10", driver 580.95.05, compute capability 12.1, the PCI
address 0000000F:01:00.0, ATS addressing, and memory: GB10 has unified memory, so every memory.*
field reads "[N/A]" and the table says "Not Supported" under Memory-Usage.

Per-host values (uuid) come from nvidia-smi.json next to this file, written by `sparkctl lab up`;
tests add what this machine cannot show there (seams.set_gpu_seam): "compute_apps" (processes holding
GPU memory) and "release" (a killed engine whose memory a GB10 gives back only seconds later).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.realpath(__file__))
DRIVER = "580.95.05"
CUDA = "13.0"
NA = "[N/A]"

# canonical field -> value for a GB10 at idle; fields not listed here answer "[N/A]".
VALUES = {
    "driver_version": DRIVER,
    "count": "1",
    "name": "NVIDIA GB10",
    "serial": NA,
    "pci.bus_id": "0000000F:01:00.0",
    "pci.domain": "0x000F",
    "pci.bus": "0x01",
    "pci.device": "0x00",
    "pci.baseClass": "0x3",
    "pci.subClass": "0x2",
    "pci.device_id": "0x2E1210DE",
    "pci.sub_device_id": "0x000010DE",
    "display_mode": "Requested functionality has been deprecated",
    "display_attached": "No",
    "display_active": "Disabled",
    "persistence_mode": "Enabled",
    "addressing_mode": "ATS",
    "vbios_version": NA,
    "pstate": "P0",
    "compute_mode": "Default",
    "compute_cap": "12.1",
    "ecc.mode.current": NA,
    "ecc.mode.pending": NA,
    "temperature.gpu": "42",
    "power.management": "Supported",
    "power.draw": "11.48",
    "power.draw.average": "11.48",
    "power.draw.instant": "11.52",
    "utilization.gpu": "0",
    "utilization.memory": NA,
    "clocks.current.graphics": "2405",
    "clocks.current.sm": "2405",
    "clocks.current.memory": NA,
    "clocks.max.graphics": "3003",
    "clocks.max.sm": "3003",
    "clocks.max.memory": NA,
    "mig.mode.current": NA,
    "mig.mode.pending": NA,
    "fan.speed": NA,
}
# header units (also appended to numeric values unless "nounits"), by field prefix
UNITS = (("memory.", "MiB"), ("utilization.", "%"), ("power.draw", "W"), ("power.limit", "W"),
         ("enforced.power.limit", "W"), ("power.default_limit", "W"), ("power.min_limit", "W"),
         ("power.max_limit", "W"), ("clocks.current.", "MHz"), ("clocks.max.", "MHz"), ("clocks.applications.", "MHz"),
         ("clocks.default_applications.", "MHz"), ("clocks.gr", "MHz"), ("clocks.sm", "MHz"), ("clocks.mem", "MHz"),
         ("clocks.video", "MHz"), ("fan.speed", "%"))
# Short names nvidia-smi also accepts that are not on their own line of the help text.
SHORT = {"clocks.gr": "clocks.current.graphics", "clocks.sm": "clocks.current.sm",
         "clocks.mem": "clocks.current.memory", "clocks.max.gr": "clocks.max.graphics",
         "clocks.max.mem": "clocks.max.memory"}


def load_fields() -> dict[str, str]:
    """name (any alias) -> canonical name, parsed from the real --help-query-gpu text."""
    fields: dict[str, str] = {}
    with open(os.path.join(HERE, "nvidia_smi_help_query.txt")) as f:
        for line in f:
            if not line.startswith('"'):
                continue
            names = [part.strip().strip('"') for part in line.strip().split(" or ")]
            for name in names:
                fields[name] = names[0]
    for short, canon in SHORT.items():
        fields.setdefault(short, canon)
    return fields


def host_config() -> dict[str, str]:
    try:
        with open(os.path.join(HERE, "nvidia-smi.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"uuid": "GPU-00000000-0000-0000-0000-000000000000"}


def unit_of(field: str) -> str:
    for prefix, unit in UNITS:
        if field.startswith(prefix):
            return unit
    return ""


def value_of(canon: str, cfg: dict[str, str]) -> str:
    if canon == "timestamp":
        now = time.time()
        return time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    if canon == "uuid":
        return cfg["uuid"]
    if canon.startswith("memory."):
        return NA  # unified memory: GB10 reports no framebuffer figures
    return VALUES.get(canon, NA)


def query(spec: str, fmt: str) -> int:
    opts = {o.strip() for o in fmt.split(",")}
    if "csv" not in opts or not opts <= {"csv", "noheader", "nounits"}:
        print(f'"{fmt}" is not a valid format. Please run \'nvidia-smi -h\' for help.')
        return 2
    fields = load_fields()
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for name in names:
        if name not in fields:
            print(f'Field "{name}" is not a valid field to query.')
            print()
            return 2
    cfg = host_config()
    if "noheader" not in opts:
        print(", ".join(f"{n} [{unit_of(fields[n])}]" if unit_of(fields[n]) else n for n in names))
    row = []
    for n in names:
        value, unit = value_of(fields[n], cfg), unit_of(fields[n])
        if unit and value != NA and "nounits" not in opts:
            value = f"{value} {unit}"
        row.append(value)
    print(", ".join(row))
    return 0


def compute_apps(spec: str, fmt: str, cfg: dict[str, Any]) -> int:
    """`--query-compute-apps=pid,process_name,used_memory`: the processes a test set in the host's
    nvidia-smi.json ("compute_apps": [{"pid": .., "process_name": .., "used_memory": MiB or "[N/A]"}]);
    none by default. The header and units as the real one prints them
    (../shared/captures/nvidia-smi-h200-process/compute-apps*.csv)."""
    opts = {o.strip() for o in fmt.split(",")}
    if "csv" not in opts or not opts <= {"csv", "noheader", "nounits"}:
        print(f'"{fmt}" is not a valid format. Please run \'nvidia-smi -h\' for help.')
        return 2
    aliases = {"name": "process_name", "used_gpu_memory": "used_memory"}
    names = [aliases.get(n.strip(), n.strip()) for n in spec.split(",") if n.strip()]
    known = {"pid", "process_name", "used_memory", "gpu_uuid"}
    for name in names:
        if name not in known:
            print(f'Field "{name}" is not a valid field to query.')
            print()
            return 2
    if "noheader" not in opts:
        print(", ".join("used_gpu_memory [MiB]" if n == "used_memory" else n for n in names))
    for app in [*(cfg.get("compute_apps") or []), *released(cfg)]:
        row = []
        for n in names:
            value = str(app.get(n, cfg["uuid"] if n == "gpu_uuid" else NA))
            if n == "used_memory" and value != NA and "nounits" not in opts:
                value += " MiB"
            row.append(value)
        print(", ".join(row))
    return 0


RELEASE_STATE = "nvidia-smi.release-state.json"


def released(cfg: dict[str, Any], now: float | None = None) -> list[dict[str, Any]]:
    """The "release" seam: {"cluster": C, "delay_s": D, "pid": P, "process_name": N, "used_memory": MiB}.
    Once this host's engine has seen a container of sparkctl cluster C running and then none, the
    dead engine's process P stays listed for D seconds from the first look that found none running,
    as a GB10's driver holds a killed engine's memory for a while. P must be a pid no process has (the
    probe then says it has ended). The state lives in RELEASE_STATE next to this file."""
    rel = cfg.get("release")
    if not rel:
        return []
    now = time.time() if now is None else now
    path = os.path.join(HERE, RELEASE_STATE)
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError):
        state = {}
    try:
        r = subprocess.run(["docker", "ps", "-q", "--filter", f"label=sparkctl.cluster={rel['cluster']}",
                            "--filter", "status=running"], capture_output=True, text=True, timeout=20)
        running = bool(r.stdout.strip()) if r.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        running = None
    if running:
        state = {"seen_running": True}
    elif running is False and state.get("seen_running") and "since" not in state:
        state["since"] = now
    # Given back once the delay has passed; listed again only after the next run-then-stop.
    listed = "since" in state and now < state["since"] + float(rel.get("delay_s", 0))
    try:
        with open(path, "w") as f:
            json.dump(state, f)
    except OSError:
        pass
    if not listed:
        return []
    return [{k: rel[k] for k in ("pid", "process_name", "used_memory") if k in rel}]


def table(cfg: dict[str, str]) -> str:
    stamp = time.strftime("%a %b %d %H:%M:%S %Y")
    return stamp + "       \n" + f"""+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI {DRIVER}              Driver Version: {DRIVER}      CUDA Version: {CUDA}     |
+-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|                                         |                        |               MIG M. |
|=========================================+========================+======================|
|   0  NVIDIA GB10                    On  |   0000000F:01:00.0 Off |                  N/A |
| N/A   42C    P0             11W /  N/A  | Not Supported          |      0%      Default |
|                                         |                        |                  N/A |
+-----------------------------------------+------------------------+----------------------+

+-----------------------------------------------------------------------------------------+
| Processes:                                                                              |
|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |
|        ID   ID                                                               Usage      |
|=========================================================================================|
|  No running processes found                                                             |
+-----------------------------------------------------------------------------------------+"""


def main(argv: list[str]) -> int:
    cfg = host_config()
    query_spec: str | None = None
    apps_spec: str | None = None
    fmt: str | None = None
    flags: set[str] = set()
    i = 0

    def value(arg: str) -> tuple[str | None, int]:
        """`--opt=VALUE` or `--opt VALUE`: the value and how many extra words it took."""
        if "=" in arg:
            return arg.split("=", 1)[1], 0
        return (argv[i + 1], 1) if i + 1 < len(argv) else (None, 0)

    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--query-gpu"):
            query_spec, used = value(arg)
            i += used
        elif arg.startswith("--query-compute-apps"):
            apps_spec, used = value(arg)
            i += used
        elif arg.startswith("--format"):
            fmt, used = value(arg)
            i += used
        elif arg in ("-i", "--id"):
            i += 1  # one GPU: any id selects it
        elif arg.startswith("--id="):
            pass
        elif arg in ("-L", "--list-gpus", "-q", "--query", "-x", "--xml-format", "--help-query-gpu", "-h", "--help"):
            flags.add(arg)
        else:
            print("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
            return 2
        i += 1
    if "--help-query-gpu" in flags:
        with open(os.path.join(HERE, "nvidia_smi_help_query.txt")) as f:
            sys.stdout.write(f.read())
        return 0
    if "-h" in flags or "--help" in flags:
        print(f"NVIDIA System Management Interface -- v{DRIVER} (lab seam: a GB10)")
        return 0
    if apps_spec is not None:
        if fmt is None:
            print("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
            return 2
        return compute_apps(apps_spec, fmt, cfg)
    if query_spec is not None:
        if fmt is None:
            print("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
            return 2
        return query(query_spec, fmt)
    if flags & {"-L", "--list-gpus"}:
        print(f"GPU 0: NVIDIA GB10 (UUID: {cfg['uuid']})")
        return 0
    if flags & {"-q", "--query"}:
        print("-q is not simulated by the sparkctl lab; use --query-gpu=... --format=csv")
        return 2
    print(table(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
