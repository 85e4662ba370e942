"""Spillway's Kubernetes operator (kopf). Imports runtime (spec, planner), never api."""
