"""Benchmarks for smddp; each subpackage is one runnable benchmark (``python -m benchmarks.X``)."""
