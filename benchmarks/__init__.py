"""Benchmarks: modules you run (python -m benchmarks.x); not imported by the library."""
