"""Spillway's API service and the `spillway` command (top layer: may import operator and runtime)."""
