"""The suite's one rule for progress bars (reading and decoding data, downloading, training, evaluating).

A bar is drawn only where stderr is a terminal: tqdm's ``disable=None``, which checks
``isatty()``. Off a terminal (a log file, a pipe, a CI job) no bar writes anything, so logs keep
only the run's lines rather than ``\\r`` updates of some bars and not others. ``hidden`` hides a
bar that is not worth drawing even on a terminal (a small archive, a process other than 0).
"""

from __future__ import annotations

from typing import Any

from tqdm import tqdm


def bar(iterable: Any = None, *, hidden: bool = False, **kwargs: Any) -> tqdm:
    """``tqdm(iterable, **kwargs)`` under the rule above."""
    return tqdm(iterable, disable=True if hidden else None, **kwargs)
