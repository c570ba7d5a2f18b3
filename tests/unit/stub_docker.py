"""A stateful stand-in for the `docker` CLI on a local test node (tests/unit/localnodes.py).

Records every call (argv, node, order) in $STUB_ROOT/docker-calls.jsonl and keeps containers in
$STUB_ROOT/docker-<node>.json: enough of run / ps / inspect / rm / logs / image inspect for sparkctl's
lifecycle commands. $STUB_ROOT/docker-fail-<node> makes `docker run` fail on that node;
$STUB_ROOT/docker-exited-<node> shows that node's containers exited (code 1), and
$STUB_ROOT/docker-logs-<node> is what `docker logs` prints there; $STUB_ROOT/docker-hang-<node> (a number
of seconds) makes every call there hang that long first, as a wedged engine does. `container inspect NAME`, `logs NAME`
and `exec NAME CMD...` know a container by its name or ID (`exec` prints what it would run).
"""
import fcntl
import hashlib
import json
import os
import sys
import time

ROOT, NODE = os.environ["STUB_ROOT"], os.environ["STUB_NODE"]
argv = sys.argv[1:]
with open(os.path.join(ROOT, "docker-calls.jsonl"), "a") as log:
    fcntl.flock(log, fcntl.LOCK_EX)
    log.write(json.dumps({"node": NODE, "argv": argv, "seq": time.monotonic_ns()}) + "\n")

try:
    with open(os.path.join(ROOT, f"docker-hang-{NODE}")) as _hang:
        time.sleep(float(_hang.read()))
except FileNotFoundError:
    pass

STATE = os.path.join(ROOT, f"docker-{NODE}.json")
IMAGE_ID = "sha256:" + "a" * 64
FLAGS = {"--detach", "-d", "--rm", "--init", "--privileged", "-i", "--interactive", "-t", "-it", "--no-trunc", "-a", "-q", "-aq",
         "-f", "--force", "--follow", "--read-only"}


def load():
    try:
        with open(STATE) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return {}


def save(state):
    with open(STATE + ".tmp", "w") as fh:
        json.dump(state, fh)
    os.replace(STATE + ".tmp", STATE)


def options(words):
    """(options as (name, value) pairs, the rest after the first non-option word)."""
    opts, i = [], 0
    while i < len(words):
        w = words[i]
        if not w.startswith("-") or w == "-":
            break
        if "=" in w:
            opts.append(tuple(w.split("=", 1)))
        elif w in FLAGS:
            opts.append((w, ""))
        else:
            opts.append((w, words[i + 1] if i + 1 < len(words) else ""))
            i += 1
        i += 1
    return opts, words[i:]


def judge_argv(tail):
    """The argv judge's verdicts. $STUB_ROOT/argv-judge (JSON): {"verdict", "stage", "words"} for every argv, or
    {"refuse": WORD, ...}: refused only where an argv holds WORD (the rest ok); {"sleep": S} first sleeps S
    seconds. Without it: vLLM 0.33.0 accepts every argv. Each judged argv is appended to argv-judged.jsonl."""
    try:
        with open(os.path.join(ROOT, "argv-judge")) as fh:
            plan = json.load(fh)
    except FileNotFoundError:
        plan = {}
    time.sleep(float(plan.get("sleep", 0)))
    ranks = json.loads(tail[-1])
    for item in ranks:
        with open(os.path.join(ROOT, "argv-judged.jsonl"), "a") as fh:
            fh.write(json.dumps(item["argv"]) + "\n")
        doc = {"verdict": "ok", "stage": "config", "words": ""}
        if "refuse" in plan:
            if plan["refuse"] in item["argv"]:
                doc = {k: plan[k] for k in ("verdict", "stage", "words")}
        elif "verdict" in plan:
            doc = {k: plan[k] for k in ("verdict", "stage", "words")}
        print("some vLLM log line")
        print("@@sparkctl-argv " + json.dumps({"rank": item["rank"], **doc, "vllm": plan.get("vllm", "0.33.0")}))
    return 0


def main():
    if not argv:
        return 0
    cmd, rest = argv[0], argv[1:]
    lockf = open(STATE + ".lock", "a")  # noqa: SIM115
    fcntl.flock(lockf, fcntl.LOCK_EX)
    state = load()
    images = state.setdefault("images", {})
    state = state.setdefault("containers", {})
    full = {"containers": state, "images": images}
    def known(ref):
        return ref in state or any(c["Name"] == "/" + ref for c in state.values())

    if cmd == "container" and rest[:1] == ["inspect"]:
        _, refs = options(rest[1:])
        missing = [r for r in refs if not known(r)]
        for r in missing:
            print(f"Error: No such container: {r}", file=sys.stderr)
        return 1 if missing or not refs else 0
    if cmd == "exec":
        _, tail = options(rest)
        if not tail or not known(tail[0]):
            print(f"Error response from daemon: No such container: {tail[0] if tail else ''}", file=sys.stderr)
            return 1
        print(f"exec in {tail[0]}: {' '.join(tail[1:])}")
        return 0
    if cmd == "tag":  # another name for the same image (same ID), as Docker does
        _, words = options(rest)
        src, dst = (words + ["", ""])[:2]
        if src not in images:
            print(f"Error response from daemon: No such image: {src}", file=sys.stderr)
            return 1
        images[dst] = {**images[src], "RepoTags": sorted({*images[src].get("RepoTags", []), dst})}
        save(full)
        return 0
    if cmd == "pull" and "@sha256:" in (rest[-1] if rest else ""):  # by digest: one ID everywhere, RepoDigests kept
        ref = rest[-1]
        if os.path.exists(os.path.join(ROOT, f"registry-refuses-{NODE}")):
            print(f"Error response from daemon: pull access denied for {ref.split('@')[0]}", file=sys.stderr)
            return 1
        iid = "sha256:" + hashlib.sha256(ref.encode()).hexdigest()
        images[ref] = {"Id": iid, "RepoTags": [], "RepoDigests": [ref], "Config": {"Labels": {}},
                       "RootFS": {"Type": "layers", "Layers": ["sha256:" + "c" * 64]}}
        save(full)
        return 0
    if cmd in ("pull", "build"):
        opts, words = options(rest)
        tags = [v for k, v in opts if k in ("--tag", "-t")] or words[-1:]
        labels = dict(v.split("=", 1) for k, v in opts if k == "--label" and "=" in v)
        for ref in tags:
            iid = "sha256:" + hashlib.sha256(json.dumps([ref, labels]).encode()).hexdigest()
            images[ref] = {"Id": iid, "RepoTags": [ref], "Config": {"Labels": labels},
                           "RootFS": {"Type": "layers", "Layers": ["sha256:" + "b" * 64]}}
        save(full)
        return 0
    if cmd == "image" and rest[:1] == ["inspect"]:
        opts, refs = options(rest[1:])
        found = [images[r] for r in refs if r in images]
        if any(k == "--format" for k, _ in opts):
            for doc in found:
                print(doc["Id"])
        else:
            print(json.dumps(found))
        for r in refs:
            if r not in images:
                print(f"Error: No such image: {r}", file=sys.stderr)
        return 0 if len(found) == len(refs) else 1
    if cmd == "run":
        if os.path.exists(os.path.join(ROOT, f"docker-fail-{NODE}")):
            print("docker: Error response from daemon: stub refuses to run here.", file=sys.stderr)
            return 125
        opts, tail = options(rest)
        name = next((v for k, v in opts if k == "--name"), "anon")
        image = images.get(tail[0], {}) if tail else {}
        if ("--label", "sparkctl.purpose=argv-judge") in opts:  # argvjudge: the image's vLLM judges each argv
            return judge_argv(tail)
        if ("--entrypoint", "python3") in opts and "--rm" in rest:  # build's version probe in a layer
            layer = image.get("Config", {}).get("Labels", {}).get("sparkctl.layer", "")
            swapped = layer in ("v145", "keys", "keys3")  # the lab chain's v145 swaps exllamav3 0.0.43 -> 1.4.5
            print("@@versions " + json.dumps({"vllm": "0.33.0", "torch": "absent", "nccl": "absent",
                                             "exllamav3": "1.4.5" if swapped else "0.0.43"}))
            return 0
        labels = {**image.get("Config", {}).get("Labels", {}),
                  **dict(v.split("=", 1) for k, v in opts if k in ("--label", "-l") and "=" in v)}
        cid = ("%064x" % (abs(hash((NODE, name, time.monotonic_ns()))) % 16**64))
        if any(c["Name"] == "/" + name for c in state.values()):
            print(f'docker: Error response from daemon: Conflict. The container name "/{name}" is already in use.',
                  file=sys.stderr)
            return 125
        state[cid] = {"Id": cid, "Name": "/" + name, "Image": image.get("Id", IMAGE_ID), "RestartCount": 0,
                      "Path": tail[1] if len(tail) > 1 else "", "Args": tail[2:],
                      "Config": {"Labels": labels, "Image": tail[0] if tail else "", "Env": []},
                      "State": {"Status": "running", "Running": True, "ExitCode": 0, "Error": "",
                                "StartedAt": time.strftime("%Y-%m-%dT%H:%M:%S.000000000Z", time.gmtime())}}
        save(full)
        print(cid)
        return 0
    if cmd == "ps":
        opts, _ = options(rest)
        want = [v for k, v in opts if k == "--filter" and v.startswith("label=")]
        for cid, c in state.items():
            labels = c["Config"]["Labels"]
            have = {f"{k}={v}" for k, v in labels.items()} | set(labels)
            if all(w[len("label="):] in have for w in want):
                print(cid)
        return 0
    if cmd == "inspect":
        _, ids = options(rest)
        docs = [state[i] for i in ids if i in state]
        if os.path.exists(os.path.join(ROOT, f"docker-exited-{NODE}")):
            for d in docs:
                d["State"].update(Status="exited", Running=False, ExitCode=1)
        print(json.dumps(docs))
        return 0 if len(docs) == len(ids) else 1
    if cmd == "rm":
        _, ids = options(rest)
        for i in ids:
            state.pop(i, None)
        save(full)
        return 0
    if cmd == "logs":
        _, names = options(rest)
        if names and not known(names[-1]):
            print(f"Error response from daemon: No such container: {names[-1]}", file=sys.stderr)
            return 1
        given = os.path.join(ROOT, f"docker-logs-{NODE}")
        if os.path.exists(given):
            with open(given) as f:
                sys.stdout.write(f.read())
            return 0
        for line in ("INFO stub engine started", f"INFO serving {names[-1] if names else '?'}", "INFO done"):
            print(line)
        return 0
    if cmd == "version":
        print(json.dumps({"Client": {"Version": "27.5.1"}, "Server": {"Version": "27.5.1", "ApiVersion": "1.47"}}))
        return 0
    return 0


sys.exit(main())
