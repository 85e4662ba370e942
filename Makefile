# The two commands a newcomer needs (see README):
#   make demo   set everything up and fine-tune the tiny example with optimizer state on NVMe
#   make test   set everything up and run lint, type checks and the whole test suite
#   make demo-cluster   the same fine-tune in a real pod of a cluster on this machine (root)
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: setup demo demo-cluster demo-cluster-down test check lint unit integration e2e realnode coverage bench crds

setup:
	@hack/setup.sh

demo:  # installs only what a local run needs (hack/setup.sh --demo)
	@hack/setup.sh --demo
	.venv/bin/spillway make-tiny runs/models/demo-llama --hidden-size 256 --layers 8 --dataset runs/data/arithmetic.jsonl
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

# The test tiers (tests/conftest.py says what each holds), each alone; `make test` runs
# them all. Each prints its time and its 25 slowest tests.
test:
	@hack/test.sh

check:  # ruff, mypy, import contracts, the unit tests
	@hack/test.sh check

unit:
	@hack/test.sh unit

integration:  # real DeepSpeed on the CPU, databases, S3 and MLflow servers
	@hack/test.sh integration

e2e:  # the test cluster's control plane with kwok nodes
	@hack/test.sh e2e

realnode:  # real pods on the test cluster's real node
	@hack/test.sh realnode

coverage:  # every tier's tests under coverage.py: branch coverage per package
	@hack/test.sh --coverage unit integration e2e realnode

bench: setup
	@for b in benchmarks/bench_*.py; do echo "== $$b"; DS_ACCELERATOR=cpu $(PY) $$b || exit 1; done
