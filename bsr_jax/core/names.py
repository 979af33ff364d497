"""The ``jax.ad_checkpoint.checkpoint_name``s bsr_jax gives what a backward keeps: ``jax.checkpoint``
policies (``save_only_these_names``, ``name_policy``) and the compiled-memory reports find them by
these names.

Besides its own residuals (``RESIDUAL_NAME``, ``LEAN_NAME``), ``compress_model`` names the tensors
of every linear product and convolution it routes, compressed or not: ``"<layer path>:<role>"``
(``tensor_name``), e.g. ``"block_0/mlp/fc1:input"``, the activation operand of the product, and
``"block_0/mlp/fc1:output"``, its result (before any bias). ``checkpoint_name`` is an identity
outside ``jax.checkpoint``: naming changes no value and no program, only what a policy can match.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jax_core
from jax.extend.core.primitives import name_p

RESIDUAL_NAME = "bsr_blocks"  # a compressed weight-gradient residual (``bsr_jax.BlockSparse``'s arrays)
LEAN_NAME = "bsr_jax_lean"  # a small value worth keeping (ReLU's packed mask, the loss's logsumexp)
# A flash attention kernel's forward residuals (its output and log-sum-exp), named by the caller
# (Pallas splash attention's ``residual_checkpoint_name``): the ``remat-dots-attention`` option keeps them.
FLASH_RESIDUALS = "flash_attention_residuals"
# The per-token losses of a chunked head loss (``bsr_jax.ops.losses``): ``chunked_head_loss`` reads
# from the traced program whether only a sum over every token reads them.
HEAD_LOSSES_NAME = "bsr_jax_head_losses"
INPUT = "input"  # what a linear product or convolution multiplies its parameter with (its weight gradient reads it)
OUTPUT = "output"  # the product's result (before a bias): what remat would otherwise recompute
CHOICES = ("keep", "recompute", "offload")  # name_policy's per-name choices


def tensor_name(path: str, role: str) -> str:
    """The name of the tensor playing ``role`` in the layer at module path ``path``."""
    return f"{path}:{role}"


def tagged(product: Callable[..., Any], path: str) -> Callable[..., Any]:
    """``product(x, w, ...)`` (a ``dot_general`` or ``conv_general_dilated`` whose first operand is
    the activation) with ``x`` named ``path:input`` and its result ``path:output``. Tagging a tagged
    product tags once: an NNX model routed again keeps one name per tensor."""
    product = getattr(product, "untagged", product)

    def named_product(x, w, *args, **kwargs):
        return checkpoint_name(product(checkpoint_name(x, tensor_name(path, INPUT)), w, *args, **kwargs), tensor_name(path, OUTPUT))

    named_product.untagged = product
    return named_product


def _names(jaxpr: Any) -> Any:
    for eqn in jaxpr.eqns:
        if eqn.primitive is name_p:
            yield eqn.params["name"]
        for sub in jax_core.jaxprs_in_params(eqn.params):
            yield from _names(sub)


def tensor_names(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, ...]:
    """Every ``checkpoint_name`` ``fn(*args, **kwargs)`` gives a tensor, in the order they are
    first given (traced with ``jax.make_jaxpr``: nothing compiles; arrays or ``ShapeDtypeStruct``s).
    ``compress_model``'s layers give ``"<layer path>:input"`` and ``":output"`` (``tensor_name``);
    bsr_jax's residuals and the model's own names are listed too."""
    return tuple(dict.fromkeys(_names(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr)))


def name_policy(choices: Mapping[str, str], default: str = "recompute", names: Sequence[str] | None = None) -> Callable[..., Any]:
    """A ``jax.checkpoint`` policy choosing per named tensor: ``"keep"`` (saved on the device),
    ``"recompute"``, or ``"offload"`` (saved in host memory: ``save_and_offload_only_these_names``
    to ``"pinned_host"``).

    Args:
      choices: ``{glob: choice}``; a name takes the choice of the first glob (``fnmatch``, case
        sensitive, ``*`` crossing ``/``) it matches, e.g. ``{"*/attn/*:output": "keep", "*:input":
        "offload"}``.
      default: the choice of a name no glob matches. Tensors without a name are recomputed, as
        under ``jax.checkpoint_policies.save_only_these_names``.
      names: the names the step gives (``tensor_names``): when given, a glob matching none of them
        is a ``ValueError`` (a typo would otherwise keep nothing, silently).
    """
    for where, choice in [*((f"choices[{glob!r}]", c) for glob, c in choices.items()), ("default", default)]:
        if choice not in CHOICES:
            raise ValueError(f"name_policy: {where} must be one of {CHOICES}, got {choice!r}")
    if names is not None:
        unmatched = [glob for glob in choices if not any(fnmatch.fnmatchcase(n, glob) for n in names)]
        if unmatched:
            raise ValueError(f"name_policy: choices {unmatched} match none of the {len(names)} names given in names "
                             f"(e.g. {list(names)[:4]}; bsr_jax.tensor_names lists a step's names)")  # fmt: skip

    @functools.cache
    def by_name(name: str) -> Callable[..., Any]:
        choice = next((c for glob, c in choices.items() if fnmatch.fnmatchcase(name, glob)), default)
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[name] if choice == "keep" else [], names_which_can_be_offloaded=[name] if choice == "offload" else [],
            offload_src="device", offload_dst="pinned_host")  # fmt: skip

    def policy(prim, *avals, **params):
        return by_name(params["name"])(prim, *avals, **params) if prim is name_p else False

    return policy
