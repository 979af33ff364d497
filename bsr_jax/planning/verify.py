"""``plan``'s candidates from the cost model: ``compile_predicted`` compiles what
``bsr_jax.planning.cost.CostModel`` predicts fastest within the budget, recalibrating it with each
compiled step, and stops where another compile cannot win."""

from __future__ import annotations

import math
from collections.abc import Sequence

from bsr_jax.planning.candidates import Candidates
from bsr_jax.planning.cost import MEASURED_EVERYWHERE, WORTH, CostModel
from bsr_jax.planning.result import Measured


def compile_predicted(search: Candidates, model: CostModel, names: Sequence[str], variants: Sequence[tuple[str, str]], limit: float,
                      verify: int, beat: float = math.inf) -> None:  # fmt: skip
    """Compiles what ``model`` predicts fastest within ``limit`` from all ``names``, recalibrating it
    with each, until ``verify`` fit, ``2 * verify`` were compiled, or its fastest is one compiled
    already (one over ``limit`` asks it for that much less, and for its fastest within ``limit`` but
    for those). Its fastest from keep and remat alone
    (the options measured on every block) is compiled before those where blocks differ
    (``CostModel.alike``), after them where they are alike and it is predicted the faster. Nothing
    predicted slower than a compiled candidate within budget, or than ``beat`` (seconds: a plan
    found at another micro-batch count), by more than ``WORTH`` is compiled."""
    fits, tried, asked = 0, 0, limit

    def calibrated(key: tuple) -> Measured:
        # Each compiled step calibrates the model: its last block's option's base (peaks are not
        # additive: XLA reschedules, and the backward's first block holds what it recomputes).
        # One XLA refused (more than the device holds) teaches nothing; solved again, it is cached: the loop ends.
        measured = search.measure(*key, predicted=model.predict(key))
        if measured.compiled:
            model.observe(key, measured.peak, measured.seconds)
        return measured

    def worth(key: tuple) -> bool:
        fastest = min((m.seconds for m, _ in search.cache.values() if m.compiled and m.peak <= limit), default=math.inf)
        return model.predict(key)[1] < min(fastest, beat) * WORTH

    # Keep and remat are measured on every block (the dense step, remat on every block); the other
    # options on the blocks the probes gave them, the rest extrapolated. Where blocks differ (ResNet-50's
    # stages) that extrapolation misled the solver: on TPU v5p at 0.7 it found 1.16x where keep and
    # remat alone give 1.09x; at 0.5 on H100, three candidates from all options compiled over the
    # budget (bytes extrapolated 330 MiB short) before keep and remat alone fit. There the best of
    # those two is compiled first; where blocks are alike, last and only where it may be the faster
    # (on the 12 x 768 LM at 0.3, predicted 75.04 ms against 68.44 compiled: 12 s of compiling saved).
    measured_everywhere = [o for o in MEASURED_EVERYWHERE if o in names]
    safe = verify and measured_everywhere and len(measured_everywhere) < len(names)
    alike = model.alike()

    def safest() -> bool:
        key = model.solve(limit, measured_everywhere, variants)
        if key is None or key in search.cache or not worth(key):
            return False
        calibrated(key)
        return True

    over: set[tuple] = set()  # compiled over the budget

    def fastest() -> tuple | None:
        keys = [model.solve(asked, names, variants)]
        if over:
            # Asking for less bars what fits below the budget's own limit too (the 12 x 768 LM at 0.2:
            # 1 lean + 11 remat, predicted 5,338 MiB, compiled 5,376 in 5,369; asked 5,335, the solver
            # lost 1 remat-dots + 11 remat, predicted 5,348, which had compiled within it): the
            # budget's best without those is a candidate too, the faster predicted is compiled.
            keys.append(model.solve(limit, names, variants, exclude=over))
        return min((k for k in keys if k is not None), key=lambda k: model.predict(k)[1], default=None)

    def solved() -> None:
        nonlocal fits, tried, asked
        while fits < verify and tried < 2 * verify:
            key = fastest()
            compiled = search.cache[key][0] if key in search.cache else None
            if compiled is not None and compiled.compiled and compiled.peak > limit:
                # Predicted to fit, compiled over the budget by less than the model tells apart (ViT-B/16
                # at 0.5: 5,558 MiB in 5,556, predicted 5,513): ask it for that much less.
                over.add(key)
                asked -= compiled.peak - limit + 0.005 * limit
                continue
            if key is None or key in search.cache or not worth(key):
                break  # nothing predicted fits, the model's fastest was compiled already, or it cannot win
            compiled_before = len(search.programs)
            measured = calibrated(key)
            tried += len(search.programs) > compiled_before
            fits += measured.compiled and measured.peak <= limit

    if safe and not alike:
        safest()
    solved()
    if safe and alike and safest():
        # Compiled, it recalibrated the model, whose fastest may have moved (ViT-B/16 at 0.3: from
        # 39.54 ms compiled to 9xremat + 2xlean + 1xkeep, 39.49).
        solved()
