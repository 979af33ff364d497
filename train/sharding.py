"""Data parallelism: a 1-D device mesh over a ``"data"`` axis, batches sharded, params replicated
(or, with FSDP, sharded too: see below).

Per-shard pruning. The loss and its gradients run under ``jax.shard_map``: each device computes
the forward and backward pass of its own ``B / n`` examples, so every ``bsr_jax.Dense`` prunes the
activations of its local shard only (capacity and top-k per shard, from the local shape
``(B / n * rows, K)``) and no activation is gathered across devices. The gradients are then
averaged with ``lax.pmean``. The step therefore equals the mean over shards of single-device
steps on each shard:

    grads = mean_s grad(loss)(params, shard_s)

At sparsity 0 this is the full-batch gradient up to float reassociation (loss is a mean over
equal shards). At sparsity > 0 it differs from pruning the whole batch at once: each shard keeps
its own top ``(1 - sparsity)`` fraction of blocks, i.e. the same memory per device, with a
per-shard rather than global ranking.

BatchNorm (ResNet). Each device normalises with its own shard's batch statistics (no
``axis_name``, as in single-device training at ``B / n``); the updated running averages are
``pmean``-ed with the gradients, so the replicated ``batch_stats`` are the mean of the devices'.

Several processes (hosts, or processes on one machine). ``python -m train.cifar --coordinator
HOST:PORT --num-processes N --process-id I`` (``train.config.Processes``) makes ``join_processes``
call ``jax.distributed.initialize`` before anything starts JAX's backends; ``jax.devices()`` then
lists every device of every process, the mesh spans them all, and cross-process collectives run
over JAX's default CPU implementation (gloo in jax 0.10; NCCL on GPU). Every process iterates the
same deterministic global batches (same seed, epoch, step) and contributes its own rows,
``local_rows``, which ``jax.make_array_from_process_local_data`` assembles into the global array,
so the run computes what one process with all the devices computes. Process 0 writes
``metrics.jsonl``, ``config.json`` and the output; Orbax writes checkpoints collectively to a
directory every process sees. Whatever changes the program's path (a stop signal, the workdir's
records) is agreed by all processes, since a collective that only some of them enter never returns.

Why the loop keeps its own ``shard_map`` rather than ``jax.jit`` over batch-sharded arrays with
the library's per-op ``bsr_jax.core.sharding.map_row_shards``. Measured on 4 host devices (this
module's Auto-axis mesh, the loop's loss, one gradient; ``python -m benchmarks.speed.loop_vs_jit``): for
ResMLP (tiny, sparsity 0.7) a plain ``jit`` gives the same gradients as the ``shard_map``
(difference 0, no all-gather), since each op then ranks its own row shard too; for ResNet-18
(width 8, sparsity 0) it does not (loss 1.5743 vs 1.5108, gradient entries apart by up to 0.89
where the largest is 0.76), because BatchNorm under a plain ``jit`` normalises
with the global batch's statistics (XLA all-reduces them), a different model from the per-device
statistics above that the ResNet runs and their resumes use. Stochastic pruning would change as
well (keys folded per op with the row shard, not once per device). (On Explicit axes the ResMLP
loss under a plain ``jit`` gives the loop's gradients too: tests/train/data_parallel_check.py.) Keeping per-device BatchNorm under ``jit``
would need a ``shard_map`` anyway, so switching would not simplify ``train/``: the loop keeps this
one function, and every op inside it runs on its local shard unchanged (``map_row_shards`` sees
the manual axis and steps aside). The per-op mechanism is for models under a user's own ``jit``.

FSDP (``train.lm --fsdp``): parameters, their AdamW moments and their gradients sharded over
``"data"`` too, so each device stores ``1 / n`` of them. Each leaf of the train state is split
along one dimension, the largest that ``n`` divides (``fsdp_spec``; a function of the shape alone,
so a parameter and its two moments split alike); a leaf with no such dimension (a scalar step
count, a vector whose length ``n`` does not divide) stays replicated. The design keeps the
``shard_map`` above and changes only its edges: the parameters enter as shards, each leaf is
``all_gather``-ed whole at the start of the per-device function, the loss and its gradients run on
the local batch shard exactly as without FSDP (so compression stays per shard, and stochastic keys
are folded per device as before), and each gradient leaves through ``psum_scatter`` (divided by
``n``: the same mean as ``pmean``, each device receiving only its shard) where the replicated
path ``pmean``-s it. The optimizer update then runs under the step's ``jit`` on shards: it is
elementwise, so XLA keeps it local, adding only the scalar all-reduce of the global gradient norm.
Numerically nothing changes but the order of the cross-device sums. (A plain ``jit`` with sharded
parameters would leave XLA to choose, per product, between gathering weights and splitting the
product over them, and the per-device keys and ranking above would no longer be this one function's.)
Layer by layer (``layers=``, a scanned model's stacked parameters, ``train.lm --scan --fsdp``): the
leaves under that key are split along a dimension other than the leading, stacking one, and are not
gathered up front. The model gathers each layer's slice as that layer runs (``layer_gather``; each
leaf cast to the dtype the layer computes with it before the gather, so bf16 crosses the link where
the products read bf16) and, since the layer's checkpoint policy keeps anything but what is gathered
(``no_gathered_parameters``), gathers it again in its backward rather than keeping it. The transpose
of that all-gather is the reduce-scatter of the layer's gradient (cast back to f32 first, as without
the early cast: the same sums as above), so each device holds one layer's whole parameters and
gradients at a time, not the model's (ZeRO-3; MaxText's FSDP is the same inside its scan). Without
``layers`` (an unscanned model) every leaf is gathered whole at the start. Measured:
docs/training.md, docs/RESULTS.md sections 15-15.2.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from train.config import Processes

DATA_AXIS = "data"
LayerGather = Callable[[Any, Any], Any]  # (one layer's parameter shards, their dtypes) -> the parameters whole
_LAYER_GATHER: contextvars.ContextVar[LayerGather | None] = contextvars.ContextVar("layer_gather", default=None)


def join_processes(processes: Processes) -> None:
    """Join a run over ``processes.num_processes`` processes (a no-op for one): call before
    anything starts JAX's backends (a ``jax.devices()``, a first array)."""
    if processes.num_processes > 1:
        jax.distributed.initialize(processes.coordinator, processes.num_processes, processes.process_id)


def sync_processes(name: str) -> None:
    """Wait until every process has reached the ``sync_processes(name)`` call (no-op for one)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def make_mesh(devices: list[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh over ``devices`` (default: all devices of all processes), axis ``"data"``."""
    return Mesh(np.asarray(jax.devices() if devices is None else devices), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over ``"data"``, other axes whole."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def local_rows(batch: Any) -> Any:
    """This process's contiguous slice of a global host batch (the whole batch with one process)."""
    count, index = jax.process_count(), jax.process_index()
    if count == 1:
        return batch

    def rows(x: np.ndarray) -> np.ndarray:
        per = x.shape[0] // count
        return x[index * per : (index + 1) * per]

    return jax.tree.map(rows, batch)


def fsdp_spec(shape: tuple[int, ...], devices: int, stacked: bool = False) -> PartitionSpec:
    """How FSDP splits a leaf of ``shape`` over ``devices``: along its largest dimension that
    ``devices`` divides (the first of equal ones), or not at all where none does; a ``stacked``
    leaf (layers on its leading axis) never along the leading one."""
    dims = [d for d, size in enumerate(shape) if size % devices == 0 and not (stacked and d == 0)]
    if not dims:
        return PartitionSpec()
    dim = max(dims, key=lambda d: shape[d])
    return PartitionSpec(*[None] * dim, DATA_AXIS)


def _under(path: tuple, key: str | None) -> bool:
    return key is not None and any(getattr(k, "key", None) == key for k in path)


def state_shardings(state: Any, mesh: Mesh, fsdp: bool, layers: str | None = None) -> Any:
    """A ``NamedSharding`` per leaf of ``state`` (arrays or shape structs): ``fsdp_spec``'s with
    ``fsdp``, else replicated; leaves under a ``layers`` key (parameters and their moments alike)
    are stacked layers, split along another than their leading axis (the module docstring)."""
    devices = mesh.size  # a Mesh or an AbstractMesh (bsr_jax.plan traces the step on one)

    def placed(path, x):
        return NamedSharding(mesh, fsdp_spec(x.shape, devices, _under(path, layers)) if fsdp else PartitionSpec())

    return jax.tree_util.tree_map_with_path(placed, state)


def layer_gather() -> LayerGather | None:
    """While ``data_parallel_grad`` traces a loss that gathers layer by layer: the function
    ``gather(params, dtypes)`` a scanned model applies to one layer's parameters (a slice of the
    stacked ``layers`` shards) to gather them whole, each cast to its leaf of ``dtypes`` (the dtype
    the layer computes with it); None otherwise, when parameters come whole. The model's layer keeps
    none of them for the backward (``no_gathered_parameters``, as ``train.lm_model.LM`` does)."""
    return _LAYER_GATHER.get()


@contextlib.contextmanager
def _gathering(gather: LayerGather) -> Iterator[None]:
    token = _LAYER_GATHER.set(gather)
    try:
        yield
    finally:
        _LAYER_GATHER.reset(token)


def _sharded_dim(spec: PartitionSpec) -> int | None:
    return list(spec).index(DATA_AXIS) if DATA_AXIS in spec else None


def _whole(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """A parameter leaf whole and marked per-device (varying), so its gradient stays this shard's
    own (rather than being summed implicitly by the transpose of a broadcast) and the one reduction
    is the explicit one in ``_mean``. An all-gather's result already varies per device."""
    dim = _sharded_dim(spec)
    if dim is None:
        return jax.lax.pcast(x, DATA_AXIS, to="varying")
    return jax.lax.all_gather(x, DATA_AXIS, axis=dim, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gathered_as(x: jax.Array, spec: PartitionSpec, dtype: Any) -> jax.Array:
    """``_whole(x, spec).astype(dtype)``, cast before it is gathered (the link carries ``dtype``'s
    bytes), its gradient cast back to x's dtype before it is reduce-scattered (as the gradient of
    a cast after the gather would be: the same sums, in x's dtype)."""
    return _whole(x.astype(dtype), spec)


def _gathered_as_forward(x, spec, dtype):
    return _gathered_as(x, spec, dtype), jnp.zeros((0,), x.dtype)  # no residual but x's dtype


def _gathered_as_backward(spec, dtype, carrier, g):
    g, dim = g.astype(carrier.dtype), _sharded_dim(spec)  # _whole's transpose:
    return (jax.lax.psum(g, DATA_AXIS) if dim is None else jax.lax.psum_scatter(g, DATA_AXIS, scatter_dimension=dim, tiled=True),)


_gathered_as.defvjp(_gathered_as_forward, _gathered_as_backward)


def no_gathered_parameters(prim: Any, *_: Any, **params: Any) -> bool:
    """A ``jax.checkpoint`` policy keeping anything but what ``layer_gather`` gathers (an all-gather,
    or the custom-gradient cast-and-gather around one, which the policy sees whole): the layer's
    products then read parameters gathered again in the backward from the shards."""
    if prim is jax.lax.all_gather_p:
        return False
    inner = params.get("call_jaxpr") if prim.name == "custom_vjp_call" else None
    return inner is None or not any(e.primitive is jax.lax.all_gather_p for e in inner.jaxpr.eqns)


def keeping_no_gathered(policy: Callable[..., Any] | None) -> Callable[..., Any]:
    """``policy`` (None: keep nothing) that never keeps what ``layer_gather`` gathers."""

    def keeps(prim: Any, *args: Any, **params: Any) -> Any:
        return no_gathered_parameters(prim, *args, **params) and policy is not None and policy(prim, *args, **params)

    return keeps


def _mean(g: jax.Array, spec: PartitionSpec) -> jax.Array:
    """The mean over devices of a gradient leaf, as ``spec`` stores it: each device gets its shard."""
    dim = _sharded_dim(spec)
    if dim is None:
        return jax.lax.pmean(g, DATA_AXIS)
    return jax.lax.psum_scatter(g, DATA_AXIS, scatter_dimension=dim, tiled=True) / jax.lax.axis_size(DATA_AXIS)


def data_parallel_grad(
    loss_fn: Callable[..., tuple[jax.Array, Any]], mesh: Mesh, fsdp: bool = False, layers: str | None = None
) -> Callable[..., tuple[tuple[jax.Array, Any], Any]]:
    """``(params, batch, rng=None, batch_stats=None) -> ((loss, aux), grads)`` averaged over the
    shards of ``batch``.

    ``loss_fn(params, batch, rng) -> (loss, aux)`` (``loss_fn(params, batch, rng, batch_stats)``
    when ``batch_stats`` is given; not differentiated) is a mean over its batch; ``aux`` a pytree of
    scalar means (and the updated ``batch_stats``, which are averaged the same way). Each device differentiates it on its local shard (see the module docstring for
    the pruning semantics), with ``rng`` (if given) folded with the device's index so stochastic
    pruning draws independently per shard; losses, aux and grads are ``pmean``-ed, so all outputs
    are replicated. With ``fsdp``, ``params`` come sharded as ``state_shardings`` shards them and
    the gradients leave sharded alike (the module docstring's FSDP); with ``fsdp`` and ``layers``
    (the top-level key of a scanned model's stacked layers), the model gathers those layer by layer
    through ``layer_gather`` (the module docstring).
    """
    per_layer = layers if fsdp else None

    def grad(params, batch, rng=None, batch_stats=None):
        specs = jax.tree.map(lambda s: s.spec, state_shardings(params, mesh, fsdp, per_layer))
        if per_layer is not None and per_layer not in params:
            raise ValueError(f"layers={per_layer!r}: no such key in the parameters, whose keys are {sorted(params)}")

        def whole(params):  # all but the stacked layers, which layer_gather gathers one at a time
            return {k: v if k == per_layer else jax.tree.map(_whole, v, specs[k]) for k, v in params.items()}

        def mean(grads):  # the stacked layers' come reduce-scattered (summed) by their gathers' transposes
            n = jax.lax.axis_size(DATA_AXIS)
            return {k: jax.tree.map(lambda g: g / n, v) if k == per_layer else jax.tree.map(_mean, v, specs[k]) for k, v in grads.items()}

        def gather_layer(layer_params, dtypes):
            layer_specs = jax.tree.map(lambda s: PartitionSpec(*s[1:]), specs[per_layer])
            return jax.tree.map(_gathered_as, layer_params, layer_specs, dtypes)

        def local(params, batch, rng, batch_stats):
            if rng is not None:
                rng = jax.random.fold_in(rng, jax.lax.axis_index(DATA_AXIS))
            extra = () if batch_stats is None else (batch_stats,)
            if per_layer is None:
                (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(jax.tree.map(_whole, params, specs), batch, rng, *extra)
                grads = jax.tree.map(_mean, grads, specs)
            else:
                with _gathering(gather_layer):
                    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(whole(params), batch, rng, *extra)
                grads = mean(grads)
            return jax.lax.pmean((loss, aux), DATA_AXIS), grads

        replicated_spec = PartitionSpec()
        in_specs = (specs, PartitionSpec(DATA_AXIS), replicated_spec, replicated_spec)
        # check_vma off: Pallas kernels (splash attention, --attention flash on TPU) declare outputs
        # without the axes they vary over, which the check refuses; every reduction here is explicit
        # (data_parallel_check: the same steps as one device; test_lm_fsdp: as replicated).
        mapped = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(replicated_spec, specs), check_vma=False)
        return mapped(params, batch, rng, batch_stats)

    return grad
