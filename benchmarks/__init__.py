"""Benchmarks you run (`python -m benchmarks.<name>`); they print a table and write JSON. Not
imported by the library and not timed tests."""
