"""The planner's cost model: what each block keeps at the peak and costs in time under each option,
read off a few compiled steps, and the assignment of options to blocks it predicts fastest.

A compiled step's breakdown (``compiled_memory(..., breakdown=True)``) names every buffer live at
the peak and every kernel of the roofline by the op that made it, and an op's name carries its
module path (``.../encoderdecoderblock_3/MultiHeadDotProductAttention_0/...``). So one compiled
step in which the blocks take *different* options (a "probe") says, per block, what that option
keeps at the peak and what its kernels cost: ``shares``. The dense step gives every block's
``keep``, remat on every block its ``remat``, and ``probes`` assigns the other options over the
blocks in turn (12 blocks and 4 other options: one probe), with the rest's and the loss's other
choices one per probe. Measured on the 12 x 768 LM (H100): the per-block figures a probe gives are
those of the step with that option on every block (time identical to the microsecond, bytes to
2-4% of the uniform step's peak).

``CostModel.predict`` composes a step from them: the dense step's peak and time, plus, per block,
what its option keeps and costs beyond ``keep`` (and the same for the rest and the loss).
``CostModel.solve`` finds the assignment with the least predicted time whose predicted peak fits:
a multiple-choice knapsack, solved exactly by dynamic programming over the blocks with each
block's bytes rounded up to 1/``resolution`` of the free budget. Peaks are not additive (XLA
reschedules; remat's recomputation is transient), so ``plan`` compiles what this predicts and
corrects the budget by the error it sees (``bsr_jax.planning.search``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

from bsr_jax.measure.compiled import CompiledStep
from bsr_jax.planning.options import REST

Key = tuple[tuple[str, ...], str, str]  # (an option per block, the rest's option, the loss: "plain" or "chunked")


@dataclasses.dataclass(frozen=True)
class Share:
    """What one part of a compiled step holds at its peak (``kept``, bytes) and costs: its kernels'
    modelled seconds (``device``) and its host copies' (``host``)."""

    kept: int = 0
    device: float = 0.0
    host: float = 0.0


def shares(step: CompiledStep, blocks: Sequence[str]) -> dict[str, Share]:
    """Each block's ``Share`` of a step compiled with ``breakdown=True``, and ``REST``'s (all the
    rest: embeddings, head, loss, optimizer update, parameters and optimizer state). Kernel times
    are scaled to add up to ``step.modelled_seconds`` (on TPU, XLA's model rather than the
    roofline's). A ``ValueError`` where some block owns no kernel: its ops' names do not carry
    its path (``flax.nnx`` modules push no name scope), so nothing can be told per block."""
    pattern = re.compile(r"(?:^|/)(" + "|".join(re.escape(b) for b in sorted(blocks, key=len, reverse=True)) + r")(?:/|$)")

    def owner(op: str) -> str:
        found = pattern.search(op)
        return found.group(1) if found else REST

    kept, device, host = {}, {}, {}
    for buffer in step.live_at_peak:
        kept[owner(buffer.op)] = kept.get(owner(buffer.op), 0) + buffer.bytes
    for kernel in step.kernels:
        device[owner(kernel.op)] = device.get(owner(kernel.op), 0.0) + kernel.seconds
    for copy in step.transfers:
        host[owner(copy.op)] = host.get(owner(copy.op), 0.0) + copy.seconds
    missing = [b for b in blocks if not device.get(b)]
    if missing:
        raise ValueError(f"no kernel of the compiled step names block(s) {missing[:3]} in its op names")
    scale = step.modelled_seconds / step.roofline_seconds if step.roofline_seconds else 1.0
    return {part: Share(kept.get(part, 0), device.get(part, 0.0) * scale, host.get(part, 0.0) * scale) for part in (*blocks, REST)}


def probes(blocks: Sequence[str], options: Sequence[str], variants: Sequence[tuple[str, str]], known: Sequence[str] = ("keep", "remat")) -> list[Key]:
    """Steps that, with the dense one and remat on every block, measure every option on some
    block and every (rest, loss) variant once: the options not ``known`` assigned to the blocks in
    turn, round after round, each round with the next variant (then the rest kept)."""
    todo = [o for o in options if o not in known]
    rounds = max(math.ceil(len(todo) / len(blocks)), len(variants))
    found = []
    for r in range(rounds):
        choices = tuple(todo[(r * len(blocks) + i) % len(todo)] for i in range(len(blocks))) if todo else ("remat",) * len(blocks)
        rest, loss = variants[r] if r < len(variants) else ("keep", "plain")
        found.append((choices, rest, loss))
    return found


class CostModel:
    """Per (block, option) and per (rest, loss) variant, the ``Share`` measured in compiled steps
    (averaged where several measured it), composed into a step's predicted peak and time against
    the dense step's. A block never measured with an option takes it from the block measured with
    it whose ``keep`` keeps the most alike, scaled by their ratio under ``keep``."""

    def __init__(self, blocks: Sequence[str], dense: CompiledStep, dense_shares: Mapping[str, Share]):
        self.blocks = tuple(blocks)
        self.peak, self.seconds = dense.peak, dense.modelled_seconds
        self.seen: dict[tuple[str, str], list[Share]] = {}
        self.add((("keep",) * len(blocks), "keep", "plain"), dense_shares)

    def add(self, key: Key, measured: Mapping[str, Share]) -> None:
        choices, rest, loss = key
        for block, option in zip(self.blocks, choices):
            self.seen.setdefault((block, option), []).append(measured[block])
        self.seen.setdefault((REST, f"{rest}/{loss}"), []).append(measured[REST])

    def share(self, part: str, option: str) -> Share:
        found = self.seen.get((part, option))
        if found:
            return Share(*(float(np.mean([getattr(s, f.name) for s in found])) for f in dataclasses.fields(Share)))
        measured = [b for b in self.blocks if (b, option) in self.seen]
        if part == REST or not measured:
            raise KeyError(f"no compiled step measured {option!r} for {part}")
        mine = self.share(part, "keep").kept
        like = min(measured, key=lambda b: abs(math.log((self.share(b, "keep").kept + 1) / (mine + 1))))
        other, ratio = self.share(like, option), (mine + 1) / (self.share(like, "keep").kept + 1)
        return Share(other.kept * ratio, other.device * ratio, other.host * ratio)

    def knows(self, key: Key) -> bool:
        """Whether ``predict`` can compose ``key``: each option measured on some block, the variant measured."""
        choices, rest, loss = key
        measured = {option for _, option in self.seen}
        return set(choices) <= measured and (REST, f"{rest}/{loss}") in self.seen

    def _extra(self, part: str, option: str, keep: str = "keep") -> Share:
        """What ``option`` keeps and costs beyond ``keep`` (the dense step's choice) on ``part``."""
        a, b = self.share(part, option), self.share(part, keep)
        return Share(a.kept - b.kept, a.device - b.device, a.host - b.host)

    def predict(self, key: Key) -> tuple[float, float]:
        """(peak bytes, seconds) of the step ``key`` as the shares compose it. The kernels' time and
        the host copies' are added (pessimistic where the copies overlap the kernels)."""
        choices, rest, loss = key
        extras = [self._extra(b, c) for b, c in zip(self.blocks, choices)] + [self._extra(REST, f"{rest}/{loss}", "keep/plain")]
        return self.peak + sum(e.kept for e in extras), self.seconds + sum(e.device + e.host for e in extras)

    def solve(self, limit: float, options: Sequence[str], variants: Sequence[tuple[str, str]], resolution: int = 1024) -> Key | None:
        """The assignment of ``options`` to the blocks, with one of ``variants`` (rest, loss), of
        least predicted time whose predicted peak is at most ``limit``; None where none is."""
        best: tuple[float, Key] | None = None
        for rest, loss in variants:
            base = self.predict((("keep",) * len(self.blocks), rest, loss))[0]
            table = [[self._extra(b, o) for o in options] for b in self.blocks]
            found = knapsack([[e.kept for e in row] for row in table], [[e.device + e.host for e in row] for row in table],
                             limit - base, resolution)  # fmt: skip
            if found is not None:
                key = (tuple(options[i] for i in found), rest, loss)
                seconds = self.predict(key)[1]
                if best is None or seconds < best[0]:
                    best = (seconds, key)
        return best and best[1]


def knapsack(weights: Sequence[Sequence[float]], costs: Sequence[Sequence[float]], capacity: float, resolution: int = 1024) -> list[int] | None:
    """One choice per row minimising the summed cost with the summed weight at most ``capacity``:
    the index chosen per row, or None where no choice fits. Weights may be negative (bytes saved
    against a reference); they are shifted by each row's least weight and rounded up to units of
    1/``resolution`` of what is left of ``capacity``, so a solution fits exactly and is the
    optimum up to that rounding (integer weights with ``resolution`` = the integer capacity left:
    exact)."""
    floor = [min(row) for row in weights]
    room = capacity - sum(floor)
    if room < 0:
        return None
    unit = max(room / resolution, 1e-12)
    slots = int(room / unit + 1e-9)
    best = np.full(slots + 1, np.inf)
    best[0] = 0.0
    picks = []
    for row_w, row_c, low in zip(weights, costs, floor):
        new, pick = np.full(slots + 1, np.inf), np.zeros(slots + 1, np.int32)
        for i, (w, c) in enumerate(zip(row_w, row_c)):
            units = math.ceil((w - low) / unit - 1e-9)
            if units > slots:
                continue
            candidate = np.full(slots + 1, np.inf)
            candidate[units:] = best[: slots + 1 - units] + c
            better = candidate < new
            new[better], pick[better] = candidate[better], i
        best = new
        picks.append(pick)
    end = int(np.argmin(best))
    if not np.isfinite(best[end]):
        return None
    chosen = []
    for row_w, low, pick in zip(reversed(weights), reversed(floor), reversed(picks)):
        i = int(pick[end])
        chosen.append(i)
        end -= math.ceil((row_w[i] - low) / unit - 1e-9)
    return chosen[::-1]

