"""The resolved per-layer table: what each layer's backward keeps, by module path, in call order.

One table flows one way: rules are resolved (``bsr_jax.rewrite.rules.resolve``) into it while a
model is traced, ``bsr_jax.layer_table`` and ``bsr_jax.plan`` hand it out, ``compress_model(model,
table)`` applies it as is, and ``bsr_jax.residual_report`` and ``Plan`` print it. It lives here,
below the layers, because the layers' trace-time calls (``layer_choice.lookup`` / ``record`` /
``report_dense``) are what fill it (``Collector``).

Compressions are ``bsr_jax.Pruning`` / ``bsr_jax.Pooling`` objects (``storage/``, above this part):
only their methods are called here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, overload

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One layer call. ``path``: its module path (what rules match); ``layer``: its class name;
    ``compression``: what its backward keeps of its input (``None``: the input itself, exact);
    ``reason``: why it stays dense although a rule asked for a compression; ``input``: the input's
    shape/dtype where a compressing call saw it."""

    path: str
    layer: str
    compression: Any
    reason: str | None = None
    input: jax.ShapeDtypeStruct | None = None

    @property
    def compresses(self) -> bool:
        """Whether the backward keeps less than the input (a compression that would not save bytes
        keeps the input itself: sparsity 0 without a storage dtype)."""
        return self.compression is not None and self.input is not None and self.compression.saves_memory(self.input)

    @property
    def dense_bytes(self) -> int | None:
        """Bytes of the input (``None`` where no call saw it)."""
        return None if self.input is None else math.prod(self.input.shape) * jnp.dtype(self.input.dtype).itemsize

    @property
    def kept_bytes(self) -> int | None:
        """Bytes its backward keeps: of ``compression.compress(input)`` (shapes only; a stochastic
        one drawn with a dummy key), else of the input."""
        if not self.compresses:
            return self.dense_bytes
        key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype) if self.compression.needs_key else None
        return jax.eval_shape(self.compression.compress, self.input, key).nbytes


@dataclasses.dataclass(frozen=True)
class LayerTable(Sequence[LayerRow]):
    """The resolved table: ``rows`` in call order (a layer called several times, or a custom layer
    with several products on parameters, has a row per compressing call). Indexable and iterable;
    ``str()`` is an aligned text table with each input's bytes, dense and as kept."""

    rows: tuple[LayerRow, ...]

    @overload
    def __getitem__(self, i: int) -> LayerRow: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[LayerRow, ...]: ...
    def __getitem__(self, i):
        return self.rows[i]

    def __len__(self) -> int:
        return len(self.rows)

    def find(self, path: str) -> int | None:
        """The index of the first row of exactly ``path`` (no globbing), or ``None``."""
        return next((i for i, row in enumerate(self.rows) if row.path == path), None)

    def __str__(self) -> str:
        rows = [("module path", "layer", "keeps", "input", "dense KiB", "kept KiB", "why dense")]
        kib = lambda n: "-" if n is None else f"{n / 1024:.1f}"  # noqa: E731
        for row in self.rows:
            shape = "-" if row.input is None else f"{row.input.dtype}[{','.join(map(str, row.input.shape))}]"
            keeps = "dense" if row.compression is None else describe(row.compression)
            rows.append((row.path or "-", row.layer, keeps, shape, kib(row.dense_bytes), kib(row.kept_bytes), row.reason or ""))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        # Numbers right-aligned; the reason, of any length, last.
        lines = ["  ".join(c.rjust(w) if i in (4, 5) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
        compressed = sum(row.compresses for row in self.rows)
        return "\n".join([*lines, f"{len(self.rows)} layer call(s): {compressed} compressed, {len(self.rows) - compressed} keep their input"])


def describe(compression: Any) -> str:
    """The compression's fields that differ from their defaults: ``Pruning(0.7, block=(8, 8))``."""
    fields = dataclasses.fields(compression)
    first, rest = getattr(compression, fields[0].name), fields[1:]
    defaults = type(compression)(first)
    changed = [f"{f.name}={getattr(compression, f.name)!r}" for f in rest if getattr(compression, f.name) != getattr(defaults, f.name)]
    return f"{type(compression).__name__}({', '.join([repr(first), *changed])})"


@dataclasses.dataclass
class Collector:
    """Builds a ``LayerTable`` from a trace's events (``layer_choice.collecting``): a layer's first
    resolution opens its row (dense until a call compresses), its first compressing call fills it,
    a reason closes it dense; later calls add rows."""

    rows: list[LayerRow] = dataclasses.field(default_factory=list)
    layers: dict[str, str] = dataclasses.field(default_factory=dict)  # path -> class name, once resolved
    open: dict[str, int] = dataclasses.field(default_factory=dict)  # path -> its row no call has filled yet

    def resolved(self, path: str, layer: str, reason: str | None = None) -> None:
        """The layer at ``path`` resolved (``reason``: why it stays dense, where known already); the first time only."""
        if path not in self.layers:
            self.layers[path] = layer
            if reason is None:
                self.open[path] = len(self.rows)
            self.rows.append(LayerRow(path, layer, None, reason))

    def record(self, path: str, compression: Any, x: Any) -> None:
        self._put(path, LayerRow(path, self.layers.get(path, "-"), compression, None, jax.ShapeDtypeStruct(x.shape, x.dtype)))

    def dense(self, path: str, reason: str) -> None:
        self._put(path, LayerRow(path, self.layers.get(path, "-"), None, reason))

    def _put(self, path: str, row: LayerRow) -> None:
        i = self.open.pop(path, None)
        if i is None:
            self.rows.append(row)
        else:
            self.rows[i] = row

    def table(self) -> LayerTable:
        return LayerTable(tuple(self.rows))
