"""The planner's vocabulary, shared by ``bsr_jax.plan`` and its linen and NNX halves: what a block
can do (``OPTIONS``), what the rest of the model can do (``REST_OPTIONS``) and budgets."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.extend.core.primitives import name_p
from jax.sharding import NamedSharding

from bsr_jax.core.names import FLASH_RESIDUALS, name_policy
from bsr_jax.storage.pruning import Pruning

REST = "(rest)"  # the choices' key for everything outside the blocks
LOSS = "(loss)"  # the choices' key for the loss where plan(loss_chunk=) chose the chunked one


@dataclasses.dataclass(frozen=True)
class Option:
    """What one block does: its layers' compression (``None``: exact dW), lean neighbours, an
    approximate-dx format, or a remat policy (``remat=True``: the whole block under
    ``jax.checkpoint(policy=policy)``, ``policy=None`` keeping nothing). ``exact_layers``: globs of
    layer paths under the block (``"*/out"``) that the compression leaves exact; a model with no such
    layer in its blocks is not offered the option. ``approximation``: what the option changes in the
    gradients and its documented error (``None``: exact). ``opt_in``: searched only where named in
    ``plan``'s ``options`` (each option searched costs compiles)."""

    compression: Pruning | None = None
    exact_layers: tuple[str, ...] = ()
    lean: bool = True
    dx: str | None = None
    remat: bool = False
    policy: Callable[..., bool] | None = None
    approximation: str | None = None
    opt_in: bool = False

    @property
    def exact(self) -> bool:
        """Whether the gradients are plain autodiff's (up to float reassociation)."""
        return self.approximation is None


# Attention's q/k/v projections by layer name (flax's MultiHeadDotProductAttention: query/key/value;
# GPT-2: c_attn; Llama-style: q_proj), and a MLP's layers by a module on their path.
QKV_LAYERS = ("q", "k", "v", "query", "key", "value", "qkv", "c_attn", "q_proj", "k_proj", "v_proj", "qkv_proj")
_QKV_OUTPUTS = tuple(glob for layer in QKV_LAYERS for glob in (f"{layer}:output", f"*/{layer}:output"))
_MLP_OUTPUTS = ("*[Mm][Ll][Pp]*:output", "*[Ff][Ff][Nn]*:output", "*[Ff]eed[Ff]orward*:output", "*feed_forward*:output")
_INT4 = Pruning(0.0, block=16, storage_dtype="int4")


def _flash_attention_outputs(prim: Any, *_: Any, **params: Any) -> bool:
    """Keeps a flash attention's forward: its output and log-sum-exp, what its backward reads besides
    q, k and v, so it is not run again. cuDNN's (``jax.nn.dot_product_attention`` on a GPU) by its
    primitive; others (Pallas splash attention on TPU) where named ``FLASH_RESIDUALS``."""
    return prim.name == "dot_product_attention_fwd_wrapper" or (prim is name_p and params.get("name") == FLASH_RESIDUALS)


# The errors are relative Frobenius errors against plain autodiff, measured on small models.
_DW_INT4 = "dW from int4 inputs, error 0.04-0.23 (docs/RESULTS.md 3b)"
OPTIONS: Mapping[str, Option] = {
    "keep": Option(lean=False),
    "lean": Option(),
    "int8": Option(Pruning(0.0, block=16, storage_dtype="int8"), approximation="dW from int8 inputs, error 0.002-0.013 (docs/RESULTS.md 3b)"),
    "int4": Option(_INT4, approximation=_DW_INT4),
    "int4-dx8": Option(_INT4, dx="int8", approximation=f"{_DW_INT4}; dx from int8 inputs, error up to 0.014 (docs/memory.md 1.2)"),
    # int4 but the attention's output projection (flax's MultiHeadDotProductAttention names it "out")
    # exact: the lean attention then keeps its output, which that layer keeps anyway, for flash
    # attention's backward instead of autodiff's recomputation (12 x 768 LM, H100: 72.63 -> 69.34 ms
    # for 214 MiB more, docs/RESULTS.md 14.7). Offered only where every block has such a layer.
    "int4-outdense": Option(_INT4, exact_layers=("*/out",), approximation=_DW_INT4),
    # Opt-in: biased, and its kernels' time moved with its neighbours' options (12 x 768 LM, H100:
    # 5.4-8.2 ms a block in one probe), so the cost model mispriced every candidate with it
    # (docs/RESULTS.md 12.9).
    "topk": Option(Pruning(0.7, block=16), approximation="dW from the top 30% of blocks, biased: 55% of its norm lost (docs/RESULTS.md 3)",
                   opt_in=True),
    # int4 in 1 x 128 blocks through the fused kernels (GPU: the forward GEMM writes the
    # codes, dW's reads them; TPU: the unfused path, the same codes).
    "int4-fused": Option(Pruning(0.0, block=(1, 128), storage_dtype="int4", backend="fused"),
                         approximation="dW from int4 inputs in 1 x 128 blocks, error 0.04-0.22 (docs/memory.md 0.1)"),
    "remat": Option(remat=True),
    "remat-dots": Option(remat=True, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
    "remat-dots-all": Option(remat=True, policy=jax.checkpoint_policies.dots_saveable),
    "remat-dots-attention": Option(remat=True, policy=jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _flash_attention_outputs), opt_in=True),
    "remat-offload": Option(remat=True, policy=jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")),
    # MaxText's named policies (minimal, save_qkv_proj, save_dot_except_mlp, qkv_proj_offloaded) on
    # compress_model's tensor names (bsr_jax.core.names): linear layers found by their path.
    "remat-minimal": Option(remat=True, policy=name_policy({"*:output": "keep"}), opt_in=True),
    "remat-save-qkv": Option(remat=True, policy=name_policy(dict.fromkeys(_QKV_OUTPUTS, "keep")), opt_in=True),
    "remat-save-dots-except-mlp": Option(remat=True, policy=name_policy({**dict.fromkeys(_MLP_OUTPUTS, "recompute"), "*:output": "keep"}), opt_in=True),
    "remat-offload-qkv": Option(remat=True, policy=name_policy(dict.fromkeys(_QKV_OUTPUTS, "offload")), opt_in=True),
}
EXACT = tuple(name for name, option in OPTIONS.items() if option.exact and not option.opt_in)  # plan's default search
REST_OPTIONS = ("keep", "lean", "int4")  # OPTIONS' names, for everything outside the blocks
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_budget(budget: int | float | str) -> tuple[str, float]:
    """``("bytes", n)`` or ``("fraction", f)`` (of the dense step's peak).

    An int is bytes (``12 * 2**30``); a float, or a string without a unit, is a fraction in (0, 1]
    (``0.5``, ``"0.5"``); a string with a unit is bytes (``"12GiB"``, ``"800MB"``, ``"1e9B"``).
    Anything else is a ``ValueError`` naming the forms: ``"2.0"`` and ``"100"`` are neither
    fractions nor sizes (bytes say so with a unit)."""
    value, unit = budget, None
    if isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*([a-zA-Z]*)\s*", budget)
        if match is not None and match.group(2).upper() in _UNITS:
            value, unit = float(match.group(1)), match.group(2).upper()
    if isinstance(value, float) and not unit and 0 < value <= 1:
        return "fraction", value
    if (type(value) is int or unit) and value * _UNITS[unit or ""] > 1:
        return "bytes", float(value * _UNITS[unit or ""])
    raise ValueError("budget must be bytes (an int, or a string with a unit like '12GiB' or '800MB') or a fraction of the "
                     f"dense step's peak in (0, 1] (0.5 or '0.5'), got {budget!r}")  # fmt: skip


def abstract(tree: Any) -> Any:
    """Shape structs of ``tree``'s arrays, each keeping its ``NamedSharding`` (a step over a mesh)."""

    def shape_of(a):
        sharding = getattr(a, "sharding", None)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding if isinstance(sharding, NamedSharding) else None)

    return jax.tree.map(lambda a: shape_of(a) if hasattr(a, "shape") else a, tree)

def natural(path: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path))
