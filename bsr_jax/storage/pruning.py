"""``Pruning``: the one frozen carrier of every option of what a layer keeps for its weight
gradient (sparsity, block, selection, storage dtype, rounding), checked once where it is made."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from bsr_jax.storage.format import (
    CRITERIA,
    ROUNDINGS,
    SELECTIONS,
    BlockSparse,
    BlockSpec,
    Criterion,
    Rounding,
    check_sparsity,
    from_dense,
    normalize_block,
)
from bsr_jax.storage.quantize import STOCHASTIC_ROUNDING_DTYPES, StorageDtype, check_storage_dtype
from bsr_jax.storage.selection import Selection


# The weight-gradient backends' names (bsr_jax.backends.dispatch.BACKENDS is keyed by them), here
# so that a Pruning is checked where it is made, below the backends that implement them.
BACKENDS = ("reference", "xla", "cpu", "pallas", "auto", "fused")


@dataclasses.dataclass(frozen=True)
class Pruning:
    """Options of block-pruned residuals: the one carrier every op, layer and rule passes around.

    Frozen and hashable (a static ``custom_vjp`` argument); validated once, here.

    Attributes:
      sparsity: fraction of ``(bm, bk)`` blocks dropped from the residual, a Python float in
        ``[0, 1)``. ``0.0`` keeps every block: exactly dense without ``storage_dtype``, every block
        in low precision with it (no indices stored).
      block: ``bm`` (rows of the input flattened to ``(M, K)``) by ``bk`` (columns); an int means
        square blocks; stored as a pair. A block larger than the matrix is clamped to it.
        ``"row"``: one block per row (per token), as wide as x: with a ``storage_dtype``, one
        scale per row and the codes in x's layout, the format XLA:GPU's dW GEMM reads as stored
        (``bsr_jax.storage.quantize``).
      criterion: block magnitude used for ranking, ``"l2"`` or ``"l1"``.
      selection: ``"global"`` keeps the largest blocks of the whole matrix; ``"column"`` the same
        number in every block-column.
      storage_dtype: ``None`` (the input's dtype) or one of ``bsr_jax.storage.quantize.STORAGE_DTYPES``
        (``"bfloat16"``, ``"float8_e4m3fn"``, ``"int8"``, ``"int4"``; per-block scales). dW is
        then approximate: at sparsity 0, block 16, round to nearest, the relative Frobenius error
        ``||dW - dW_dense|| / ||dW_dense||`` per layer measured 0.002-0.013 (median 0.006) for int8
        and 0.04-0.23 (median 0.12) for int4 over 115 kernels of five small models (Mixer, ViT,
        lm1b LM, GPT-2, Llama; width 128, batch 8, normal inputs; ``benchmarks/storage_error.py``).
        Down projections (inputs after GELU/SwiGLU) have the largest errors.
      stochastic: sample blocks with probability by magnitude and rescale them (priority sampling,
        unbiased weight gradient; see ``from_dense``); needs a PRNG key when differentiated: in Flax
        models from the ``"pruning"`` rng stream (``apply(..., rngs={"pruning": key})``), ``key=`` in the ops.
      rounding: ``"nearest"``, or ``"stochastic"`` (unbiased; ``"int8"``/``"int4"`` storage only;
        needs a PRNG key when differentiated).
      backend: the linear layer's weight-gradient kernels, one of ``BACKENDS`` (see
        ``bsr_jax.backends.dispatch``), or ``None``: the op's ``backend=``, else
        ``$BSR_JAX_BACKEND``, else the platform's. Per layer what the environment variable sets
        for all: a rule's ``Pruning(0.0, block=(1, 128), storage_dtype="int4", backend="fused")``
        runs that layer's forward GEMM as the kernel that writes x's codes (GPU;
        ``bsr_jax.backends.fused``). Convolutions and scale/shift layers compute their weight
        gradient with XLA whatever it says, as they do under the variable.
    """

    sparsity: float
    block: BlockSpec = 16
    criterion: Criterion = "l2"
    selection: Selection = "global"
    storage_dtype: StorageDtype | None = None
    stochastic: bool = False
    rounding: Rounding = "nearest"
    backend: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "sparsity", check_sparsity(self.sparsity))
        object.__setattr__(self, "block", normalize_block(self.block))
        if self.criterion not in CRITERIA:
            raise ValueError(f"criterion must be one of {CRITERIA}, got {self.criterion!r}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        check_storage_dtype(self.storage_dtype)
        if not isinstance(self.stochastic, bool):
            raise ValueError(f"stochastic must be a bool, got {self.stochastic!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.rounding == "stochastic" and self.storage_dtype not in STOCHASTIC_ROUNDING_DTYPES:
            raise ValueError(
                f"rounding='stochastic' needs storage_dtype in {STOCHASTIC_ROUNDING_DTYPES}, got {self.storage_dtype!r}"
            )
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {self.backend!r}")

    @property
    def needs_key(self) -> bool:
        """Whether ``compress`` draws random numbers (and so needs a key when differentiated)."""
        return (self.stochastic and self.sparsity > 0) or self.rounding == "stochastic"

    def stored_shape(self, x: jax.Array | jax.ShapeDtypeStruct) -> BlockSparse:
        """The ``BlockSparse`` that ``compress`` makes of ``x (..., K)``, as shapes (nothing runs)."""
        return _stored_shape(self, (math.prod(x.shape[:-1]), x.shape[-1]), jnp.dtype(x.dtype))

    def saves_memory(self, x: jax.Array | jax.ShapeDtypeStruct) -> bool:
        """Whether ``compress(x)`` holds fewer bytes than ``x``. Where it does not (sparsity 0
        without a storage dtype, blocks so large that one covers the matrix, indices outweighing
        the pruned values), the ops keep ``x`` itself: the exact dense residual, never a bigger one."""
        return self.stored_shape(x).nbytes < math.prod(x.shape) * jnp.dtype(x.dtype).itemsize

    def compress(self, x: jax.Array, key: jax.Array | None = None) -> BlockSparse:
        """``from_dense`` of ``x (..., K)`` flattened to ``(M, K)``, with randomness from ``key``.

        Runs in the backward pass's forward rule only, so a stochastic layer needs its key only when
        it is differentiated. The ops name the arrays ``RESIDUAL_NAME`` for ``jax.checkpoint``
        policies once they are materialised (``bsr_jax.storage.barriers.materialize``).
        """
        if self.needs_key and key is None:
            raise ValueError(
                "stochastic pruning needs a PRNG key when differentiated (so does rounding='stochastic'): "
                "pass rngs={'pruning': key} to the Flax module's apply, or key= to the op"
            )
        sample_key = round_key = None
        if self.needs_key:
            sample_key, round_key = jax.random.split(key)
        blocks = from_dense(
            x.reshape(-1, x.shape[-1]),
            self.sparsity,
            self.block,
            criterion=self.criterion,
            selection=self.selection,
            storage_dtype=self.storage_dtype,
            key=sample_key if self.stochastic else None,
            rounding_key=round_key if self.rounding == "stochastic" else None,
        )
        return blocks


PRUNING_OPTIONS = tuple(f.name for f in dataclasses.fields(Pruning))


def as_pruning(pruning: Pruning | None, options: dict[str, Any]) -> Pruning:
    """The one place where the shorthand keywords (``sparsity=0.7, block=16, ...``) become a
    ``Pruning``: ``pruning`` itself when given (then no shorthand may be), else ``Pruning(**options)``."""
    unknown = sorted(set(options) - set(PRUNING_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}; pruning options are {PRUNING_OPTIONS}")
    options = {name: value for name, value in options.items() if value is not None}
    if pruning is not None:
        if not isinstance(pruning, Pruning):
            raise ValueError(f"pruning must be a bsr_jax.Pruning or None, got {pruning!r}")
        if options:
            raise ValueError(f"pass either pruning= or the shorthand options, not both (got pruning and {sorted(options)})")
        return pruning
    if "sparsity" not in options:
        raise ValueError("pass pruning=bsr_jax.Pruning(...) or the shorthand sparsity= (a float in [0, 1))")
    return Pruning(**options)


def check_key(pruning: Pruning, key: jax.Array | None) -> None:
    if key is not None and not (pruning.stochastic or pruning.rounding == "stochastic"):
        raise ValueError("key is only used with stochastic=True or rounding='stochastic'")


# Asked of every compressed layer each time a step is traced (the planner traces one per
# candidate): the trace of from_dense it takes costs as much as the layer's own.
@functools.lru_cache(maxsize=4096)
def _stored_shape(pruning: Pruning, shape: tuple[int, int], dtype: jnp.dtype) -> BlockSparse:
    options = dict(criterion=pruning.criterion, selection=pruning.selection, storage_dtype=pruning.storage_dtype)
    return jax.eval_shape(lambda a: from_dense(a, pruning.sparsity, pruning.block, **options), jax.ShapeDtypeStruct(shape, dtype))
