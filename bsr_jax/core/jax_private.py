"""jax's private modules, in this one place because no public API reaches what they hold (tested
with the jax range pyproject pins; a jax that moves them fails here, at import, naming this module).

- ``tensor_contractions``: its ``matmul`` is what ``a @ b`` on jax arrays calls; ``rewrite.intercept``
  replaces it while a compressed model is traced, to route products written with ``@``.
- ``lax_numpy``: its ``astype`` is what ``x.astype(...)`` calls; ``ops.head_loss`` replaces it to
  follow an LM head's logits through a widening cast.
- ``config``, ``xla_bridge``: whether jax's backends have started, so that ``_environment`` can set
  ``jax_platforms`` for a jax imported before bsr_jax (``jax.config`` cannot tell).
- ``ensure_enum``, ``RecomputeType``: what a ``jax.checkpoint`` policy's answer means (a bool, or
  jax's save / recompute / offload markers), for ``rewrite.lean_graph``'s composed policies.
"""

from jax._src import config, xla_bridge  # noqa: F401
from jax._src.interpreters.partial_eval import RecomputeType, ensure_enum  # noqa: F401
from jax._src.numpy import lax_numpy, tensor_contractions  # noqa: F401
