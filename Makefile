# The two commands a newcomer needs (see README):
#   make demo   set everything up and fine-tune the tiny example with optimizer state on NVMe
#   make test   set everything up and run lint, type checks and the whole test suite
#   make demo-cluster   the same fine-tune in a real pod of a cluster on this machine (root)
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: setup demo demo-cluster demo-cluster-down test lint unit integration e2e bench crds

setup:
	@hack/setup.sh

demo: setup
	.venv/bin/spillway make-tiny runs/models/tiny-llama --dataset runs/data/arithmetic.jsonl
	.venv/bin/spillway run examples/tiny-local.yaml

lint: setup
	$(PY) -m ruff check runtime operator api tests benchmarks
	$(PY) -m mypy
	$(PY) -c 'import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())'

demo-cluster: setup
	@hack/cluster build
	@hack/demo-cluster.sh up

demo-cluster-down:
	@hack/demo-cluster.sh down

test: setup
	@hack/test.sh

unit: setup
	$(PY) -m pytest tests/unit

integration: setup
	DS_ACCELERATOR=cpu $(PY) -m pytest tests/integration

e2e: setup
	$(PY) -m pytest tests/e2e

bench: setup
	@for b in benchmarks/bench_*.py; do echo "== $$b"; DS_ACCELERATOR=cpu $(PY) $$b || exit 1; done
