"""The training program a pod (or `spillway run`) runs: the recipe and its checkpointing part,
the data it reads, the DeepSpeed configuration it builds, one process per rank under the
supervisor, and what it reports while it trains.

Imports torch, DeepSpeed and transformers, lazily where the planning commands reach it.
"""
