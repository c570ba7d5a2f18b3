#!/usr/bin/env bash
# The fidelity venv: vLLM 0.33.0's own parser, config classes and KV-cache planner, on CPU.
#
#   tests/fidelity/setup_venv.sh          create or reuse ${SPARKCTL_FIDELITY_VENV:-/var/cache/sparkctl/fidelity-venv}
#   then: SPARKCTL_FIDELITY=1 $VENV/bin/python -m pytest -q -m fidelity tests/fidelity
#
# torch 2.13.0 CPU comes from the machine's wheel cache (/opt/wheels), else PyTorch's CPU index; vLLM
# 0.33.0 from /var/cache/sparkctl/wheels when it lies there, else PyPI. Both go in with --no-deps (vLLM's metadata
# asks torch==2.14.0 and a stack of CUDA packages), and so does requirements.txt, where every other
# package is pinned: nothing CUDA-only enters the venv. A stamp (hash of requirements.txt and this
# script) skips the install when nothing changed; prints the venv's path on stdout.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${SPARKCTL_FIDELITY_VENV:-/var/cache/sparkctl/fidelity-venv}"
if [[ -z "${SPARKCTL_FIDELITY_VENV:-}" ]] && ! mkdir -p /var/cache/sparkctl 2>/dev/null; then
  venv="${XDG_CACHE_HOME:-$HOME/.cache}/sparkctl/fidelity-venv"  # not root: a per-user cache
fi
wheels="${SPARKCTL_WHEELS:-/var/cache/sparkctl/wheels}"            # vllm-0.33.0-*.whl, if downloaded
torch_wheels="${SPARKCTL_TORCH_WHEELS:-/opt/wheels}"               # torch-2.13.0+cpu-*.whl, if there
py="${PYTHON:-python3}"
TORCH="torch==2.13.0"
VLLM="vllm==0.33.0"

say() { printf '==> %s\n' "$*" >&2; }

repo="$(cd "$here/../.." && pwd)"
# The stamp covers what goes into the venv: requirements.txt, this script and sparkctl's runtime dependencies
# (pyproject.toml's [project].dependencies only, so a change to its tool settings does not rebuild the venv).
runtime_deps="$("$py" -c 'import sys, tomllib; print(*tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"], sep="\n")' "$repo/pyproject.toml")"
want="$({ cat "$here/requirements.txt" "$here/setup_venv.sh"; printf '%s\n' "$runtime_deps"; } | sha256sum | cut -c1-16)"
stamp="$venv/.sparkctl-fidelity-stamp"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "$venv"
  exit 0
fi

start=$SECONDS
say "building the fidelity venv at $venv (first run, or requirements.txt / setup_venv.sh changed)"
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
"$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps)

# torch CPU: the machine's wheel cache, else PyTorch's CPU index (PyPI's torch is the CUDA build).
torch_wheel="$(ls "$torch_wheels"/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n 1 || true)"
if [[ -n "$torch_wheel" ]]; then
  "${pip[@]}" "$torch_wheel" >&2
else
  "${pip[@]}" --index-url https://download.pytorch.org/whl/cpu "$TORCH+cpu" >&2
fi
# torch's own (pure Python) dependencies, pinned in requirements.txt with the rest.
"${pip[@]}" -r "$here/requirements.txt" >&2

vllm_wheel="$(ls "$wheels"/vllm-0.33.0-*.whl 2>/dev/null | head -n 1 || true)"
if [[ -n "$vllm_wheel" ]]; then
  "${pip[@]}" "$vllm_wheel" >&2
else
  "${pip[@]}" "$VLLM" >&2
fi

# sparkctl's own runtime dependencies (the tests import sparkctl from the checkout): read from
# pyproject.toml, installed with their own dependencies, none of which is torch or CUDA.
mapfile -t deps < <("$venv/bin/python" -c 'import sys, tomllib; print(*tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"], sep="\n")' "$repo/pyproject.toml")
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${deps[@]}" >&2
# A smoke import, so a broken venv fails here and not as 40 test errors.
VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c 'import torch, vllm, tenacity, rich, paramiko; from vllm.engine.arg_utils import AsyncEngineArgs' >&2
echo "$want" > "$stamp"
say "fidelity venv ready in $((SECONDS - start)) s"
echo "$venv"
