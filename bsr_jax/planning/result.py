"""What ``plan`` returns: ``Plan`` (the chosen step, printed as a table) and ``Measured`` (one
compiled candidate)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence

import flax.linen as nn
import jax
from flax import nnx

from bsr_jax.measure.compiled import CompiledStep
from bsr_jax.planning.options import LOSS, OPTIONS, REST
from bsr_jax.rewrite.rules import LayerTable


def _label(choices: Sequence[str], rest: str) -> str:
    runs = [f"{len(list(g))}x{name}" for name, g in itertools.groupby(choices)]
    return " + ".join(runs) + f", rest {rest}"


@dataclasses.dataclass(frozen=True)
class Measured:
    """One compiled candidate: its choices (block path -> option, ``REST`` -> the rest's), peak
    (bytes) and modelled step time (seconds). ``compiled`` False: XLA refused to compile it for
    needing more than the device's memory; ``peak`` is then the bytes XLA said it needs (at least
    that), ``seconds`` infinite."""

    choices: Mapping[str, str]
    peak: int
    seconds: float
    compiled: bool = True

    @property
    def label(self) -> str:
        """The choices in short: ``"4xremat + 8xremat-dots, rest keep"`` (``", chunked loss"``)."""
        blocks = [name for path, name in self.choices.items() if path not in (REST, LOSS)]
        return _label(blocks, self.choices[REST]) + (", chunked loss" if LOSS in self.choices else "")

    @property
    def approximations(self) -> dict[str, str]:
        """The approximate options among the choices -> their documented error (empty: exact)."""
        names = [name for path, name in self.choices.items() if path != LOSS]
        return {name: OPTIONS[name].approximation for name in dict.fromkeys(names) if not OPTIONS[name].exact}


class NoFit(ValueError):
    """``plan`` found no candidate within the budget; ``smallest``: the compiled candidate of least
    peak, at ``microbatches`` micro-batches."""

    def __init__(self, message: str, smallest: Measured, microbatches: int):
        super().__init__(message)
        self.smallest, self.microbatches = smallest, microbatches


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``plan`` chose. ``model``: a linen module with the dense parameter tree (NNX: a model
    holding a copy of the user's state, ``nnx.Param`` tree unchanged) and the same forward values,
    to use in the user's own step with ``loss_fn``, the loss it was measured with (the user's, or
    ``bsr_jax.chunked_head_loss`` of it where ``plan(loss_chunk=)`` chose that); ``choices``: block
    path -> option name (``OPTIONS``), ``REST`` -> the rest's, ``LOSS`` -> ``"chunked"`` where the
    loss is chunked; ``peak``/``modelled_seconds``: its compiled step on
    ``target``; ``dense``/``remat``: the dense step and remat-per-block (JAX's default policy;
    ``None`` where the dense step fits and nothing else was compiled); ``tried``: every candidate
    compiled, in order; ``table``: the chosen model's per-layer ``LayerTable`` (``compress_model``
    applies it as is; its step traced when first read); ``microbatches``: how many slices of the
    batch the step's gradient is accumulated over (``bsr_jax.accumulated_value_and_grad(loss,
    microbatches)`` in the user's step); ``mesh``: the axes (name -> size) of the mesh the arguments were placed on, where they
    were: then ``peak``, ``budget`` and the ``Measured`` peaks are one device's. Its ``str`` is a
    table marking every approximate choice with its documented error, then
    ``table``."""

    model: nn.Module | nnx.Module
    loss_fn: Callable[..., jax.Array]
    choices: Mapping[str, str]
    peak: int
    modelled_seconds: float
    budget: int
    target: str
    dense: Measured
    remat: Measured | None
    tried: tuple[Measured, ...]
    compiled: CompiledStep = dataclasses.field(repr=False)
    # Traces the chosen step: read only through ``table`` (auto's plans at other counts never are).
    layers: Callable[[], LayerTable] = dataclasses.field(default=lambda: LayerTable(()), repr=False, compare=False)
    microbatches: int = 1
    mesh: Mapping[str, int] | None = None

    @functools.cached_property
    def table(self) -> LayerTable:
        """The chosen model's per-layer ``LayerTable``, traced (not compiled) when first read."""
        return self.layers()

    @property
    def label(self) -> str:
        """The choices in short: ``"4xremat + 8xremat-dots, rest keep"``."""
        return Measured(self.choices, self.peak, self.modelled_seconds).label

    def __str__(self) -> str:
        mib = lambda b: f"{b / 2**20:,.0f} MiB"
        where = f" x {math.prod(self.mesh.values())} ({', '.join(f'{k}={v}' for k, v in self.mesh.items())}; per device)" if self.mesh else ""
        dense = self.dense
        # Against dense where it compiled; where XLA refused it (more than the device holds), no ratios.
        of = lambda peak, seconds: f" ({peak / dense.peak:.2f}x), {seconds * 1e3:.2f} ms ({seconds / dense.seconds:.2f}x)" if dense.compiled else f", {seconds * 1e3:.2f} ms"  # noqa: E731
        lines = [f"plan for {self.target}{where}, budget {mib(self.budget)}" + (f" ({self.budget / dense.peak:.2f} of dense's peak)" if dense.compiled else ""),
                 f"  chosen: {mib(self.peak)}{of(self.peak, self.modelled_seconds)} -- compiled",
                 f"  dense:  {mib(dense.peak)}, {dense.seconds * 1e3:.2f} ms" if dense.compiled else
                 f"  dense:  does not compile on {self.target}: XLA needs at least {mib(dense.peak)}, more than the device holds",
                 f"  remat per block: {mib(self.remat.peak)}{of(self.remat.peak, self.remat.seconds)}" if self.remat else
                 "  remat per block: not compiled (the dense step fits)",
                 "  per block:"]  # fmt: skip
        note = lambda name: "" if OPTIONS[name].exact else f"  approximate: {OPTIONS[name].approximation}"
        blocks = [(path, name) for path, name in self.choices.items() if path not in (REST, LOSS)]
        for key, group in itertools.groupby(blocks, key=lambda kv: kv[1]):
            paths = [p for p, _ in group]
            lines.append(f"    {paths[0] if len(paths) == 1 else paths[0] + ' .. ' + paths[-1]:<40} {key}{note(key)}")
        lines.append(f"    {'everything else':<40} {self.choices[REST]}{note(self.choices[REST])}")
        if LOSS in self.choices:
            lines.append(f"    {'the loss':<40} chunked (use plan.loss_fn)")
        if self.microbatches > 1:
            lines.append(f"    {'the gradient':<40} over {self.microbatches} micro-batches (bsr_jax.accumulated_value_and_grad)")
        return "\n".join(lines) + (f"\n\n{self.table}" if self.table else "")
