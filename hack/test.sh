#!/usr/bin/env bash
# The test gate, by tiers (see tests/conftest.py for what each holds):
#   hack/test.sh                 everything: set-up, then check, then the other tiers at once
#   hack/test.sh TIER...         only these: check (ruff, mypy, import contracts and the unit
#                                tests), unit, integration, e2e, realnode
#   hack/test.sh -- ARGS...      set-up and builds, then `pytest ARGS` (e.g. one test file)
#   hack/test.sh --coverage ...  any of the above under coverage.py (pyproject.toml: branches,
#                                every Python process the tests start), then its table per
#                                package (hack/coverage_report.py); data in .coverage-data/
# Called by `make test` (the README's test command and CI's) and the tiers' make targets.
# Each step prints its time; every pytest run ends with its 25 slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
# A failed step leaves no build running behind it (each build writes to a temporary
# directory and renames it into the cache when done). (`|| true`: set -e holds inside the
# trap too, and `kill` with no jobs left fails, which would turn a green run's exit 0 into 2.)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$logs"' EXIT

tiers=() pytest_args=() coverage=0
while (($#)); do
  case $1 in
  --coverage) coverage=1; shift ;;
  --) shift; pytest_args=("$@"); break ;;
  check | unit | integration | e2e | realnode) tiers+=("$1"); shift ;;
  *) echo "hack/test.sh: unknown tier '$1' (check, unit, integration, e2e, realnode; or -- PYTEST-ARGS)" >&2; exit 2 ;;
  esac
done
((${#tiers[@]} || ${#pytest_args[@]})) || tiers=(check integration e2e realnode)
wants() { [[ " ${tiers[*]} " == *" $1 "* ]]; }
# What the tiers need built: the lint and unit tests nothing; the others servers, the
# cluster's binaries and, for the real node, its images.
needs_servers=0 needs_images=0
if ((${#pytest_args[@]})) || wants integration || wants e2e || wants realnode; then needs_servers=1; fi
if ((${#pytest_args[@]})) || wants realnode; then needs_images=1; fi

SECONDS_AT_START=$SECONDS
# The disk is shared with whatever else runs on this machine, and the runtime image's cold
# build needs ~25 GB at its peak (hack/images: make_room): a red run out of space says so here.
echo "== disk: $(($(df --output=avail -k . | tail -1) / 1024 / 1024)) GiB free under $(pwd)"
timed() { # NAME CMD...: run CMD, then print its time
  local name=$1 start=$SECONDS rc=0
  shift
  echo "== $name"
  "$@" || rc=$?
  echo "== $name: $((SECONDS - start)) s$( ((rc == 0)) || echo ", failed (exit $rc)")"
  return "$rc"
}

# The builds, cached by hashes of their inputs (warm, each is a hash check), run beside the
# set-up and the lint: on a fresh machine the Go builds (control plane, Kueue, weed) start
# first and overlap the Python set-up's downloads and the image build. Each build's output
# is printed when it is waited for.
declare -A build_pids
start_build() { # NAME CMD...
  local name=$1
  shift
  echo "== $name: building in the background"
  "$@" >"$logs/build-$name.log" 2>&1 &
  build_pids[$name]=$!
}
end_builds() {
  local name rc
  for name in "${!build_pids[@]}"; do
    rc=0
    wait "${build_pids[$name]}" || rc=$?
    echo "== $name"
    cat "$logs/build-$name.log"
    if ((rc != 0)); then echo "== $name: failed, exit $rc"; exit "$rc"; fi
  done
}
binaries() {
  if [ -x hack/cluster ]; then hack/cluster build; fi  # control plane, kubelet, kwok, helm, CoreDNS, Kueue
  hack/weed build  # the S3 server (SeaweedFS)
}
if ((needs_servers)); then
  start_build "binaries (control plane, Kueue, weed)" binaries
  start_build "MLflow server and checkov (their own virtual environments)" \
    bash -c 'hack/toolenv mlflow build && hack/toolenv checkov build'
fi
# The torch + DeepSpeed wheels (downloaded and compiled once) come first: the training
# image and this machine's environment are both made from them.
wheels() { hack/setup.sh --wheels >/dev/null; }
timed "set-up: system packages, torch + DeepSpeed wheels" wheels
if ((needs_images)) && [ -x hack/images ] && [ -x hack/cluster ]; then
  start_build "images: operator, runtime-cpu" hack/images build operator runtime-cpu
fi
timed "set-up: Python environment" hack/setup.sh
PY="$(pwd)/.venv/bin/python"
export DS_ACCELERATOR=cpu
# mypy's and ruff's caches outside the checkout: a fresh clone (CI's) checks only what
# changed since the last run on this machine (mypy: ~60 s cold, ~2 s warm).
CACHE=${SPILLWAY_CACHE:-$HOME/.cache/spillway}
export MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-$CACHE/mypy} RUFF_CACHE_DIR=${RUFF_CACHE_DIR:-$CACHE/ruff}
# Three workers on two cores (the cluster tests mostly wait: on two workers the cores were
# busy about half the time): the real-pod tests on one worker and cluster, the kwok e2e
# tests on another (tests/conftest.py: ClusterOnOneWorker), the integration tests one at a
# time on the third and on whichever is done first.
WORKERS=${SPILLWAY_TEST_WORKERS:-3}
# One OpenMP thread per training process (torch's intra-op pool, DeepSpeed's CPU Adam): the
# runtime would take cores / processes each, and with three workers' runs on two cores their
# spinning threads crowd each other out. Three 30-step runs at once took 48 s with the
# default and 23 s with one thread (measured side by side); every run of a test still
# uses the same count, so bit-identical comparisons compare like with like.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
pytest() { "$PY" -m pytest -p no:cacheprovider "$@"; }  # --durations=25: pyproject.toml
if ((coverage)); then
  # Each process writes its own file (parallel = true) where COVERAGE_FILE says, an absolute
  # path every child inherits; they are combined and reported when the tiers end, pass or fail.
  rm -rf .coverage-data && mkdir .coverage-data
  export COVERAGE_FILE="$(pwd)/.coverage-data/coverage"
  pytest() { "$PY" -m coverage run -m pytest -p no:cacheprovider "$@"; }
  report_coverage() {
    "$PY" -m coverage combine -q && "$PY" hack/coverage_report.py "$COVERAGE_FILE" || true
  }
  trap 'report_coverage; kill $(jobs -p) 2>/dev/null || true; rm -rf "$logs"' EXIT
fi

if wants check; then
  timed "ruff" "$PY" -m ruff check runtime operator api tests benchmarks
  timed "mypy" "$PY" -m mypy
  timed "import contracts" "$PY" -c 'import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())'
fi
if wants check || wants unit; then
  timed "tier unit" pytest -m unit tests/unit
fi
end_builds
if ((${#pytest_args[@]})); then
  timed "pytest ${pytest_args[*]}" pytest "${pytest_args[@]}"
  exit
fi
# A real-node module is marked e2e too (its folder's tier): the e2e tier leaves it out.
declare -A mark=([integration]=integration [e2e]="(e2e and not realnode)" [realnode]=realnode)
rest=() marks=()
for tier in integration e2e realnode; do
  if wants "$tier"; then rest+=("$tier") marks+=("${mark[$tier]}"); fi
done
if ((${#rest[@]})); then
  # The real-pod tests import the 3.4 GB training image into the node's containerd (about
  # 13 GB unpacked, under the session's temporary directory); the kubelet evicts below 1%.
  free_gb=$(($(df -Pk "${TMPDIR:-/tmp}" | awk 'NR == 2 {print $4}') / 1024 / 1024))
  if ((free_gb < 20)); then
    echo "== warning: ${free_gb} GB free in ${TMPDIR:-/tmp}; the whole suite needs about 20 GB (old pytest-of-$(id -un) runs can go)"
  fi
  expression=$(printf ' or %s' "${marks[@]}")
  # -v: each test's outcome as it ends, with its worker (xdist lists failures only at the
  # end): a run stopped by hand, or by CI's time limit, still names what failed.
  timed "tiers ${rest[*]}" pytest -v -n "$WORKERS" -m "${expression# or }" tests/integration tests/e2e
fi
echo "== all: $((SECONDS - SECONDS_AT_START)) s"
