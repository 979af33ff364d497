"""The candidates ``plan`` compiles: ``Family`` (what differs between linen and NNX models) and
``Candidates`` (each candidate lowered, compiled deviceless once, cached by its choices, remembered
in order; over a mesh, on the target's devices; ``prefetch`` compiles ahead, two at a time, in
threads: XLA compiles outside Python's lock, while the caller traces the next candidate). A
candidate XLA refuses to compile because it needs more than the device's memory (XLA:TPU checks its
HBM) is remembered as not fitting, with the bytes XLA said it needs as its peak
(``Measured.compiled`` False), not raised."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import optax
from jax.sharding import Mesh

from bsr_jax.measure.compiled import CompiledStep, compiled_memory, lower_for
from bsr_jax.planning import placement
from bsr_jax.planning.options import LOSS, REST
from bsr_jax.planning.result import Measured


class Family(Protocol):
    """What differs between linen models (``Linen``) and NNX ones (``bsr_jax.planning.nnx.Nnx``)
    for ``plan``, whose search is the same for both. Constructed as ``(model, loss_fn, batch,
    variables, init_args)``; ``assemble(choices, rest)``: the model with ``blocks[i]`` as
    ``OPTIONS[choices[i]]``, the rest as ``OPTIONS[rest]``; ``step(module, optimizer, loss_fn,
    microbatches, value_and_grad)``: ``step(state, opt_state, *batch) -> (state, opt_state, loss)``
    of that module, its gradient as ``plan``'s arguments of those names say."""

    name: str  # the kind, for messages: "flax.linen"
    loss_args: tuple[str, ...]  # what loss_fn takes before the batch: ("module", "variables")
    loss_example: str  # a loss of that form, for messages
    unavailable: Mapping[str, str]  # block options this kind cannot take -> why (an instance's: this model, too)
    rest_unavailable: Mapping[str, str]  # the same for the rest
    blocks: tuple[str, ...]  # the repeated blocks' paths
    state: Any  # abstract: the step's first argument (donated)
    params: Any  # abstract: what the optimizer updates (its state is the step's second argument)

    def assemble(self, choices: Sequence[str], rest: str) -> Any: ...

    def step(self, module: Any, optimizer: optax.GradientTransformation, loss_fn: Callable[..., jax.Array], microbatches: int = 1,
             value_and_grad: Callable[..., Any] | None = None) -> Callable[..., Any]: ...


# XLA compiles in parallel in threads (outside Python's lock): two at once took 20 s where one after
# the other took 27 s on 2 cores (deviceless H100, the 12 x 768 LM); more would contend for the cores.
COMPILE_THREADS = min(2, os.cpu_count() or 1)


def traced_on(mesh: Mesh | None) -> contextlib.AbstractContextManager:
    """Where a candidate step is traced: under ``jax.set_mesh`` of the target's mesh when there is
    one (Explicit axes and ``bsr_jax``'s per-shard ops read it)."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


COUNT = 4  # the micro-batch count's place in ``Candidates.scope``


class Candidates:
    """Lowers and compiles candidates (cached by their choices) and remembers them in order."""

    def __init__(self, family: Family, loss_fns: Mapping[str, Callable[..., jax.Array]], batch, optimizer, target, progress, cache,
                 microbatches: int = 1, mesh: Mesh | None = None, value_and_grad: Callable[..., Any] | None = None):  # fmt: skip
        self.family, self.loss_fns, self.batch, self.optimizer, self.target, self.progress = family, loss_fns, batch, optimizer, target, progress
        self.microbatches, self.mesh, self.value_and_grad = microbatches, mesh, value_and_grad
        self.opt_state = jax.eval_shape(optimizer.init, family.params)
        if mesh is not None:
            self.opt_state = placement.optimizer_state_on_mesh(optimizer, family.params, self.opt_state, mesh)
        self.shared = cache if cache is not None else {}
        self.cache: dict[tuple, tuple[Measured, CompiledStep | None]] = {}  # this search's, in order (None: XLA refused it)
        self.lowered: dict[tuple, tuple[str, Any]] = {}  # choices -> (the lowered program's hash, lowered)
        self.programs: dict[str, tuple[str, CompiledStep]] = {}  # the lowered program's hash -> its first label, compiled
        self.pending: dict[str, tuple[concurrent.futures.Future, bool]] = {}  # program hash -> (its compile, with breakdown)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # A shared cache's entries hold for one step only: the target, the blocks and the shapes.
        leaves, structure = jax.tree.flatten((family.state, batch))
        placed = tuple(str(getattr(a, "sharding", None) and a.sharding.spec) for a in leaves) if mesh else ()
        self.scope = (target, tuple(family.blocks), str(structure), tuple((a.shape, str(a.dtype)) for a in leaves), microbatches,  # at COUNT
                      value_and_grad and getattr(value_and_grad, "__qualname__", repr(value_and_grad)),
                      mesh and tuple(mesh.shape.items()), placed)  # fmt: skip
        # Every candidate holds its arguments (their shards, over a mesh) at once: a floor under any compiled peak.
        self.argument_bytes = placement.bytes_per_device((family.state, self.opt_state, batch))

    def at_count(self, microbatches: int) -> tuple:
        """``scope`` of the same step at another micro-batch count."""
        return self.scope[:COUNT] + (microbatches,) + self.scope[COUNT + 1 :]

    def on_mesh(self) -> contextlib.AbstractContextManager:
        """Where the step is traced: ``traced_on(self.mesh)``."""
        return traced_on(self.mesh)

    def program(self, choices: Sequence[str], rest: str, loss: str = "plain") -> str:
        """The hash of the candidate's lowered step: lowering is cheap, compiling is not."""
        key = (tuple(choices), rest, loss)
        if key not in self.lowered:
            step = self.family.step(self.family.assemble(choices, rest), self.optimizer, self.loss_fns[loss], self.microbatches, self.value_and_grad)
            with self.on_mesh():
                lowered = lower_for(step, self.family.state, self.opt_state, *self.batch, target=self.target, donate_argnums=(0, 1),
                                    devices=self.mesh.size if self.mesh else 1)  # fmt: skip
            self.lowered[key] = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), lowered)
        return self.lowered[key][0]

    def lower(self, keys: Sequence[tuple]) -> list[tuple[tuple, str]]:
        """Lowers these candidates (``(choices, rest, loss)``) that are not cached yet, this
        search's or a shared cache's: their keys and programs' hashes."""
        keys = [(tuple(choices), rest, loss) for choices, rest, loss in keys]
        return [(key, self.program(*key)) for key in keys if key not in self.cache and (self.scope, *key) not in self.shared]

    def prefetch(self, keys: Sequence[tuple], breakdown: bool = False) -> None:
        """Start compiling these candidates (``(choices, rest, loss)``) in the background, at most
        ``COMPILE_THREADS`` at a time, each lowered here first; ``measure`` takes the result. What
        is cached, compiled or started already is skipped."""
        for key, program in self.lower(keys):
            if program in self.programs or program in self.pending:
                continue
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="bsr_jax-plan")
            future = self._pool.submit(compiled_memory, self.lowered[key][1], target=self.target, breakdown=breakdown, triton_gemm=self.triton_gemm())
            self.pending[program] = (future, breakdown)

    def close(self) -> None:
        """Drop the compiles not started yet (one running finishes in its thread, unread)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self.pending.clear()

    def _compiled(self, key: tuple, program: str, breakdown: bool) -> CompiledStep:
        """The candidate's compiled step: prefetched (waited for), or compiled now."""
        future, with_breakdown = self.pending.pop(program, (None, False))
        if future is not None and (with_breakdown or not breakdown) and not future.cancelled():
            return future.result()
        return compiled_memory(self.lowered[key][1], target=self.target, breakdown=breakdown, triton_gemm=self.triton_gemm())

    def triton_gemm(self) -> bool | None:
        """``compiled_memory``'s ``triton_gemm`` for the next compile: ``False`` (cuBLAS) once a step of
        this model (at any micro-batch count) compiled for H100 has no Triton GEMM, as where XLA
        found no Triton tiling without the device and fell back: every candidate then compiles so,
        one instrument for the whole search, without a failed Triton attempt first (ViT-B/16: 2.7 s
        of each 11.3 s compile). ``None`` (Triton where it tiles) before that, or where one has."""
        if self.target != "h100":
            return None
        kinds = {step.triton_gemm for (scope, *_), (_, step) in self.shared.items() if scope[:COUNT] == self.scope[:COUNT] and step is not None}
        return False if kinds == {False} else None

    def measure(self, choices: Sequence[str], rest: str, loss: str = "plain", breakdown: bool = False,
                predicted: tuple[float, float] | None = None) -> Measured:  # fmt: skip
        """The candidate compiled (once); ``breakdown``: with what is live at its peak and every
        kernel named (``CompiledStep.live_at_peak``, ``kernels``), for the cost model;
        ``predicted``: the cost model's (peak, seconds) for it, shown in the progress row."""
        key = (tuple(choices), rest, loss)
        if key not in self.cache and (self.scope, *key) in self.shared:
            self.cache[key] = self.shared[(self.scope, *key)]
        if breakdown and key in self.cache and self.cache[key][0].compiled and not self.cache[key][1].kernels:
            del self.cache[key]  # compiled before without its breakdown: again, with it
        if key not in self.cache:
            program = self.program(*key)
            # Different choices can make the same program (dots_saveable where no product has batch
            # axes is dots_with_no_batch_dims_saveable): compiled once.
            same = self.programs.get(program)
            same = same if same and (same[1].kernels or not breakdown) else None
            choices_by_path = dict(zip(self.family.blocks, choices)) | {REST: rest} | ({LOSS: loss} if loss != "plain" else {})
            try:
                compiled = same[1] if same else self._compiled(key, program, breakdown)
            except Exception as error:  # XLA raises its own runtime error type
                needs = over_device_memory(error)
                if needs is None:
                    raise
                measured = Measured(choices_by_path, needs + self.argument_bytes, math.inf, compiled=False)
                self.cache[key] = self.shared[(self.scope, *key)] = (measured, None)
                if self.progress:
                    print(f"[plan] {len(self.cache):>3} {measured.label:<44} {measured.peak / 2**20:>10,.0f} MiB {'':>12}  not compiled: "
                          f"XLA needs at least this, more than the device holds", file=sys.stderr, flush=True)  # fmt: skip
                return measured
            seconds, scale = compiled.modelled_seconds, None
            if seconds is None:  # XLA:TPU's cost model cannot time some programs: the roofline's, as a timed step like it compares
                scale = self._time_scale(key)
                seconds = compiled.roofline_seconds * (scale[0] if scale else 1.0)
            measured = Measured(choices_by_path, compiled.peak, seconds)
            if not same:
                self.programs[program] = (measured.label, compiled)
            self.cache[key] = self.shared[(self.scope, *key)] = (measured, compiled)
            if compiled.modelled_seconds is not None:
                self._rescale_untimed()
            if self.progress:
                # What varies in length goes last, so that every row keeps the columns.
                how = "same program as " + same[0] if same else "compiled"
                if predicted:
                    how += f" (predicted {predicted[0] / 2**20:,.0f} MiB, {predicted[1] * 1e3:.2f} ms)"
                if compiled.modelled_seconds is None:
                    how += (f" (time: the roofline's x {scale[0]:.3f}, XLA's model over the roofline on {scale[1]}; XLA's cannot time this one)"
                            if scale else " (time: the roofline's; XLA's model timed no step like it yet)")  # fmt: skip
                approximate = "; approximate: " + "; ".join(measured.approximations.values()) if measured.approximations else ""
                print(f"[plan] {len(self.cache):>3} {measured.label:<44} {compiled.peak / 2**20:>10,.0f} MiB "
                      f"{seconds * 1e3:>9.2f} ms  {how}{approximate}", file=sys.stderr, flush=True)  # fmt: skip
        return self.cache[key][0]

    def adopt_shared(self) -> None:
        """Take in what earlier calls sharing the cache compiled for this step."""
        for (scope, *key), entry in self.shared.items():
            if scope == self.scope:
                self.cache.setdefault(tuple(key), entry)

    def compiled(self, measured: Measured) -> CompiledStep:
        """The compiled step of a candidate measured before."""
        return next(step for m, step in self.cache.values() if m.choices == measured.choices)

    def current(self, measured: Measured) -> Measured:
        """``measured`` as the cache holds it now (its time rescaled where XLA's model timed a later step)."""
        return next(m for m, _ in self.cache.values() if m.choices == measured.choices)

    def _time_scale(self, key: tuple) -> tuple[float, str] | None:
        """For a step XLA's model cannot time (XLA:TPU, some programs): XLA's modelled time over the
        roofline's on the timed step most like it, and that step's name; None before any is timed.
        Most like it: the same choices at the nearest micro-batch count, else any step at the
        nearest count, first compiled first. The ratio grows with the count (a loop's overhead,
        which the two models weigh differently: the 12 x 768 LM's dense step on TPU v5p, 1.24 at
        one micro-batch, 1.31 at 2, 1.36 at 4), so a step's own count's, or the nearest one's, is used."""
        timed = [(scope[COUNT], tuple(rest), m, step) for (scope, *rest), (m, step) in self.shared.items()
                 if scope == self.at_count(scope[COUNT]) and step is not None and step.modelled_seconds is not None and step.roofline_seconds]  # fmt: skip
        if not timed:
            return None
        k, _, m, step = min(timed, key=lambda t: (t[1] != key, abs(math.log2(t[0] / self.microbatches))))
        return step.modelled_seconds / step.roofline_seconds, m.label + (f" at {k} micro-batches" if k > 1 else "")

    def _rescale_untimed(self) -> None:
        """Untimed steps measured before a step like them was timed: their time again, from the
        timed step now most like each, so that one search compares one instrument."""
        for key, (m, step) in self.cache.items():
            if step is not None and step.modelled_seconds is None and (scale := self._time_scale(key)):
                self.cache[key] = self.shared[(self.scope, *key)] = (dataclasses.replace(m, seconds=step.roofline_seconds * scale[0]), step)

    def smallest(self, allowed: Callable[[tuple], bool] = lambda key: True) -> Measured:
        """The candidate of least peak among those ``allowed``, compiled ones first."""
        return min((m for key, (m, _) in self.cache.items() if allowed(key)), key=lambda m: (not m.compiled, m.peak))


# XLA:TPU's words where a program needs more than the device's memory: "the total memory required
# for HLO temporaries (117.00G) exceeds available HBM (95.74G)"; "Used 120.50G of 95.74G hbm".
_OVER_MEMORY = re.compile(r"RESOURCE_EXHAUSTED.*?(?:required for [\w ]+\(|Used )([\d.]+)([KMGT])", re.DOTALL)


def over_device_memory(error: Exception) -> int | None:
    """The bytes XLA said a program needs where it refused to compile it for exceeding the
    device's memory (a lower bound on its peak: temporaries alone); None for any other error."""
    found = _OVER_MEMORY.search(str(error))
    if not found:
        return None
    return int(float(found.group(1)) * 2 ** (10 * "KMGT".index(found.group(2)) + 10))
