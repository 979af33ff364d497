"""Module attributes replaced process-wide while any thread is inside a context.

``bsr_jax.rewrite.lean``, ``bsr_jax.rewrite.intercept`` and ``bsr_jax.ops.head_loss`` replace functions their users'
code looks up at call time (``jax.nn.gelu``, ``jax.lax.dot_general``, ``optax``'s losses): the
replacements are installed when the first context opens in any thread and the originals put back
when the last one closes; each replacement itself reads its own thread's state, so other threads
get the original behaviour.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

Replacement = tuple[Any, str, Any]  # (owner, attribute name, value while active)


class ProcessWidePatch:
    """``replacements()`` (called when the first context opens) installed while ``applied()`` is
    open anywhere; reference-counted, so nested and concurrent contexts share one installation."""

    def __init__(self, replacements: Callable[[], Iterable[Replacement]]):
        self._replacements = replacements
        self._lock = threading.Lock()
        self._count = 0
        self._restore: list[Replacement] = []

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with self._lock:
            if self._count == 0:
                for owner, name, value in self._replacements():
                    self._restore.append((owner, name, vars(owner)[name]))
                    setattr(owner, name, value)
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1
                if self._count == 0:
                    while self._restore:
                        owner, name, original = self._restore.pop()
                        setattr(owner, name, original)
