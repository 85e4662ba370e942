"""The planning core: what a job may ask for (`spec`), what it reports (`status`), what every
program agrees on (`contract`), what a node has (`hardware`) and where a job's training state
goes (`planner` with its sizing modules).

The operator, the API and `spillway plan` import only this part of the runtime, so it imports
neither torch, DeepSpeed nor transformers (an import-linter contract in pyproject.toml).
"""
