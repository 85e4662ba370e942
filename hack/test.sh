#!/usr/bin/env bash
# The whole test gate: set-up, lint, type checks, layer contracts, then every test
# tier (unit, integration with real DeepSpeed and databases, e2e against a real
# Kubernetes control plane). Called by `make test` and by CI (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
# A failed set-up or lint leaves no build running behind it (each build writes to a
# temporary directory and renames it into the cache when done).
# (`|| true`: set -e holds inside the trap too, and `kill` with no jobs left fails, which
# would turn a green run's exit 0 into 2.)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$logs"' EXIT

# The builds the tests need, cached by hashes of their inputs (warm, each is a hash check),
# run beside the set-up and the lint: on a fresh machine the Go builds (control plane,
# Kueue, weed: ~15 min of CPU) and the images (~20 min, much of it downloads and layer
# copies) overlap the set-up's downloads and each other. Each build's output is printed
# when it is waited for.
declare -A build_pids
start_build() { # NAME CMD...
  local name=$1
  shift
  echo "== $name: building in the background"
  "$@" >"$logs/build-$name.log" 2>&1 &
  build_pids[$name]=$!
}
end_build() { # NAME
  local rc=0
  wait "${build_pids[$1]}" || rc=$?
  echo "== $1"
  cat "$logs/build-$1.log"
  if ((rc != 0)); then echo "== $1: failed, exit $rc"; exit "$rc"; fi
}
binaries() {
  if [ -x hack/cluster ]; then hack/cluster build; fi  # control plane, kubelet, kwok, helm, CoreDNS, Kueue
  hack/weed build  # the S3 server (SeaweedFS)
}
start_build "binaries (control plane, Kueue, weed)" binaries
start_build "MLflow server (its own virtual environment)" hack/mlflow build
# The test cluster's images, before the tests and outside their timeouts: a change to
# pyproject.toml or requirements.lock rebuilds the training image's DeepSpeed layer
# (20+ minutes on 2 cores), which a test fixture's 15-minute limit does not cover. They
# need buildah, the first thing the set-up installs; the rest of it (the Python
# environment, DeepSpeed's ops) runs beside them.
hack/setup.sh --system
if [ -x hack/images ] && [ -x hack/cluster ] && [ $# -eq 0 ]; then
  start_build "images: operator, runtime-cpu" hack/images build operator runtime-cpu
fi
hack/setup.sh
PY="$(pwd)/.venv/bin/python"
export DS_ACCELERATOR=cpu
echo "== ruff"; "$PY" -m ruff check runtime operator api tests benchmarks
echo "== mypy"; "$PY" -m mypy
echo "== import contracts"; "$PY" -c 'import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())'
for name in "${!build_pids[@]}"; do end_build "$name"; done
if [ $# -gt 0 ]; then
  echo "== pytest $*"
  exec "$PY" -m pytest -p no:cacheprovider "$@"
fi
# The whole suite as two pytest runs at once: the e2e tests mostly wait (on the API
# server, kwok, a container starting), the others mostly compute (DeepSpeed on the CPU),
# so together they take about as long as the longer one. Each line is prefixed with its
# group; each group's summary is printed again at the end.
# The real-pod tests import the 3.4 GB training image into both nodes' containerd (about
# 13 GB unpacked, under the e2e group's temporary directory); the kubelets evict below 1%.
free_gb=$(($(df -Pk "${TMPDIR:-/tmp}" | awk 'NR == 2 {print $4}') / 1024 / 1024))
if ((free_gb < 20)); then
  echo "== warning: ${free_gb} GB free in ${TMPDIR:-/tmp}; the whole suite needs about 20 GB (old pytest-of-$(id -un) runs can go)"
fi
echo "== pytest: tests/e2e and tests/unit + tests/integration, side by side"
run_group() { # NAME PATH...
  local name=$1
  shift
  set +e
  "$PY" -m pytest -p no:cacheprovider "$@" 2>&1 | tee "$logs/$name.log" | sed -u "s/^/[$name] /"
  echo "${PIPESTATUS[0]}" >"$logs/$name.rc"
}
# Some tests run beside the e2e tests: by the durations of the last warm run (rest 31.7 min,
# e2e 29.0, before the S3 mirror's 4 minutes joined the rest and the tracking tests' 2 this
# list), that evens the groups out (the e2e group waits more than it computes, the GPU kit's
# dry run mostly waits on its child processes, the tracking tests on the MLflow server).
BESIDE_E2E=(tests/integration/api/test_local_signals.py tests/integration/api/test_dashboard.py
            tests/integration/api/test_local_launcher.py tests/integration/test_gpu_kit.py
            tests/integration/test_tracking.py)
run_group e2e tests/e2e "${BESIDE_E2E[@]}" &
run_group rest tests/unit tests/integration "${BESIDE_E2E[@]/#/--ignore=}" &
wait
rc=0
for name in e2e rest; do
  code=$(cat "$logs/$name.rc" 2>/dev/null || echo 1)
  echo "== $name: exit $code"
  sed -n '/short test summary info/,$p' "$logs/$name.log"
  tail -n 1 "$logs/$name.log"
  [ "$code" -eq 0 ] || rc=1
done
exit $rc
