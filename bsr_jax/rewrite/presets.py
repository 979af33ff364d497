"""A recommended compression for a memory budget, chosen from the measured accuracy-memory front.

``recommended(budget, target="h100")`` returns the ``Pruning`` to apply to every layer
(``compress_model(model, [Rule("*", recommended(0.5))])``, or ``train.cifar``'s flags with
``--prune-scale-shift``) that was the most accurate in the project's long CIFAR-10 study among the
settings whose compiled training step needs at most ``budget`` of the dense step's peak memory on
``target``. The numbers are measured, not modelled:

* memory: the compiled peak of a full adamw training step of ResMLP-S12 at CIFAR shapes (B=128),
  compiled deviceless for an H100 or a TPU v5p (``bsr_jax.compiled_memory``), as a fraction of the
  dense step's peak on the same target: ``peak_ratio`` copies
  benchmarks/results/compiled_memory.json (``python -m benchmarks.compiled_memory --models
  resmlp-s12``; a test keeps the two equal). On other models the fraction differs (see
  docs/RESULTS.md section 10); ``memory_ratio`` is the residual-byte figure of the jaxpr, a
  diagnostic.
* accuracy: the tiny ResMLP trained 10 epochs on CIFAR-10; ``gap_points`` is dense minus the
  setting in test-accuracy points, each seed against dense's run of the same seed (same
  initialisation and data order), averaged over ``seeds`` seeds (docs/results/pareto.json, ``python
  -m benchmarks.pareto runs/long docs/results``; a test keeps the two equal). Dense's own two seeds
  end 1.8 points apart, so only same-seed gaps of a few tenths resolve anything.

Step time is not a criterion, and it is not free: the modelled time of the same ResMLP-S12 step
(``CompiledStep.modelled_seconds``, docs/RESULTS.md section 10.1) is 1.45x dense's on H100 and
3.58x on TPU v5p for all-int4, 1.43x / 3.36x for all-int8 and 7.23x on H100 for the stochastic
top-k setting, while ``nn.remat`` per block needs 0.25x / 0.30x of dense's peak at 1.25x / 0.87x
its time: where remat's recomputation is affordable it is the better choice. On CPU the int4
gradient step takes 0.78-0.84x of dense's for the tiny ResMLP and 0.88-0.90x for ResMLP-S12
(section 4.2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from bsr_jax.measure.compiled import DEVICELESS_TARGETS as TARGETS
from bsr_jax.storage.pruning import Pruning


@dataclasses.dataclass(frozen=True)
class Measured:
    """One configuration of the study (its name in ``benchmarks/cifar_grid.py``'s CONFIGS)."""

    config: str
    pruning: Pruning
    memory_ratio: float  # ResMLP-S12 residual bytes of the jaxpr, fraction of dense (diagnostic)
    gap_points: float  # dense minus this setting, test accuracy points after 10 epochs
    seeds: int
    peak_ratio: Mapping[str, float]  # target -> ResMLP-S12 compiled step peak, fraction of dense's


# Every residual of every layer (linear, Affine and LayerScale inputs) under one Pruning.
# Pruning(0.0) without a storage dtype keeps x itself: the dense baseline.
MEASURED: tuple[Measured, ...] = (
    Measured("dense", Pruning(0.0), 1.0, 0.0, 2, {"h100": 1.0, "tpu-v5p": 1.0}),
    Measured("all-s0-b16-int8", Pruning(0.0, block=16, storage_dtype="int8"), 0.466, 0.0, 2, {"h100": 0.5782, "tpu-v5p": 0.7609}),
    Measured("all-s0-b16-int4", Pruning(0.0, block=16, storage_dtype="int4"), 0.377, -0.065, 2, {"h100": 0.4930, "tpu-v5p": 0.6656}),
    Measured(
        "all-s0.5-b16-int8-stoch", Pruning(0.5, block=16, storage_dtype="int8", stochastic=True), 0.376, 1.64, 1,
        {"h100": 0.4930, "tpu-v5p": 0.8101},
    ),
)


def recommended(budget: float = 0.5, target: str = "h100") -> Pruning:
    """The most accurate measured ``Pruning`` whose compiled step needs at most ``budget`` of the
    dense step's peak memory on ``target``.

    Args:
      budget: fraction of the dense training step's compiled peak (ResMLP-S12 at CIFAR shapes, see
        the module docstring), in ``(0, 1]``. Ties in accuracy go to the setting needing less.
      target: ``"h100"`` or ``"tpu-v5p"``, the compiler whose peak counts.

    Raises:
      ValueError: ``budget`` outside ``(0, 1]``, an unknown ``target``, or a budget below every
        measured setting's peak (the message names the smallest measured one).
    """
    if not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise ValueError(f"budget must be a fraction of the dense step's compiled peak in (0, 1], got {budget!r}")
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    within = [m for m in MEASURED if m.peak_ratio[target] <= budget]
    if not within:
        smallest = min(MEASURED, key=lambda m: m.peak_ratio[target])
        raise ValueError(
            f"no measured setting needs at most {budget:.2f} of the dense step's peak on {target}; the smallest is "
            f"{smallest.config} at {smallest.peak_ratio[target]:.2f} (docs/RESULTS.md section 10; nn.remat needs less)"
        )
    return min(within, key=lambda m: (m.gap_points, m.peak_ratio[target])).pruning
