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

``CostModel.predict`` composes a step from them (its docstring says how the peak's two terms and
the time are put together) and is calibrated by every step compiled. ``CostModel.solve`` finds the
assignment with the least predicted time whose predicted peak fits: a multiple-choice knapsack,
solved exactly by dynamic programming over the blocks with each block's bytes rounded up to
1/``resolution`` of the free budget. Peaks are not additive (XLA reschedules; remat's
recomputation is transient), so ``plan`` compiles what this predicts, recalibrates and solves
again (``bsr_jax.planning.search``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from bsr_jax.measure.compiled import CompiledStep
from bsr_jax.planning.options import OPTIONS, REST

Key = tuple[tuple[str, ...], str, str]  # (an option per block, the rest's option, the loss: "plain" or "chunked")


@dataclasses.dataclass(frozen=True)
class Share:
    """What one part of a compiled step holds at its peak (``kept``, bytes) and costs: its kernels'
    modelled seconds (``device``) and its host copies' (``host``)."""

    kept: int = 0
    device: float = 0.0
    host: float = 0.0


def shares(step: CompiledStep, blocks: Sequence[str], seconds: float | None = None) -> dict[str, Share]:
    """Each block's ``Share`` of a step compiled with ``breakdown=True``, and ``REST``'s (all the
    rest: embeddings, head, loss, optimizer update, parameters and optimizer state). Kernel times
    are scaled to add up to ``seconds`` (default ``step.modelled_seconds``: on TPU, XLA's model
    rather than the roofline's). A ``ValueError`` where some block owns no kernel: its ops' names do not carry
    its path (linen modules push their names; ``bsr_jax.planning.nnx`` runs NNX blocks in a
    ``jax.named_scope`` of theirs), so nothing can be told per block."""
    # A path stands between slashes, or inside a transform's parentheses (``transpose(jvp(blocks/3))``).
    pattern = re.compile(r"(?:^|[/(])(" + "|".join(re.escape(b) for b in sorted(blocks, key=len, reverse=True)) + r")(?:[/)]|$)")

    def owner(op: str) -> str:
        found = pattern.search(op)
        return found.group(1) if found else REST

    def by_owner(items, amount) -> dict[str, float]:
        totals: dict[str, float] = {}
        for item in items:
            part = owner(item.op)
            totals[part] = totals.get(part, 0) + amount(item)
        return totals

    kept = by_owner(step.live_at_peak, lambda buffer: buffer.bytes)
    device = by_owner(step.kernels, lambda kernel: kernel.seconds)
    host = by_owner(step.transfers, lambda copy: copy.seconds)
    missing = [b for b in blocks if not device.get(b)]
    if missing:
        raise ValueError(f"plan: no kernel of the compiled step names block(s) {missing[:3]} in its op names: the cost model tells "
                         "blocks apart by the module path in them")  # fmt: skip
    seconds = step.modelled_seconds if seconds is None else seconds
    scale = seconds / step.roofline_seconds if step.roofline_seconds else 1.0
    return {part: Share(kept.get(part, 0), device.get(part, 0.0) * scale, host.get(part, 0.0) * scale) for part in (*blocks, REST)}


def learnt_blocks(n: int) -> int:
    """How many of ``n`` blocks, the first, ``CostModel`` learns bytes from: all but the last three
    (XLA names the last blocks' buffers at the peak unreliably: on the 12 x 768 LM's probe, the
    third-to-last held lean at 385.5 MiB where the blocks before it hold 288.0); of fewer than six,
    all but the last two, at least one."""
    return max(n - 3, min(n - 2, 2), 1)


# How much slower than a compiled candidate within budget the cost model may predict another and
# still have it compiled: its predicted times came within 1% of the compiled ones (docs/RESULTS.md 12).
WORTH = 1.02

# The options the dense step and remat on every block measure on every block: the rest are measured
# by probes on some blocks and extrapolated.
MEASURED_EVERYWHERE = ("keep", "remat")


def _kind(option: str) -> str:
    """What a block does under ``option``: "remat" (recomputes itself under a policy), "lean"
    (lean neighbours: recomputes attention and activations, with or without compressed inputs)
    or "keep"; a name not in ``OPTIONS`` is a kind of its own."""
    o = OPTIONS.get(option)
    return option if o is None else "remat" if o.remat else "lean" if o.lean else "keep"


def _variant(rest: str, loss: str) -> frozenset[str]:
    """The rest's and the loss's choices beyond the kept rest and the plain loss, as ``rest:...``
    and ``loss:...``."""
    return frozenset(({f"rest:{rest}"} if rest != "keep" else set()) | ({f"loss:{loss}"} if loss != "plain" else set()))


def others(key: Key) -> frozenset[str]:
    """What ``key`` chooses beyond ``MEASURED_EVERYWHERE``, the kept rest and the plain loss: its
    options measured on some blocks only, and its rest's and loss's choices (``_variant``)."""
    choices, rest, loss = key
    return frozenset(c for c in choices if c not in MEASURED_EVERYWHERE) | _variant(rest, loss)


def probes(blocks: Sequence[str], options: Sequence[str], variants: Sequence[tuple[str, str]]) -> list[Key]:
    """Steps that, with the dense one and remat on every block, measure every option on some
    block and every (rest, loss) variant once: the options not ``MEASURED_EVERYWHERE`` assigned to
    the blocks in turn, round after round, each round with the next variant (then the rest kept).

    Each kind of option (``_kind``: remat under a policy; lean and compression) takes rounds of its own: a block
    recomputing under ``dots_with_no_batch_dims_saveable`` beside lean ones moved the step's peak
    into the backward pass, where the others held what they hold nowhere else (the 12 x 768 LM,
    H100: an ``int4`` block 318 MiB, as against 169 in every step without such blocks, more than
    ``lean``'s 288; so the cost model never chose it; docs/RESULTS.md 12.9)."""
    todo = [o for o in options if o not in MEASURED_EVERYWHERE]
    # Each option on a block CostModel learns bytes from, in turn.
    learnt = learnt_blocks(len(blocks))
    groups: dict[str, list[str]] = {}
    for o in todo:
        groups.setdefault(_kind(o), []).append(o)
    rounds = [[g[(r * learnt + i) % len(g)] for i in range(len(blocks))] for g in groups.values() for r in range(math.ceil(len(g) / learnt))]
    found = []
    for r in range(max(len(rounds), len(variants))):
        choices = tuple(rounds[r % len(rounds)]) if rounds else ("remat",) * len(blocks)
        rest, loss = variants[r] if r < len(variants) else ("keep", "plain")
        found.append((choices, rest, loss))
    return found


class CostModel:
    """A step's peak and time composed from what its blocks keep and cost under their options.

    The peak is ``max(kept + a(last), kept + kept(last) + h)``, ``kept`` the bytes the blocks
    before the last keep (and the rest's choice adds). First term: while they hold their
    residuals, the backward pass starts at the last block, whose own bytes and transient (what
    remat recomputes, what host offload brings back) land there with the head's (``a``, per
    option of the last block). Second: a peak elsewhere, where every block's residuals are live
    with the head's backward (its logits' gradient: ``h``), which XLA schedules apart from the
    blocks' in some steps and not in others (the 12 x 768 LM: dense peaks in the first regime,
    every block compressed in the second). XLA names the last blocks' buffers unreliably at the
    peak (recomputed ones can carry the previous block's name), so ``kept`` is learnt from the
    blocks before the last two or three (``learnt_blocks``) of each step measured with a breakdown; ``a`` from every compiled
    step that had that option on the last block (its least ``peak - kept``: dense gives
    ``keep``'s, remat on every block ``remat``'s), and an option never compiled there takes
    the median of those of its kind compiled there where it is lean or compression, else
    ``keep``'s (``_base``); ``h`` from the compiled steps the first term does not
    explain (``peak`` less everything the blocks keep; none: no second term), held against the
    steps that share their choices beyond the options measured on every block (``_h``).

    The time is ``base + max(kernels, host copies)``, each the seconds of every block's option
    and the rest's summed (the roofline's step is the larger: host copies overlap the kernels),
    ``base`` averaged over the compiled steps. A block never measured with an option takes it
    from the blocks measured with it whose ``keep`` keeps the most alike (the median of theirs),
    each mapped by the line through the two blocks' ``keep`` and ``remat`` figures (``_value``)."""

    def __init__(self, blocks: Sequence[str]):
        self.blocks = tuple(blocks)
        self.kept: dict[tuple[str, str], list[float]] = {}
        self.device: dict[tuple[str, str], list[float]] = {}  # the kernels' seconds
        self.host: dict[tuple[str, str], list[float]] = {}  # the host copies' seconds
        self.rest: dict[str, list[Share]] = {}  # "rest/loss" -> REST's shares
        self.steps: dict[Key, tuple[int, float]] = {}  # compiled: key -> (peak, seconds)

    def observe(self, key: Key, peak: int, seconds: float, measured: Mapping[str, Share] | None = None) -> None:
        """A compiled step: its peak and time, and with ``measured`` (``shares``) what each part had."""
        self.steps[key] = (peak, seconds)
        if measured is None:
            return
        choices, rest, loss = key
        learnt = self.blocks[: learnt_blocks(len(self.blocks))]
        # A block keeping its activations holding nothing at the peak: the backward had freed it and the blocks before hold
        # transients: no bytes from this step (ResNet-50's lean probe, H100); the dense and remat steps' are always needed.
        passed = bool(set(choices) - set(MEASURED_EVERYWHERE)) and any(
            measured[b].kept <= 0 and _kind(o) in ("keep", "lean") for b, o in zip(learnt, choices))
        for block, option in zip(self.blocks, choices):
            if block in learnt and not passed:
                self.kept.setdefault((block, option), []).append(measured[block].kept)
            self.device.setdefault((block, option), []).append(measured[block].device)
            self.host.setdefault((block, option), []).append(measured[block].host)
        self.rest.setdefault(f"{rest}/{loss}", []).append(measured[REST])

    def _value(self, table: dict[tuple[str, str], list[float]], block: str, option: str) -> float:
        found = table.get((block, option))
        if found:
            return float(np.mean(found))
        measured = [b for b in self.blocks if (b, option) in table and (b, "keep") in table]
        if not measured:
            raise KeyError(f"no compiled step measured {option!r} on a block")
        if (block, "keep") not in table:  # a block not learnt from (one of the last): as the nearest before it
            return float(np.mean(table[(measured[-1], option)]))
        keep = {b: float(np.mean(table[(b, "keep")])) for b in [*measured, block]}
        # The blocks nearest by their keep figure (bytes or seconds: scale-free), within 5% of the
        # nearest: alike blocks (a stack's), each block's figure carried over, the median taken, so
        # that one whose figure XLA inflated (the 12 x 768 LM's last learnt block: lean 385.5 MiB,
        # the one before it 288.0, carried to eight blocks: 780 MiB over) does not decide alone.
        tiny = 1e-9 * max(keep.values(), default=0.0) or 1e-30
        distance = {b: abs(math.log((keep[b] + tiny) / (keep[block] + tiny))) for b in measured}
        nearest = min(distance.values())
        return float(np.median([self._carried(table, b, block, option, keep, tiny) for b in measured if distance[b] <= nearest + 0.05]))

    def _carried(self, table: dict[tuple[str, str], list[float]], like: str, block: str, option: str,
                 keep: Mapping[str, float], tiny: float) -> float:  # fmt: skip
        """``option``'s figure on ``like`` carried over to ``block``."""
        theirs = float(np.mean(table[(like, option)]))
        remat = {b: float(np.mean(table[(b, "remat")])) for b in (like, block) if (b, "remat") in table}
        if len(remat) == 2 and abs(keep[like] - remat[like]) > tiny:
            # The line through both blocks' keep and remat figures: their ratio where blocks differ in
            # size (ResNet's stages), and what one block holds under every option but keep beside
            # (the LM's first block: 128 MiB more under remat, lean, int8, ..., 24 more under keep).
            return remat[block] + (theirs - remat[like]) * (keep[block] - remat[block]) / (keep[like] - remat[like])
        return theirs * (keep[block] + tiny) / (keep[like] + tiny)  # their ratio

    def alike(self, within: float = 0.05) -> bool:
        """Whether the blocks learnt from, but the first, keep bytes and spend kernel seconds within
        ``within`` of each other under ``keep``: an option a probe measured on one then holds for
        all of them (the 12 x 768 LM, ViT-B/16, ResMLP-S12; not ResNet-50's stages). The first
        holds what the model's input side adds (ViT-B/16's: 6% more kernel time, ResMLP-S12's: 8%
        fewer bytes), which ``_carried`` maps along the ``keep``/``remat`` line."""
        learnt = self.blocks[: learnt_blocks(len(self.blocks))]
        learnt = learnt[1:] or learnt
        for table in (self.kept, self.device):
            figures = [float(np.mean(table[(b, "keep")])) for b in learnt if (b, "keep") in table]
            if not figures or min(figures) <= 0 or max(figures) > (1 + within) * min(figures):
                return False
        return True

    def _rest(self, rest: str, loss: str) -> tuple[float, float, float]:
        """What the rest's and the loss's choice keeps, and its kernels' and host copies' seconds,
        beyond keep and the plain loss."""
        a, b = self.rest[f"{rest}/{loss}"], self.rest["keep/plain"]
        return tuple(float(np.mean([getattr(s, f) for s in a]) - np.mean([getattr(s, f) for s in b])) for f in ("kept", "device", "host"))

    def _sums(self, key: Key) -> tuple[float, float, float]:
        """(kept by the blocks before the last, kernel seconds and host seconds of every block),
        the rest's choice's included."""
        choices, rest, loss = key
        extra = self._rest(rest, loss)
        kept = sum(self._value(self.kept, b, c) for b, c in zip(self.blocks[:-1], choices[:-1]))
        device = sum(self._value(self.device, b, c) for b, c in zip(self.blocks, choices))
        host = sum(self._value(self.host, b, c) for b, c in zip(self.blocks, choices))
        return kept + extra[0], device + extra[1], host + extra[2]

    def _bases(self) -> tuple[dict[str, float], list[tuple[frozenset[str], float]], float]:
        """From the compiled steps: per option of the last block, ``a`` of the peak's first term (not from a step mixing
        remat policies, or one with other options: its peak may lie in the backward pass); per step its second explains,
        ``h`` and what that step chose beyond the options measured everywhere (``others``; see ``_h``); the time's base."""
        seen = []
        times = []
        for key, (peak, seconds) in self.steps.items():
            try:
                kept, device, host = self._sums(key)
                seen.append((key, kept, kept + self._value(self.kept, self.blocks[-1], key[0][-1]), peak))
            except KeyError:  # a step with an option measured nowhere else (only where nothing is learnt)
                continue
            times.append(seconds - max(device, host))
        bases: dict[str, float] = {}
        for key, before, _, peak in seen:
            # Blocks recomputing under a policy beside others move a step's peak into the backward
            # pass (the remat-policy probe's), where peak - before is no base of the last block's
            # option; a policy alone (with plain remat) still gives its own.
            policies = {c for c in key[0] if _kind(c) == "remat" and c != "remat"}
            if len(policies) < 2 and not (policies and set(key[0]) - policies - {"remat"}):
                bases[key[0][-1]] = min(bases.get(key[0][-1], math.inf), peak - before)
        above = [(others(key), peak - every) for key, before, every, peak in seen if peak > before + self._base(bases, key[0][-1]) + 0.01 * peak]
        return bases, above, float(np.mean(times)) if times else 0.0

    @staticmethod
    def _h(above: Sequence[tuple[frozenset[str], float]], chosen: frozenset[str]) -> float:
        """The second term's ``h`` for a step that chooses ``chosen`` beyond the options measured
        everywhere (``others``): the largest of the compiled steps that chose nothing beyond them
        (the head's backward with every residual live, a term of the step) or something it
        chooses too (a term of those choices: on the 12 x 768 LM at 0.2, three ``int4-fused``
        blocks among remat ones compiled 527 MiB over their prediction, which, held against every
        step, barred one ``remat-dots`` block the budget had room for); ``-inf`` where none."""
        return max((h for theirs, h in above if not theirs or theirs & chosen), default=-math.inf)

    def _base(self, bases: Mapping[str, float], option: str) -> float:
        """``bases[option]``; for lean or compression no compiled step had on the last block, the
        median of those of that kind one had; else ``keep``'s: the last block's backward starts
        with the head's and recomputes (lean neighbours, remat) as it goes. Measured on the 12 x
        768 LM (H100): ``int4-fused`` last needed 4,962 MiB beyond the blocks before it in the
        compression probe, ``keep`` 6,590; with the former, lean on every block is predicted
        8,219 MiB (compiled: 8,193), with the latter 9,847, which kept every candidate ending in
        lean or compression out of a budget of 0.3 (docs/RESULTS.md 12.10). ``keep``'s less what an
        option keeps less is no base: for ``int4-fused`` (1,712 MiB less per block at the dense
        step's peak) it predicted 4,879 where it needed 6,403-6,445 after remat blocks. A remat
        policy takes no other option's base, and ``_bases`` learns none from steps mixing
        policies or a policy with other options: ``remat-offload``'s from the remat-policy probe,
        which peaks in the backward pass, let candidates ending in it beside lean blocks compile
        4-6 GiB over their prediction (docs/RESULTS.md 12.9)."""
        if option in bases:
            return bases[option]
        alike = [b for o, b in bases.items() if _kind(o) == "lean"] if _kind(option) == "lean" else []
        return float(np.median(alike)) if alike else bases["keep"]

    def predict(self, key: Key, bases: tuple[dict[str, float], list[tuple[frozenset[str], float]], float] | None = None) -> tuple[float, float]:
        """(peak bytes, seconds) of the step ``key`` as the model composes it (``bases``: ``_bases()``,
        where the caller has them)."""
        bases, above, time = bases or self._bases()
        kept, device, host = self._sums(key)
        last = key[0][-1]
        h = self._h(above, others(key))
        # The host copies overlap the kernels (the roofline's step is the larger of the two).
        return max(kept + self._base(bases, last), kept + self._value(self.kept, self.blocks[-1], last) + h), time + max(device, host)

    def solve(self, limit: float, options: Sequence[str], variants: Sequence[tuple[str, str]], resolution: int = 1024,
              exclude: Collection[Key] = ()) -> Key | None:  # fmt: skip
        """The assignment of ``options`` to the blocks, with one of ``variants`` (rest, loss), of
        least predicted time whose predicted peak is at most ``limit``; None where none is. A key in
        ``exclude`` is not returned: its (rest, loss, last block's option) gives no candidate; nor
        is an option whose bytes no step measured (``observe``)."""
        fitted = self._bases()
        bases, above, _ = fitted
        head = self.blocks[:-1]
        measured = {option for _, option in self.kept}
        options = [o for o in options if o in measured]
        weights = {o: [self._value(self.kept, b, o) for b in head] for o in options}
        # Ranked by kernels and host copies added (the sum the knapsack can carry; pessimistic for
        # offloading), then the best per last option and variant by the predicted time.
        costs = {o: [self._value(self.device, b, o) + self._value(self.host, b, o) for b in head] for o in options}
        best: tuple[float, Key] | None = None
        # ``h`` depends on the choices (``_h``): solved once per level of it, without the choices of
        # the steps that showed a larger one.
        clean = self._h(above, frozenset())
        for h in sorted({clean} | {v for _, v in above if v > clean}):
            barred = frozenset().union(*(theirs for theirs, v in above if v > h))
            allowed = [o for o in options if o not in barred]
            rows = [[weights[o][i] for o in allowed] for i in range(len(head))], [[costs[o][i] for o in allowed] for i in range(len(head))]
            for (rest, loss), last in itertools.product(variants, allowed):
                if _variant(rest, loss) & barred:
                    continue
                extra = self._rest(rest, loss)
                # Both terms of the peak bound what the blocks before the last may keep.
                room = limit - extra[0] - max(self._base(bases, last), self._value(self.kept, self.blocks[-1], last) + h)
                found = knapsack(*rows, room, resolution) if head else ([] if room >= 0 else None)
                if found is None:
                    continue
                key = (tuple(allowed[i] for i in found) + (last,), rest, loss)
                if key in exclude:
                    continue
                seconds = self.predict(key, fitted)[1]
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

