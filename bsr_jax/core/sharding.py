"""Per-shard ops on sharded arrays: the one place where an op is mapped over the shards of its rows.

Every op (``pruned_dot_general``/``bsr_linear``, ``bsr_scale_shift``, ``compressed_conv``) calls
``map_row_shards``. Under ``jax.jit`` with arrays placed on a mesh, it wraps the op's local
computation in ``jax.shard_map``, so that:

* compression runs per shard of the rows: each device ranks the blocks of its own rows (capacity
  and top-k from the local shape, the same memory per device as one device with the local batch);
  the kept blocks never leave the device that owns the rows;
* parameters enter as they are sharded along their output features (tensor parallel), and are
  gathered only along axes that also split the rows or disagree with x's contracted axes (FSDP:
  the usual parameter all-gather; the transpose reduce-scatters dW back to the parameter's sharding);
* every operand is cast to vary over the union of the manual axes the operands vary over, so
  autodiff's transpose of that cast sums dW over the row shards (and dx over the shards of the
  output features): an all-reduce or reduce-scatter of dW only, never a gather of x, dy or blocks.

Which mesh axes split the rows. Explicit axes (``jax.make_mesh``'s default): read from the types,
``jax.typeof(x).sharding.spec``; every Explicit axis goes manual inside the op. Auto axes carry no
placement while tracing, so the op assumes x's leading axis is split over the mesh's only axis, or
over the axes named by ``batch_axes(...)`` around the tracing (several Auto axes and no
declaration is an error). Only those go manual: the other Auto axes stay Auto inside the op, so
XLA's partitioner keeps a kernel split over them; ``per_column_shard`` runs the opaque dW
kernels per shard of dy's columns (which needs ``jax.set_mesh(mesh)`` around the step) and
``whole_on_each_device`` keeps the block ranking whole on every device of those axes. A mesh
mixing Auto and Explicit axes is not supported. Inside an existing ``shard_map`` (``train``'s loop)
the manual axes are already local and the op runs unchanged. See docs/sharding.md.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec

Labels = tuple[str, ...]
_DECLARED_BATCH_AXES: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("batch_axes", default=None)


@contextlib.contextmanager
def batch_axes(*names: str) -> Iterator[None]:
    """Declare the Auto mesh axes that split the batch (x's leading axis) while ops are traced.

    Needed only for meshes with several Auto axes (Explicit axes carry their placement in the
    types). It is read at tracing time, so put it around the first call of a jitted function."""
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"batch_axes takes one or more mesh axis names, got {names!r}")
    token = _DECLARED_BATCH_AXES.set(tuple(names))
    try:
        yield
    finally:
        _DECLARED_BATCH_AXES.reset(token)


def _mesh_of(arrays: Sequence[jax.Array]):
    for a in arrays:
        mesh = jax.typeof(a).sharding.mesh
        if not mesh.empty:
            return mesh
    return jax.sharding.get_abstract_mesh()


def on_explicit_axes(*arrays: jax.Array) -> bool:
    """Whether the arrays are placed on a mesh with Explicit axes (whose types demand that every
    op name its output placement; ``map_row_shards`` does)."""
    mesh = _mesh_of(arrays)
    return not mesh.empty and AxisType.Explicit in mesh.axis_types


def _spec_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _auto_row_axes(mesh) -> tuple[str, ...]:
    declared = _DECLARED_BATCH_AXES.get()
    if declared is not None:
        unknown = [n for n in declared if n not in mesh.axis_names]
        if unknown:
            raise ValueError(f"batch_axes {unknown} are not axes of the mesh {dict(mesh.shape)}")
        return declared
    if len(mesh.axis_names) == 1:
        return tuple(mesh.axis_names)
    raise ValueError(
        f"bsr_jax cannot see how x is placed on the Auto mesh axes {dict(mesh.shape)} while tracing: trace "
        "the step inside `with bsr_jax.core.sharding.batch_axes('data'):` (the axes splitting the batch), or use "
        "Explicit axes (jax.make_mesh's default), whose placement the types carry"
    )


def _manual_candidates(mesh) -> tuple[str, ...]:
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    free = [n for n in mesh.axis_names if types[n] != AxisType.Manual and mesh.shape[n] > 1]
    kinds = {types[n] for n in free}
    if len(kinds) > 1:
        raise ValueError(f"bsr_jax ops support meshes whose non-manual axes are all Auto or all Explicit, got {mesh}")
    return tuple(free)


def vary_over(a: jax.Array, axes: set[str] | frozenset[str]) -> jax.Array:
    """``a``, typed as varying over ``axes`` (the manual mesh axes it does not vary over yet are
    ``pcast``; its values are unchanged)."""
    missing = tuple(sorted(axes - jax.typeof(a).manual_axis_type.varying))
    return lax.pcast(a, missing, to="varying") if missing else a


def map_row_shards(
    fn: Callable[..., Any],
    x: jax.Array,
    params: Sequence[jax.Array],
    *,
    x_labels: Labels,
    param_labels: Sequence[Labels],
    out_labels: Labels,
    key: jax.Array | None = None,
    row_stacked: Any = None,
    whole: frozenset[str] = frozenset(),
) -> Any:
    """``fn(x, params, key, row_stacked)`` on each device's shard of x's rows; the global result.

    Labels name the axes, einsum style: a label of x that no parameter has is a row axis; a label
    of the inputs missing from ``out_labels`` is contracted, and the op's local outputs are summed
    over the mesh axes splitting it (``psum``); labels in ``whole`` may not be split (e.g. a
    convolution's spatial axes: ``ValueError`` if x is split along them).

    Args:
      fn: ``(x_local, params_local, key_local, row_stacked_local) -> y_local``, the op on local
        arrays (it may be a ``custom_vjp``; the casts and sums around it carry the communication).
      x: the activation, any rank; its sharding decides the row and contracted axes.
      params: parameters (kernel, scale), re-placed as the labels require.
      key: an optional PRNG key, replicated; each row shard folds in its index.
      row_stacked: an optional pytree made by a per-shard computation of the same rows (every
        leaf's axis 0 stacks the shards: ``compress_rows``' output).

    Without a multi-device mesh, or with every axis already manual, this is ``fn(x, params, key,
    row_stacked)``.
    """
    mesh = _mesh_of([x, *params])
    candidates = () if mesh.empty else _manual_candidates(mesh)
    if not candidates:
        return fn(x, list(params), key, row_stacked)
    explicit = dict(zip(mesh.axis_names, mesh.axis_types))[candidates[0]] == AxisType.Explicit
    labelled = [(x, x_labels), *zip(params, param_labels)]
    assigned: dict[str, tuple[str, ...]] = {}
    used: set[str] = set()
    if explicit:
        x_spec = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
        for label, entry in zip(x_labels, x_spec):
            axes = tuple(a for a in _spec_axes(entry) if a in candidates)
            if axes and label in whole:
                raise ValueError(f"x's axis {x_labels.index(label)} ({label}) cannot be split for this op, got {entry!r}")
            assigned[label] = axes
            used.update(axes)
        for p, labels in zip(params, param_labels):
            p_spec = tuple(jax.typeof(p).sharding.spec) + (None,) * p.ndim
            for label, entry in zip(labels, p_spec):
                if label not in assigned:
                    axes = tuple(a for a in _spec_axes(entry) if a in candidates and a not in used and label not in whole)
                    assigned[label] = axes
                    used.update(axes)
    else:
        row_axes = _auto_row_axes(mesh)
        left_to_xla = sorted(set(candidates) - set(row_axes))
        if left_to_xla and jax.sharding.get_abstract_mesh().empty:
            # per_column_shard's custom_partitioning lowers inside shard_map only on a concrete
            # mesh (jax 0.10), which shard_map takes from jax.set_mesh: the types carry none.
            raise ValueError(
                f"bsr_jax ops on a mesh whose Auto axes {left_to_xla} do not split the batch need the mesh set "
                "while tracing and compiling: run the jitted step inside `with jax.set_mesh(mesh):`"
            )
        assigned = {label: () for _, labels in labelled for label in labels}
        assigned[x_labels[0]] = row_axes
    spec = lambda labels: PartitionSpec(*(_entry(assigned.get(label, ())) for label in labels))
    in_labels = {label for _, labels in labelled for label in labels}
    summed = tuple(a for label in sorted(in_labels - set(out_labels)) for a in assigned[label])
    param_names = {label for labels in param_labels for label in labels}
    row_axes = tuple(a for label in x_labels if label not in param_names for a in assigned[label])
    # Under Auto axes only the rows' axes go manual: the others stay Auto inside, so XLA's
    # partitioner keeps a kernel split over them (tensor parallel) without gathering it.
    manual = frozenset(candidates) if explicit else frozenset(row_axes)
    if explicit:
        # Explicit types must match the specs on entry; a reshard of a parameter (never of x, whose
        # own placement defines the specs) is the FSDP / disagreeing-axes gather.
        params = [jax.sharding.reshard(p, NamedSharding(mesh, spec(labels))) for p, labels in zip(params, param_labels)]
    union = {a for _, labels in labelled for label in labels for a in assigned[label]}

    def local(x, params, key, row_stacked):
        x, params = vary_over(x, union), [vary_over(p, union) for p in params]
        if key is not None and row_axes:
            key = jax.random.fold_in(key, lax.axis_index(row_axes))
        y = fn(x, params, key, row_stacked)
        return lax.psum(y, summed) if summed else y

    stacked_spec = PartitionSpec(_entry(row_axes))
    in_specs = (spec(x_labels), [spec(labels) for labels in param_labels], PartitionSpec(), stacked_spec)
    mapped = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=spec(out_labels), axis_names=manual)
    return mapped(x, list(params), key, row_stacked)


def compress_rows(compress: Callable[[jax.Array, jax.Array | None], Any], x: jax.Array, key: jax.Array | None = None) -> Any:
    """``compress(x_local, key_local)`` per shard of x's rows (``x`` of shape ``(M, K)``), the
    leaves stacked along axis 0 over the shards: what ``map_row_shards(..., row_stacked=)`` takes.
    For callers that compress once and share the blocks between ops (``compress_model``)."""
    if x.ndim != 2:
        raise ValueError(f"compress_rows takes x of shape (M, K), got {x.shape}")
    return map_row_shards(
        lambda xl, _, k, __: compress(xl, k), x, [], x_labels=("rows", "k"), param_labels=[], out_labels=("rows",),
        key=key, whole=frozenset({"k"}),
    )


def _free_auto_axes() -> tuple[str, ...]:
    """Auto axes (of size > 1) of the mesh being traced that are not manual: XLA partitions over them
    (the abstract mesh is set inside ``shard_map`` and under ``jax.set_mesh``, empty otherwise)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Auto and mesh.shape[n] > 1)


def whole_on_each_device(a: jax.Array) -> jax.Array:
    """``a``, kept whole (replicated) over the Auto axes XLA partitions inside ``map_row_shards``.

    For small per-shard computations with a global order (ranking block scores): left to XLA, they
    are split over those axes and their pieces all-gathered step by step; replicated, each device
    computes them whole (one gather of ``a`` at most, where ``a`` itself arrived split)."""
    if not _free_auto_axes():
        return a
    return lax.with_sharding_constraint(a, PartitionSpec())


def per_column_shard(fn: Callable[..., jax.Array], *operands: Any) -> jax.Array:
    """``fn(*operands)``: a 2-D ``(R, N)`` result whose columns are those of the last operand, a 2-D
    ``(M, N)`` array (dy of a weight gradient), computed on each device's shard of those columns.

    Inside ``map_row_shards`` on an Auto mesh, axes other than the rows' are left to XLA's
    partitioner, which cannot look into an opaque kernel (the CPU custom call, a Pallas call) and
    would gather its operands. Here the partitioner is told (``custom_partitioning``) that the
    result's columns follow dy's and that every other operand (pytrees allowed: the kept blocks) is
    whole, so a dy split over an Auto axis (tensor parallel) stays split and the kernel runs per
    shard. Elsewhere (no free Auto axis) it is ``fn(*operands)``.
    """
    if not _free_auto_axes():
        return fn(*operands)
    leaves, tree = jax.tree.flatten(operands)
    dy = leaves[-1]
    if dy.ndim != 2:
        raise ValueError(f"per_column_shard needs a 2-D last operand (M, N), got shape {dy.shape}")
    flat_fn = lambda *leaves: fn(*jax.tree.unflatten(tree, leaves))
    partitioned = custom_partitioning(flat_fn)
    # Every factor but dy's columns (n) needs replication; r (the result's rows) is the result's own.
    names = [[f"a{i}_{d}" for d in range(leaf.ndim)] for i, leaf in enumerate(leaves[:-1])]
    rule = ", ".join([" ".join(n) for n in names] + ["m n"]) + " -> r n"
    whole = tuple(n for group in names for n in group) + ("m",)

    def partition(mesh, arg_shapes, result_shape):
        shardings = tuple(a.sharding for a in arg_shapes)
        return mesh, flat_fn, shardings[-1], shardings

    partitioned.def_partition(
        partition=partition,
        infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: arg_shapes[-1].sharding,
        sharding_rule=rule,
        need_replication_factors=whole,
    )
    return partitioned(*leaves)
