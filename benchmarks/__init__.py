"""Benchmarks and reports behind docs/RESULTS.md; run from the repository root as modules
(``python -m benchmarks.memory``) or scripts (``python benchmarks/memory.py``)."""
