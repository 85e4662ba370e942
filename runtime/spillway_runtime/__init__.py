"""Spillway's training runtime: spec, hardware probe, tier planner, DeepSpeed training.

Imports neither the operator nor the API. torch and DeepSpeed are imported lazily,
so the spec and planner work in images without them.
"""

__version__ = "0.1.0"
