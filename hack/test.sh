#!/usr/bin/env bash
# The whole test gate: set-up, lint, type checks, layer contracts, then every test
# tier (unit, integration with real DeepSpeed and databases, e2e against a real
# Kubernetes control plane). Called by `make test` and by CI (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
hack/setup.sh
PY="$(pwd)/.venv/bin/python"
export DS_ACCELERATOR=cpu
echo "== ruff"; "$PY" -m ruff check runtime operator api tests benchmarks
echo "== mypy"; "$PY" -m mypy
echo "== import contracts"; "$PY" -c 'import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())'
if [ -x hack/cluster ]; then
  echo "== control plane binaries"; hack/cluster build
fi
echo "== pytest"
exec "$PY" -m pytest -p no:cacheprovider "$@"
