"""The LM's causal attention, by ``--attention``; both take grouped-query attention (``kv_heads``).

``"xla"``: ``causal_attention``, a hand-written softmax that holds the ``(B, H, T, T)`` scores and
probabilities in f32, the form ``bsr_jax.compress_model``'s lean pass recognises in users' models.
``"flash"``: ``flash_attention``, with its implementation chosen by the platform the step is
lowered for (``bsr_jax.core.platforms``), so a step compiled ahead of time for an H100 or a TPU on a
CPU host gets the accelerator's: on a GPU ``jax.nn.dot_product_attention``'s cuDNN fused flash
attention, on a TPU Pallas splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``,
causal block mask, grouped heads), neither of which holds the ``(T, T)`` scores; XLA's
``jax.nn.dot_product_attention`` on CPU, which computes what ``"xla"`` computes. Splash takes a
sequence that is a multiple of 128 (its blocks: 512 where T allows, else 128) and a head dimension
that is a multiple of 128; other shapes lower XLA's attention on TPU, with a warning. Inside a
``jax.jit`` over a mesh with Auto axes (not inside ``shard_map``, where arrays are local already), the
kernel runs per shard of the batch under ``jax.shard_map`` over every non-manual axis (a Pallas call
is not partitioned by XLA).

cuDNN's kernel takes bf16 or f16 (a float32 step runs XLA's on every platform) and a head dimension
that is a multiple of 8, at most 128 before Hopper and 256 from it (jax raises otherwise, naming it).
Tracing it needs cuDNN's library (``nvidia-cudnn-cu12``: jax's CUDA wheels bring it, the ``aot`` extra
does not): a host without it, such as a CPU host compiling for ``--target h100``, gets XLA's in the
GPU branch, with a warning. With it, the cuDNN kernel compiles deviceless for an H100 (jax 0.10.2,
cuDNN 9.28); XLA's cost model counts no FLOPs in it, ``bsr_jax.measure.roofline`` counts its products.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp

from bsr_jax.core.names import FLASH_RESIDUALS
from bsr_jax.core.platforms import by_lowering_platform
from bsr_jax.measure import compiled

ATTENTIONS = ("xla", "flash")  # train.lm_config repeats them (a test keeps them equal)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Softmax attention of ``q, k, v (B, T, H, Dh)``, each position attending to itself and earlier
    ones; scores and softmax in f32, output ``(B, T, H, Dh)`` in q's dtype."""
    seq_len, head_dim = q.shape[1], q.shape[3]
    scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq_len, seq_len), jnp.bool_))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bshd->bthd", probs, v)


def grouped_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``causal_attention`` of ``q (B, T, H, Dh)`` with ``k, v (B, T, KV, Dh)``, KV dividing H:
    query head ``h`` attends with key/value head ``h // (H / KV)``, as ``jax.nn.dot_product_attention``
    groups them. The key/value heads are repeated to H, which costs ``(B, T, H, Dh)`` beside the
    ``(B, H, T, T)`` scores; with KV = H nothing is repeated (multi-head attention, as before)."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    return causal_attention(q, k, v)


def _cudnn_on_host() -> bool:
    """Whether cuDNN's attention traces here: jax looks up the cuDNN library's version as it traces
    it (found once jax's CUDA plugin has started, for a GPU or a deviceless GPU target)."""
    bf16 = jax.ShapeDtypeStruct((1, 8, 1, 64), jnp.bfloat16)
    try:
        jax.eval_shape(functools.partial(jax.nn.dot_product_attention, implementation="cudnn"), bf16, bf16, bf16)
        return True
    except RuntimeError:  # "cuDNN not found." (the CUDA plugin without the library), "cuDNN is not detected."
        if compiled.plugin_installed("h100"):  # this host could compile for a GPU: say what that step would run
            warnings.warn("--attention flash: jax finds no cuDNN library here (pip install nvidia-cudnn-cu12), so a step "
                          "lowered here for a GPU runs XLA's attention, holding (B, heads, T, T) scores", stacklevel=3)  # fmt: skip
        return False


SPLASH_LANES = 128  # splash's blocks and head dimension: multiples of the TPU's 128 lanes


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, interpret: bool = False) -> jax.Array:
    """Causal Pallas splash attention (TPU) of ``q (B, T, H, Dh)``, ``k, v (B, T, KV, Dh)``, KV
    dividing H (query head ``h`` reads key/value head ``h // (H / KV)``), output ``(B, T, H, Dh)`` in
    q's dtype; T and Dh multiples of 128. ``interpret``: Pallas's interpreter (any backend, for tests)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    seq_len, heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    block = 512 if seq_len % 512 == 0 else SPLASH_LANES
    sizes = kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
                                  block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)  # fmt: skip
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((seq_len, seq_len))] * heads)
    # Its output and log-sum-exp named, so that a policy can keep them (bsr_jax.plan's remat-dots-attention).
    kernel = kernel_lib.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret,
                                        residual_checkpoint_name=FLASH_RESIDUALS)  # fmt: skip
    heads_first = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731  (B, T, H, Dh) <-> (B, H, T, Dh)
    scaled = (q * (1.0 / math.sqrt(head_dim))).astype(q.dtype)  # splash scales nothing
    return heads_first(_per_batch_shard(jax.vmap(kernel))(heads_first(scaled), heads_first(k), heads_first(v)))


def _per_batch_shard(fn):
    """``fn`` on each device's rows under ``jax.shard_map`` where the step is traced over a mesh
    with non-manual axes (XLA does not partition a Pallas call: it would gather the batch); as it is
    on one device or inside ``shard_map``."""

    def mapped(*operands):
        mesh = jax.sharding.get_abstract_mesh()
        axes = () if mesh.empty else tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t != jax.sharding.AxisType.Manual and mesh.shape[n] > 1)
        if not axes:
            return fn(*operands)
        rows = jax.sharding.PartitionSpec(axes)
        # check_vma off: splash's kernels declare outputs without the axes they vary over (all local here)
        return jax.shard_map(fn, in_specs=(rows,) * len(operands), out_specs=rows, axis_names=set(axes), check_vma=False)(*operands)

    return mapped


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of ``q (B, T, H, Dh)``, ``k, v (B, T, KV, Dh)`` (KV dividing H), output
    ``(B, T, H, Dh)`` in q's dtype, by the platform lowered for: cuDNN's ``jax.nn.dot_product_attention``
    on a CUDA GPU (bf16/f16 inputs, cuDNN on the host), Pallas splash attention on a TPU (T and Dh
    multiples of 128), XLA's ``jax.nn.dot_product_attention`` otherwise."""
    xla = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")
    branches = {}
    if q.dtype in (jnp.bfloat16, jnp.float16) and _cudnn_on_host():
        branches["cuda"] = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
    if q.shape[1] % SPLASH_LANES == 0 and q.shape[3] % SPLASH_LANES == 0:
        branches["tpu"] = splash_attention
    elif compiled.plugin_installed("tpu-v5p"):
        warnings.warn(f"--attention flash: splash attention takes a sequence and head dimension that are multiples of {SPLASH_LANES}, got "
                      f"T {q.shape[1]}, head dimension {q.shape[3]}: a step lowered here for a TPU runs XLA's attention, holding "
                      "(B, heads, T, T) scores", stacklevel=2)  # fmt: skip
    return by_lowering_platform(xla, branches, q, k, v) if branches else xla(q, k, v)


def attention_fn(name: str):
    """The ``(q, k, v) -> out`` function ``--attention name`` runs."""
    return {"xla": grouped_causal_attention, "flash": flash_attention}[name]
