#!/usr/bin/env bash
# The whole test gate: set-up, lint, type checks, layer contracts, then every test
# tier (unit, integration with real DeepSpeed and databases, e2e against a real
# Kubernetes control plane). Called by `make test` and by CI (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
hack/setup.sh
VENV=${SPILLWAY_VENV:-${SPILLWAY_CACHE:-$HOME/.cache/spillway}/venv}
BIN="$VENV/bin"
echo "== ruff"; "$BIN/ruff" check runtime operator api tests benchmarks
echo "== mypy"; "$BIN/mypy"
echo "== import contracts"; "$BIN/lint-imports"
if [ -x hack/cluster ]; then
  echo "== control plane binaries"; hack/cluster build
fi
echo "== pytest"
exec "$BIN/pytest" -p no:cacheprovider "$@"
