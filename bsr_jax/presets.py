"""A recommended compression for a memory budget, chosen from the measured accuracy-memory front.

``recommended(budget)`` returns the ``Pruning`` to apply to every layer
(``compress_model(model, [Rule("*", recommended(0.5))])``, or ``train.cifar``'s flags with
``--prune-scale-shift``) that was the most accurate in the project's long CIFAR-10 study among the
settings keeping at most ``budget`` of dense activation memory. The numbers are measured, not
modelled: ``MEASURED`` copies docs/results/pareto.json (``python -m benchmarks.pareto runs/long
docs/results``; a test keeps the two equal), i.e.

* memory: activation memory the backward pass keeps on ResMLP-S12 at CIFAR shapes (B=128), as a
  fraction of the dense model's. On other models the fraction differs: compressions shrink the
  inputs of parameterised layers only (see ``residual_report`` for your model).
* accuracy: the tiny ResMLP trained 10 epochs on CIFAR-10; ``gap_points`` is dense minus the
  setting in test-accuracy points, each seed against dense's run of the same seed (same
  initialisation and data order), averaged over ``seeds`` seeds. Dense's own two seeds end 1.8
  points apart, so only same-seed gaps of a few tenths resolve anything.

Step time is not a criterion: low-precision storage costs time where it is computed (on this
project's CPU measurement, int8 1.18x and int4 1.59x dense's gradient step; docs/RESULTS.md
section 9).
"""

from __future__ import annotations

import dataclasses

from bsr_jax.format import Pruning


@dataclasses.dataclass(frozen=True)
class Measured:
    """One configuration of the study (its name in ``benchmarks/cifar_grid.py``'s CONFIGS)."""

    config: str
    pruning: Pruning
    memory_ratio: float  # ResMLP-S12 activation memory, fraction of dense
    gap_points: float  # dense minus this setting, test accuracy points after 10 epochs
    seeds: int


# Every residual of every layer (linear, Affine and LayerScale inputs) under one Pruning.
# Pruning(0.0) without a storage dtype keeps x itself: the dense baseline.
MEASURED: tuple[Measured, ...] = (
    Measured("dense", Pruning(0.0), 1.0, 0.0, 2),
    Measured("all-s0-b16-int8", Pruning(0.0, block=16, storage_dtype="int8"), 0.466, 0.0, 2),
    Measured("all-s0-b16-int4", Pruning(0.0, block=16, storage_dtype="int4"), 0.377, -0.065, 2),
    Measured("all-s0.5-b16-int8-stoch", Pruning(0.5, block=16, storage_dtype="int8", stochastic=True), 0.376, 1.64, 1),
)


def recommended(budget: float = 0.5) -> Pruning:
    """The most accurate measured ``Pruning`` keeping at most ``budget`` of dense activation memory.

    Args:
      budget: fraction of the dense model's activation memory (ResMLP-S12 accounting, see the
        module docstring), in ``(0, 1]``. Ties in accuracy go to the setting keeping less.

    Raises:
      ValueError: ``budget`` outside ``(0, 1]``, or below every measured setting's memory (the
        message names the smallest measured one).
    """
    if not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise ValueError(f"budget must be a fraction of dense activation memory in (0, 1], got {budget!r}")
    within = [m for m in MEASURED if m.memory_ratio <= budget]
    if not within:
        smallest = min(MEASURED, key=lambda m: m.memory_ratio)
        raise ValueError(
            f"no measured setting keeps at most {budget:.2f} of dense activation memory; the smallest is "
            f"{smallest.config} at {smallest.memory_ratio:.2f} (docs/RESULTS.md, accuracy at memory)"
        )
    return min(within, key=lambda m: (m.gap_points, m.memory_ratio)).pruning
