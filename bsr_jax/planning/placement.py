"""Planning a step sharded over a mesh: the arguments' shardings, moved onto the deviceless target.

A user scaling out with ``jax.jit`` over sharded arrays places parameters and the batch with
``NamedSharding``s on their mesh (real devices, host devices in a test, or an ``AbstractMesh``).
``plan`` keeps those shardings: ``target_mesh`` builds a mesh of the same axis names, sizes and
types on the target's deviceless devices (8 H100s of one host, a TPU v5p 2x2x2 slice), ``on_mesh``
re-homes every argument onto it (unsharded ones replicated), and ``optimizer_state_on_mesh``
shards the optimizer's state as its parameters (optax's ``tree_map_params``: AdamW's moments as
their parameters, counts replicated). Every compiled candidate is then the per-device program of
XLA's SPMD partitioner: its peak is one device's, its modelled time counts the collectives.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bsr_jax.measure.compiled import target_devices


def _meshes(tree: Any) -> set[tuple]:
    """``(axis names, sizes, types)`` of every mesh that ``tree``'s leaves are placed on by name."""
    found = set()
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            mesh = sharding.mesh
            found.add((tuple(mesh.axis_names), tuple(mesh.axis_sizes), tuple(mesh.axis_types)))
    return found


def target_mesh(tree: Any, target: str) -> Mesh | None:
    """The mesh ``tree``'s ``NamedSharding``s are on, rebuilt on ``target``'s deviceless devices
    (same axis names, sizes and types); None where no leaf carries one (a one-device step)."""
    meshes = _meshes(tree)
    if not meshes:
        return None
    if len(meshes) > 1:
        described = sorted(", ".join(f"{n}={s}" for n, s in zip(names, sizes)) for names, sizes, _ in meshes)
        raise ValueError(f"plan: the variables and batch are placed on {len(meshes)} different meshes ({'; '.join(described)}): use one")
    names, sizes, types = meshes.pop()
    devices = target_devices(target)
    if math.prod(sizes) > len(devices):
        raise ValueError(f"plan: the arguments' mesh has {math.prod(sizes)} devices ({dict(zip(names, sizes))}); "
                         f"{target}'s deviceless topology has {len(devices)}")  # fmt: skip
    return Mesh(np.array(devices[: math.prod(sizes)]).reshape(sizes), names, axis_types=types)


def on_mesh(tree: Any, mesh: Mesh) -> Any:
    """Every array leaf of ``tree`` as a ``jax.ShapeDtypeStruct`` on ``mesh`` with its
    ``NamedSharding``'s spec (replicated where it has none)."""

    def place(path, leaf):
        if not hasattr(leaf, "shape"):
            return leaf
        sharding = getattr(leaf, "sharding", None)
        placed = NamedSharding(mesh, sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec())
        try:
            placed.shard_shape(leaf.shape)
        except ValueError as error:  # jax's IndivisibleError
            raise ValueError(f"plan: {jax.tree_util.keystr(path)} of shape {leaf.shape} cannot be split as {placed.spec} over "
                             f"{dict(mesh.shape)}: each split dimension must be a multiple of its axes' devices") from error  # fmt: skip
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=placed)

    return jax.tree_util.tree_map_with_path(place, tree)


def optimizer_state_on_mesh(optimizer: optax.GradientTransformation, params: Any, opt_state: Any, mesh: Mesh) -> Any:
    """``opt_state`` (abstract) on ``mesh``: every copy of the parameter tree in it (AdamW's
    moments) sharded as ``params``, everything else (counts, schedules' state) replicated."""
    specs = jax.tree.map(lambda p: p.sharding.spec, params)
    placed = optax.tree_map_params(optimizer, lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec)),
                                   opt_state, specs, transform_non_params=lambda s: s,
                                   is_leaf=lambda x: isinstance(x, PartitionSpec))  # fmt: skip
    return on_mesh(placed, mesh)


def bytes_per_device(tree: Any) -> int:
    """What ``tree``'s arrays take on one device: each leaf's shard (the whole leaf where it is
    not placed by name). Leaves without a plain dtype (PRNG keys) count nothing."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if not hasattr(leaf, "shape"):
            continue
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if isinstance(sharding, NamedSharding) else leaf.shape
        total += math.prod(shape) * getattr(leaf.dtype, "itemsize", 0)
    return total


__all__ = ["bytes_per_device", "on_mesh", "optimizer_state_on_mesh", "target_mesh"]
