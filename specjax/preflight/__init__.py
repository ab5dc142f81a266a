"""Checks before a big launch: the per-device memory planner and the multi-process self-check."""
