"""Benchmarks and reports behind docs/RESULTS.md, grouped by the question they answer; run each
from the repository root as a module (``python -m benchmarks.memory.compiled_memory``).

- ``memory/``: what a step needs: compiled peaks and modelled time deviceless, residual bytes,
  sharded steps, the plane, the real-device check;
- ``speed/``: step times on this machine's CPU;
- ``accuracy/``: what compression costs in accuracy and gradient error (CIFAR grids, the LM study);
- ``plans/``: the planner's table;
- ``kernels/``: the weight-gradient kernels alone.

``run_info`` is what every benchmark records beside its numbers; ``tables`` renders RESULTS' tables
from the JSON in ``results/``.
"""
