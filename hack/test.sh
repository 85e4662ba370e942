#!/usr/bin/env bash
# The whole test gate: set-up, lint, type checks, layer contracts, then every test
# tier (unit, integration with real DeepSpeed and databases, e2e against a real
# Kubernetes control plane). Called by `make test` and by CI (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
# A failed set-up or lint leaves no build running behind it (each build writes to a
# temporary directory and renames it into the cache when done).
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$logs"' EXIT

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
# The whole suite as three pytest runs at once (below). Each line is prefixed with its
# group; each group's summary is printed again at the end.
# The real-pod tests import the 3.4 GB training image into both nodes' containerd (about
# 13 GB unpacked, under the e2e group's temporary directory); the kubelets evict below 1%.
free_gb=$(($(df -Pk "${TMPDIR:-/tmp}" | awk 'NR == 2 {print $4}') / 1024 / 1024))
if ((free_gb < 20)); then
  echo "== warning: ${free_gb} GB free in ${TMPDIR:-/tmp}; the whole suite needs about 20 GB (old pytest-of-$(id -un) runs can go)"
fi
echo "== pytest: tests/e2e, the training tests and the rest (unit, API, other integration), side by side"
run_group() { # NAME PATH...
  local name=$1
  shift
  set +e
  "$PY" -m pytest -p no:cacheprovider "$@" 2>&1 | tee "$logs/$name.log" | sed -u "s/^/[$name] /"
  echo "${PIPESTATUS[0]}" >"$logs/$name.rc"
}
# Three groups. As two (e2e with five API/kit files beside it, 32.6 min; unit and
# integration, 33.0 min) the run kept about 1.3 of the 2 cores busy: the e2e tests wait
# on the API server, kwok and containers starting, the API tests on their servers. The
# DeepSpeed training tests (real training, several processes each) are a group of their
# own now, beside the e2e tests and the rest. Concurrent runs share nothing: each picks
# free ports, its own temporary directories and database servers.
TRAINING=(tests/integration/test_exact_resume.py tests/integration/test_reshard.py
          tests/integration/test_distributed.py tests/integration/test_lora.py
          tests/integration/test_checkpoint_kill_points.py tests/integration/test_mirror.py
          tests/integration/test_evaluation.py)
run_group e2e tests/e2e &
run_group training "${TRAINING[@]}" &
run_group rest tests/unit tests/integration "${TRAINING[@]/#/--ignore=}" &
wait
rc=0
for name in e2e training rest; do
  code=$(cat "$logs/$name.rc" 2>/dev/null || echo 1)
  echo "== $name: exit $code"
  sed -n '/short test summary info/,$p' "$logs/$name.log"
  tail -n 1 "$logs/$name.log"
  [ "$code" -eq 0 ] || rc=1
done
exit $rc
