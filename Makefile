# The two commands a newcomer needs (see README):
#   make demo   set everything up and fine-tune the tiny example with optimizer state on NVMe
#   make test   set everything up and run lint, type checks and the whole test suite
SHELL := /bin/bash
VENV ?= $(HOME)/.cache/spillway/venv
BIN := $(VENV)/bin
export SPILLWAY_VENV := $(VENV)

.PHONY: setup demo test lint unit integration e2e bench crds

setup:
	@hack/setup.sh

demo: setup
	$(BIN)/spillway make-tiny runs/models/tiny-llama --dataset runs/data/arithmetic.jsonl
	$(BIN)/spillway run examples/tiny-local.yaml

lint: setup
	$(BIN)/ruff check runtime operator api tests benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports

test: setup
	@hack/test.sh

unit: setup
	$(BIN)/pytest tests/unit

integration: setup
	$(BIN)/pytest tests/integration

e2e: setup
	$(BIN)/pytest tests/e2e

bench: setup
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done
